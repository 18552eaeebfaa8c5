"""State one model server shares between its listeners and API modules, and the few helpers
every inference endpoint uses: JSON body reading, admission, running work on the model thread.

Kept apart from ``server.py`` so the OpenAI API module (``openai_api.py``) and the server can
both use them without importing each other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import random
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, TypeVar

from aiohttp import web
from sparsegate_contracts.canary import REQUEST_ID_HEADER, routes_to_canary
from sparsegate_contracts.gate import DEFAULT_DOCUMENT, GateDocument, GateParams

from .hf_serving import HFServedModel
from .metrics import ServerMetrics
from .model import ModelConfig, TinyMoELM
from .model_thread import ModelThread
from .precision import Precision
from .threshold_control import ThresholdControl, ThresholdController
from .tools import ToolRegistry

if TYPE_CHECKING:
    from sparsegate_contracts.request_access import AccessTable

    from .caller_auth import CachedReviewer

if TYPE_CHECKING:  # batch_engine imports this module (ApiError)
    from .batch_engine import BatchEngine

MAX_BODY_BYTES = 1 << 20
# Admission: requests admitted at once (running + waiting for the one model thread). Beyond it the
# server answers 429 at once instead of queueing without bound; a request that waits longer than
# the timeout for its result answers 503 (its batch still finishes, its slot is then freed).
DEFAULT_MAX_INFLIGHT = 256  # the order of vLLM's max_num_seqs (256) and TGI's max_concurrent_requests (128)
DEFAULT_REQUEST_TIMEOUT_S = 30.0
BUILTIN_MODEL_NAME = "builtin"  # model_name label of the built-in model's metrics

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class AppliedGate:
    doc: GateDocument
    precisions: tuple[Precision, ...]
    applied_at: float
    params: GateParams      # doc.params with experts per token clamped into the model's bounds
    # targetExpertsPerToken set: the PI loop that moves this version's threshold between batches.
    # Its live threshold is state beside the immutable document, used only on the model thread.
    controller: ThresholdController | None = None
    # A checkpoint's request-level canary: its gate pinned per request beside the installed one
    # (hf.gated_block.ActiveGate; None for the installed gate and for the built-in model).
    hf_gate: Any = None

    def routed_params(self) -> GateParams:
        """The params the next batch routes with: the controlled threshold when there is one."""
        return self.controller.params(self.params) if self.controller is not None else self.params


@dataclasses.dataclass(frozen=True)
class CanaryGate:
    """The second version a server holds during a request-level canary (contracts ``canary``)."""

    gate: AppliedGate
    weight: float           # share of requests routed to it, [0, 1]
    sticky_header: str      # request header whose value keys the choice (e.g. x-session-id)


def threshold_controller(params: GateParams) -> ThresholdController | None:
    """A fresh controller for a gate with ``targetExpertsPerToken`` (None without it), starting
    at its confidenceThreshold clamped into the controller's threshold bounds."""
    if params.target_experts_per_token is None:
        return None
    control = ThresholdControl(target_experts=params.target_experts_per_token)
    start = min(max(params.confidence_threshold, control.min_threshold), control.max_threshold)
    return ThresholdController(control, initial_threshold=start)


@dataclasses.dataclass
class ServerState:
    model_config: ModelConfig
    rng: random.Random
    gate: AppliedGate | None = None       # swapped by reference, never mutated
    # The request-level canary held beside ``gate`` (None: every request runs ``gate``). Both are
    # assigned together on the event loop with no await between, so a request never reads half
    # of a change.
    canary: CanaryGate | None = None
    # A checkpoint's installed gate: set on the model thread where it is installed, read there by
    # a batch that runs the stable (``gate`` follows on the event loop, with ``canary``).
    installed: AppliedGate | None = None
    # Held by PUT /admin/gate from its body read to its answer: one PUT at a time, in arrival
    # order. A checkpoint's swap awaits the model thread, so two interleaved PUTs could leave the
    # older set in force after the newer was answered (documents carry no order to compare).
    gate_lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)
    pending_doc: GateDocument = DEFAULT_DOCUMENT
    model: TinyMoELM | None = None        # the built-in model (None with a checkpoint)
    model_path: str | None = None         # a Hugging Face checkpoint directory instead of it
    served_name: str | None = None        # its OpenAI model id (None: the directory's name)
    model_dtype: str = "float32"          # its compute dtype (hf_serving.DTYPES)
    device: str = "auto"                  # its --device (devices.resolve_device)
    # its --expert-placement-json, parsed (hf.placement.parse_placement); None: none
    expert_placement: dict | None = None
    max_num_seqs: int = 32                # sequences its engine decodes together
    hf: HFServedModel | None = None       # the loaded checkpoint
    engine: BatchEngine | None = None     # its continuous-batching generation engine
    executor: ModelThread | None = None
    # Tokenizes OpenAI prompts (and renders chat templates) off the event loop: a 1 MiB prompt
    # took ~0.8 s there, stalling every other request and stream that long. One thread, so
    # prompts queue behind each other rather than contend with the model thread.
    tokenizer_thread: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sparsegate-tokenizer"))
    metrics: ServerMetrics | None = None
    started: float = dataclasses.field(default_factory=time.monotonic)
    started_wall: float = dataclasses.field(default_factory=time.time)  # /v1/models "created"
    load_error: str | None = None  # the background model load failed: unhealthy, with this reason
    max_inflight: int = DEFAULT_MAX_INFLIGHT
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    inflight: int = 0
    tools: ToolRegistry = dataclasses.field(default_factory=ToolRegistry)  # what the tool gate calls
    # SparseModel spec.expertGroups: {name: expert indices} (sparsegate_contracts.request_access)
    expert_groups: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    # Per-request access (request_guard): who may call, and what they may activate. ``reviewer``
    # None: callers are not verified (as before). With one, ``access`` None refuses (503) until
    # the operator's first PUT /admin/access.
    reviewer: CachedReviewer | None = None
    access: AccessTable | None = None
    # PUT /admin/access applied so far (GET reports it): a PUT carrying ``ifSequence`` applies only
    # at that sequence, so a late push can never replace a newer one.
    access_sequence: int = 0
    # SIGTERM (server.py, graceful stop): ``draining`` makes /readyz 503 at once while requests
    # are still served (endpoints may route here a few seconds more); ``refusing`` follows after
    # --shutdown-delay: new inference requests get 503, admitted ones finish.
    draining: bool = False
    refusing: bool = False

    @property
    def loaded(self) -> bool:
        return self.gate is not None and self.metrics is not None and (
            self.model is not None or self.hf is not None)

    def shape(self) -> dict[str, Any]:
        """What /healthz and /v1/model report: the built-in shape, or the checkpoint's facts
        (only its source until it has loaded)."""
        if self.model_path is None:
            return self.model_config.shape()
        return self.hf.shape() if self.hf is not None else {"source": self.model_path}

    def limits(self) -> tuple[int, int]:
        """(vocabulary size, longest sequence) of the model being served."""
        if self.hf is not None:
            return self.hf.vocab_size, self.hf.context_length
        return self.model_config.vocab_size, self.model_config.max_seq_len


STATE = web.AppKey("state", ServerState)


def request_key(request: web.Request, sticky_header: str) -> str:
    """What the canary choice hashes: the sticky header's value (one session, one version), else
    the request id, else a fresh random id (random assignment at the weight, in expectation)."""
    return (request.headers.get(sticky_header) or request.headers.get(REQUEST_ID_HEADER)
            or uuid.uuid4().hex)


def choose_gate(state: ServerState, request: web.Request) -> AppliedGate | None:
    """The version this request runs under, read once: the canary for the keys
    ``routes_to_canary`` sends there at its weight, the stable gate otherwise."""
    gate, canary = state.gate, state.canary
    if canary is not None and routes_to_canary(request_key(request, canary.sticky_header), canary.weight):
        return canary.gate
    return gate


# The OpenAI-compatible routes (`openai_api`): every answer they give, errors included, is in
# OpenAI's shape, also when the access guard refuses a request before its handler runs.
OPENAI_COMPLETIONS = "/v1/completions"
OPENAI_CHAT_COMPLETIONS = "/v1/chat/completions"
OPENAI_ROUTES = frozenset({OPENAI_COMPLETIONS, OPENAI_CHAT_COMPLETIONS})
CLIENT_CLOSED = 499  # the code a request whose client went away is counted under (nginx's)


def openai_error(status: int, message: str, *, param: str | None = None, **extra: Any) -> web.Response:
    """An error in OpenAI's shape, ``{"error": {"message", "type", "param", "code", ...extra}}``."""
    kind = ("invalid_request_error" if status < 429 else "rate_limit_error" if status == 429
            else "server_error")
    code = "model_not_found" if status == 404 else None
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code, **extra}},
                             status=status)


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_json(request: web.Request) -> Any:
    if request.content_type != "application/json":
        raise ApiError(415, f"Content-Type must be application/json, got {request.content_type!r}")
    # A client that sends its headers and then stalls its body would otherwise hold the handler
    # (and, before the read moved ahead of admission, a --max-inflight slot) for as long as it
    # keeps the connection open: the read gets --request-timeout, then 408.
    timeout = request.app[STATE].request_timeout_s
    try:
        body = await asyncio.wait_for(request.read(), timeout=timeout)
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body exceeds {MAX_BODY_BYTES} bytes") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"request body not received within {timeout:g} s") from None
    try:
        return json.loads(body)
    except RecursionError:
        raise ApiError(400, "body is not valid JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and integers over 4,300 digits
        raise ApiError(400, f"body is not valid JSON: {e}") from None


@contextlib.asynccontextmanager
async def admission(state: ServerState) -> AsyncIterator[Callable[[], bool]]:
    """Hold one of ``max_inflight`` slots (429 when none is free). Yields ``keep``: call it
    when the slot must outlive the block (work still running frees it itself); it returns
    whether the block still held the slot, so exactly one party frees it."""
    if state.refusing:
        raise ApiError(503, "server is shutting down")
    if state.inflight >= state.max_inflight:
        raise ApiError(429, f"{state.inflight} requests in flight (limit {state.max_inflight}): retry later")
    state.inflight += 1
    held = [True]

    def keep() -> bool:
        was, held[0] = held[0], False
        return was
    try:
        yield keep
    finally:
        if held[0]:
            state.inflight -= 1


async def run_on_model(state: ServerState, fn: Callable[[], T], *,
                       keep: Callable[[], bool]) -> T:
    """Run ``fn`` on the one model thread; 503 after ``request_timeout_s``. Counts it in the
    vLLM running/waiting gauges (waiting while queued behind other batches)."""
    metrics = state.metrics
    assert metrics is not None
    metrics.waiting.inc()

    def job() -> T:
        metrics.waiting.dec()
        metrics.running.inc()
        try:
            return fn()
        finally:
            metrics.running.dec()
    future = asyncio.get_running_loop().run_in_executor(state.executor, job)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout=state.request_timeout_s)
    except asyncio.TimeoutError:
        release_when_done(state, future, keep=keep)
        raise ApiError(503, f"no result within {state.request_timeout_s:g} s") from None
    except asyncio.CancelledError:
        # The client went away: its batch still runs (or waits) on the model thread, so its slot
        # stays taken until then, or a client that keeps abandoning requests would queue work
        # there past --max-inflight.
        release_when_done(state, future, keep=keep)
        raise


async def inject_fault(state: ServerState, gate: AppliedGate) -> None:
    """The gate's faultInjection chaos knob (see server.py's docstring); raises ApiError 503."""
    fault = gate.doc.params.fault_injection
    if fault.added_latency_ms > 0:
        await asyncio.sleep(fault.added_latency_ms / 1000)
    if fault.error_rate > 0 and state.rng.random() < fault.error_rate:
        raise ApiError(503, f"fault injected by gate version {gate.doc.version} "
                            f"(faultInjection.errorRate={fault.error_rate})")


def release_when_done(state: ServerState, future: asyncio.Future[Any], *,
                      keep: Callable[[], bool]) -> None:
    """The request is leaving while its work still runs: the executor cannot be interrupted,
    so its admission slot stays taken until the work is done (unless already handed off)."""
    if keep():
        future.add_done_callback(lambda f: _release(state, f))


def take_slots(state: ServerState, n: int) -> None:
    """``n`` more admission slots for a request that holds one already (from `admission`) and
    decodes ``n + 1`` sequences (several prompts or choices): each sequence occupies the queue
    or a batch as a request of one does. 429 as `admission` unless all of them fit now; the
    caller frees each with `free_slot`."""
    if n <= 0:
        return
    if state.inflight + n > state.max_inflight:
        raise ApiError(429, f"{state.inflight} requests in flight (limit {state.max_inflight}), and "
                            f"this one needs {n} more slots for its {n + 1} sequences: retry later")
    state.inflight += n


def free_slot(state: ServerState) -> None:
    """Give back one admission slot whose holder handed it off with ``keep()``."""
    state.inflight -= 1


def _release(state: ServerState, done: asyncio.Future[Any]) -> None:
    state.inflight -= 1
    if not done.cancelled():
        done.exception()  # nobody awaits it any more: retrieved here, not logged as lost
