"""Model server (aiohttp): inference, probes, metrics and hot-reloadable gate params.

Two model kinds: the built-in TinyMoELM (default; shape from flags) or a local Hugging Face MoE
checkpoint (``--model-path DIR``, loaded through `hf_serving`/`hf`). Both serve ``/v1/infer``
(token ids); a checkpoint with a tokenizer also serves the OpenAI text API (`openai_api`).
Either loads in the background while probes answer; a load that fails (for a checkpoint, the
message names the file) makes ``/healthz`` 500 and ``/readyz`` 503 with the reason, and the
entry point then exits 1 so the pod restarts with the reason in its log.

Generation (the OpenAI API on a checkpoint) runs through a continuous-batching engine
(`batch_engine` + `batch_decode`): concurrent requests decode together, one model step per
token, each with its own KV cache, joining and leaving between steps; ``--max-num-seqs`` bounds
a batch, ``--max-inflight`` the queue (429 beyond), ``--request-timeout`` each request (503, and
it leaves its batch). ``--device`` places a checkpoint on the CPU or a CUDA GPU.

Hot reload: the gate in effect is an immutable `AppliedGate` held by one attribute. A request
reads that attribute exactly once and carries the object through fault injection, the model
batch (run in a one-thread executor) and its response, so a PUT that swaps the reference in the
event loop can never be seen half-applied: each request runs wholly under one version. A
checkpoint holds its gate inside the model (``set_gate`` may re-store weights), so its swap runs
on the model thread between batches and each batch reports the gate read there. A generation
keeps its version's routing params to its end, but not its weight storage: a swap whose
precisionPolicy resolves to other precisions re-stores the weights under the generations already
decoding, from their next step (`batch_decode`, "Gate versions").

Request-level canary (``sparsegate_contracts.canary``): a PUT may carry a stable and a canary
document with a weight; the built-in model then holds both, and each ``/v1/infer`` request picks
one by the hash of its sticky header's value (else its ``x-request-id``, else a random id). The
response's ``gateVersion`` names the version that served it, and ``sparsegate_requests_total`` /
``sparsegate_request_duration_seconds`` are labelled ``gate_version``, so stable and canary are
measured side by side from the same pods. A checkpoint pins the canary per request too (on
``/v1/infer`` and the OpenAI routes; a generation decodes wholly under the version it was
prefilled with), provided the canary keeps the stored weight precisions: it holds one weight
storage, so a canary whose precisionPolicy resolves otherwise is answered 422. The probe set
(`quality`) is scored under each version held before the PUT answers, its gauges labelled by
version; a version no longer held loses them.

A gate with ``targetExpertsPerToken`` gets its own PI controller (`threshold_control`) when it is
applied (stable or canary; a promoted canary keeps its own): each batch routes with the
controller's threshold and feeds back its mean selected experts per token — a /v1/infer batch
of either model kind, and on a checkpoint every prefill and decode step of the OpenAI routes
(`batch_decode`) too, except batches holding a request scoped to an expert group; the live threshold is the gauge
``sparsegate_gate_controlled_threshold{gate_version}``.

Tools (`tools`): on ``/v1/infer``, a sequence whose tool gate fires above ``toolGateThreshold``
at its last position may call the built-in calculator or an HTTP tool of ``--tools-json``, on
the event loop after its batch; a result is forced as its next tokens (``toolResults``,
``nextTokens``), a failure leaves plain decoding. The built-in model has a tool-gate head; a
checkpoint has one only when ``sparsegate_tool_gate.safetensors`` sits beside its weights
(`hf.tool_head`). On the OpenAI generation routes, such a checkpoint's tool gate calls them too:
the sequence waits outside its decode group for the result, which is forced into its text
(`generation_tools`, `batch_decode`).

`faultInjection` in the gate params is a CHAOS-TESTING KNOB, not a model setting: with
errorRate p each inference request fails with 503 with probability p (seeded RNG) and
addedLatencyMs sleeps (asyncio) before answering. It exists so tests and demos can roll out a
deliberately bad version and watch the rollout controller's analysis catch it.

Two listeners: inference, probes and metrics on ``--port`` (plain HTTP); ``GET``/``PUT /admin/gate``
and ``/admin/access`` (the per-request access rules, `request_guard`) only on ``--admin-port``,
TLS with the Secret volume's certificate and Bearer token (see ``admin.py``: why, and how a
changed Secret rotates both without a restart). Both share one :class:`ServerState`, so a PUT on
the admin listener swaps the gate (or the access rules) the inference requests read, and one
connection cap and keep-alive timeout (`connections`: ``--max-connections``, ``--keepalive-timeout``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import math
import os
import random
import signal
import ssl
import sys
import time
import uuid
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, Awaitable, Callable

import torch
from aiohttp import web
from aiohttp.web_runner import GracefulExit
from sparsegate_contracts import request_access
from sparsegate_contracts.canary import DEFAULT_STICKY_HEADER, GateSet, parse_gate_set
from sparsegate_contracts.gate import (DEFAULT_DOCUMENT, GateDocument, GateParamsError,
                                       parse_document)
from sparsegate_contracts.names import DEFAULT_ADMIN_PORT
from sparsegate_contracts.version import version_line

from . import cgroup_limits, connections, hf_serving, openai_api, quality, request_guard, tools
from .admin import AdminAuth, AdminDenied, AdminFiles, check_bearer
from .batch_decode import BatchDecoder
from .batch_engine import DEFAULT_MAX_NUM_SEQS, BatchEngine
from .generation_tools import GenerationTools
from .hf.placement import PlacementError, parse_placement_json
from .caller_auth import CachedReviewer, KubeTokenReview
from .devices import DEVICE_CHOICES, DeviceError, check_model_dtype, resolve_device
from .inference import InferenceResult, run_batch
from .metrics import ServerMetrics
from .model import ModelConfig, TinyMoELM, build_model, default_heads, effective_gate
from .model_thread import ModelThread
from .server_state import (BUILTIN_MODEL_NAME, CLIENT_CLOSED, DEFAULT_MAX_INFLIGHT, DEFAULT_REQUEST_TIMEOUT_S,
                           MAX_BODY_BYTES, STATE, ApiError, AppliedGate, CanaryGate, ServerState,
                           admission, choose_gate, inject_fault, read_json, run_on_model,
                           threshold_controller)
from .threshold_control import ThresholdController

log = logging.getLogger("sparsegate.workload")

# --shutdown-delay: none by default (a process run by hand stops at once when idle); the
# operator sets a pod's (render.SHUTDOWN_DELAY_S), the time its endpoints take to drop it.
DEFAULT_SHUTDOWN_DELAY_S = 0.0

MAX_BATCH = 64
MAX_TOTAL_TOKENS = 4096
# returnLogits answers [batch, vocab] floats (~20 bytes each in JSON): at most this many, so a
# checkpoint's 150k vocabulary cannot turn a 1 KB request into a 200 MB answer built in memory.
MAX_RETURNED_LOGITS = 1 << 18


def _applied(doc: GateDocument, model: TinyMoELM) -> AppliedGate:
    return AppliedGate(doc=doc, precisions=model.resolve_precisions(doc.params.precision_policy),
                       applied_at=time.time(), params=effective_gate(doc.params, model.cfg),
                       controller=threshold_controller(doc.params))


def _builtin_batch(state: ServerState, gate: AppliedGate, tokens: list[list[int]],
                   return_logits: bool, allowed_experts: tuple[int, ...] | None = None) -> InferenceResult:
    """On the model thread (so batches update a controller one at a time): route with the
    controlled threshold when the gate has one, then feed it this batch's mean selected experts
    per token (before the capacity cap) to set the threshold of the next batch."""
    assert state.model is not None and state.metrics is not None
    result = run_batch(state.model, tokens, gate=gate.routed_params(),
                       precisions=gate.precisions, return_logits=return_logits,
                       allowed_experts=allowed_experts)
    if gate.controller is not None and allowed_experts is None:
        # A scoped batch's experts are bounded by its group, not by the threshold: a group
        # smaller than the target would push the threshold to its bound for every request.
        threshold = gate.controller.update(result.selected_experts_per_token)
        state.metrics.controlled_threshold.labels(gate_version=gate.doc.version).set(threshold)
    return result


def _publish_controller(state: ServerState, gate: AppliedGate) -> None:
    if gate.controller is not None and state.metrics is not None:
        state.metrics.controlled_threshold.labels(gate_version=gate.doc.version).set(
            gate.controller.threshold)


# /readyz answers 503 while one model call has run longer than this many --request-timeout.
WEDGED_AFTER_TIMEOUTS = 2

LOADER = web.AppKey("loader", asyncio.Task)
EXIT_ON_LOAD_ERROR = web.AppKey("exit_on_load_error", bool)
AUTH = web.AppKey("admin_auth", AdminAuth)
ADMIN_RUNNER = web.AppKey("admin_runner", web.AppRunner)
LIMITER = web.AppKey("connection_limiter", connections.ConnectionLimiter)
KEEPALIVE_S = web.AppKey("keepalive_timeout_s", float)


@dataclasses.dataclass(frozen=True)
class AdminListener:
    """Where the admin app listens, and the files its TLS and token come from."""

    host: str
    port: int
    files: AdminFiles


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status)


@web.middleware
async def json_errors(request: web.Request,
                      handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
    """Every failure answers JSON with a clear message (aiohttp's defaults are plain text)."""
    try:
        return await handler(request)
    except ApiError as e:
        return _error(e.status, e.message)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error(e.status, e.reason if e.text is None or e.text.startswith(str(e.status))
                      else e.text)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return _error(500, "internal server error")


def parse_infer_request(body: Any, *, vocab_size: int, max_seq_len: int
                        ) -> tuple[list[list[int]], bool]:
    """Validate {"tokens": [[int,...],...], "returnLogits"?: bool}; raises ApiError."""
    if not isinstance(body, dict):
        raise ApiError(422, "body must be a JSON object with a 'tokens' field")
    unknown = sorted(set(body) - {"tokens", "returnLogits"})
    if unknown:
        raise ApiError(422, f"unknown fields: {', '.join(unknown)}")
    tokens = body.get("tokens")
    return_logits = body.get("returnLogits", False)
    if not isinstance(return_logits, bool):
        raise ApiError(422, "returnLogits must be a boolean")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(s, list) for s in tokens):
        raise ApiError(422, "tokens must be a non-empty list of token-id lists, shape [batch, seq]")
    if len(tokens) > MAX_BATCH:
        raise ApiError(413, f"batch of {len(tokens)} sequences exceeds the limit of {MAX_BATCH}")
    seq_len = len(tokens[0])
    if seq_len == 0 or any(len(s) != seq_len for s in tokens):
        raise ApiError(422, "tokens: all sequences must be non-empty and of equal length")
    if seq_len > max_seq_len:
        raise ApiError(413, f"tokens: sequence length {seq_len} exceeds the limit of {max_seq_len}")
    if seq_len * len(tokens) > MAX_TOTAL_TOKENS:
        raise ApiError(413, f"tokens: {seq_len * len(tokens)} tokens exceed the limit of "
                            f"{MAX_TOTAL_TOKENS} per request")
    rows = max(1, MAX_RETURNED_LOGITS // vocab_size)  # one row is always allowed
    if return_logits and len(tokens) > rows:
        raise ApiError(413, f"returnLogits: {len(tokens)} sequences x {vocab_size} vocabulary logits exceed "
                            f"the limit of {MAX_RETURNED_LOGITS} per response (at most {rows} sequences)")
    for i, row in enumerate(tokens):
        for j, t in enumerate(row):
            # The position names the bad id in a batch of thousands; the value is cut short
            # (a 4,000-digit integer or a long string would be echoed whole).
            shown = repr(t) if len(repr(t)) <= 40 else repr(t)[:40] + "..."
            if isinstance(t, bool) or not isinstance(t, int):
                raise ApiError(422, f"tokens[{i}][{j}]: token ids must be integers, got {shown}")
            if not 0 <= t < vocab_size:
                raise ApiError(422, f"tokens[{i}][{j}]: token id {shown} is outside the vocabulary [0, {vocab_size})")
    return tokens, return_logits


def _result_json(result: InferenceResult, gate: AppliedGate,
                 calls: list[tools.ToolCall | None]) -> dict[str, Any]:
    # Re-rank: a tool's result is forced ahead of the model's choice (tools.py).
    next_tokens = [c.tokens[0] if c is not None and c.tokens else t
                   for t, c in zip(result.next_tokens, calls, strict=True)]
    out = {
        "gateVersion": gate.doc.version,
        "checksum": gate.doc.checksum,
        "nextTokens": next_tokens,
        "expertCounts": result.expert_counts,
        "activeExpertsPerToken": result.active_experts_per_token,
        "selectedExpertsPerToken": result.selected_experts_per_token,
        "droppedAssignments": result.dropped_assignments,
        "gateEntropy": result.gate_entropy,
        "toolCalls": result.tool_calls,
        "toolGateFireRate": result.tool_gate_fire_rate,
        "toolResults": [c.to_json() if c is not None else None for c in calls],
        "precisions": list(gate.precisions),
        "numTokens": result.num_tokens,
    }
    if result.last_logits is not None:
        out["logits"] = result.last_logits
    return out


async def infer(request: web.Request) -> web.Response:
    state = request.app[STATE]
    started = time.perf_counter()
    code = 500
    gate: AppliedGate | None = None
    try:
        # Read once: this request runs wholly under this version (the canary for the keys its
        # weight selects, see server_state.choose_gate).
        gate = choose_gate(state, request)
        if gate is None or not state.loaded:
            raise ApiError(503, "model is still loading")
        # Read before admission: a slot counts work for the model (running + queued), not a
        # client still sending its body (a stalled upload held one until it hung up).
        body = await read_json(request)
        async with admission(state) as keep:
            vocab_size, max_seq_len = state.limits()
            tokens, return_logits = parse_infer_request(body, vocab_size=vocab_size,
                                                        max_seq_len=max_seq_len)
            await inject_fault(state, gate)
            # The request's expert group (request_guard): the gate masks every other expert.
            allowed = request_guard.allowed_experts(request)
            if state.hf is not None:
                chosen = gate
                result, gate = await run_on_model(
                    state, lambda: _hf_batch(state, tokens, return_logits, chosen, allowed), keep=keep)
            else:
                result = await run_on_model(
                    state, lambda: _builtin_batch(state, gate, tokens, return_logits, allowed), keep=keep)
        calls = await _call_tools(state, request, gate, tokens, result)
        state.metrics.observe_batch(result, gate_version=gate.doc.version)
        state.metrics.quality.observe(gate.doc.version, result.prompt_score)
        code = 200
        return web.json_response({**_result_json(result, gate, calls), **request_guard.scope_json(request)})
    except ApiError as e:
        code = e.status
        raise
    except asyncio.CancelledError:  # the client went away
        code = CLIENT_CLOSED
        raise
    finally:
        if state.metrics is not None:
            state.metrics.observe_request(code=code, gate_version=gate.doc.version if gate else None,
                                          seconds=time.perf_counter() - started)


async def _call_tools(state: ServerState, request: web.Request, gate: AppliedGate,
                     tokens: list[list[int]], result: InferenceResult
                     ) -> list[tools.ToolCall | None]:
    """On the event loop, after the batch left the model thread: the calls of the sequences whose
    tool gate fired at their last position. The built-in model has a tool gate; a checkpoint
    has one when a tool-gate head ships beside its weights (its tokenizer then reads the text)."""
    if not result.last_tool_prob:
        return [None] * len(tokens)
    request_id = request.headers.get("X-Request-Id", "")[:64] or uuid.uuid4().hex
    assert state.metrics is not None
    vocab_size = state.limits()[0]
    codec = (tools.tokenizer_codec(state.hf.tokenizer, vocab_size=vocab_size)
             if state.hf is not None and state.hf.tokenizer is not None else None)
    return await tools.call_fired(state.tools, tokens, last_prob=result.last_tool_prob,
                                  threshold=gate.params.tool_gate_threshold,
                                  request_id=request_id, vocab_size=vocab_size,
                                  metrics=state.metrics.tools, codec=codec)


def _hf_batch(state: ServerState, tokens: list[list[int]], return_logits: bool, chosen: AppliedGate,
              allowed_experts: tuple[int, ...] | None = None) -> tuple[InferenceResult, AppliedGate]:
    # On the model thread, where gate swaps of a checkpoint also run: the installed gate read
    # here is the one the checkpoint routes this batch with (the admission-time read may be
    # older). A canary chosen for the request is pinned for this batch instead.
    # run_batch feeds a controlled gate's threshold controller; its gauge follows here.
    if chosen.hf_gate is not None:
        assert state.hf is not None
        result, _ = state.hf.run_batch(tokens, return_logits=return_logits, gate=chosen.hf_gate,
                                       allowed_experts=allowed_experts)
        _publish_controller(state, chosen)
        return result, chosen
    gate = state.installed or state.gate
    assert state.hf is not None and gate is not None
    result, _ = state.hf.run_batch(tokens, return_logits=return_logits, allowed_experts=allowed_experts)
    _publish_controller(state, gate)
    return result, gate


async def healthz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.load_error is not None:
        # Liveness fails with the reason, so the kubelet restarts the server and the error is seen.
        return web.json_response({"status": "error", "error": state.load_error}, status=500)
    doc = state.gate.doc if state.gate else state.pending_doc
    out = {"status": "ok", "gateVersion": doc.version, "checksum": doc.checksum,
           "uptimeSeconds": round(time.monotonic() - state.started, 3), "model": state.shape()}
    if state.canary is not None:
        out["canary"] = _canary_json(state.canary)
    return web.json_response(out)


async def model_info(request: web.Request) -> web.Response:
    """The model's shape (known before it is built) and whether it is loaded; a loaded
    checkpoint adds its weight storage (`HFServedModel.precision`)."""
    state = request.app[STATE]
    out: dict[str, Any] = {"model": state.shape(), "loaded": state.loaded}
    if state.hf is not None:
        out["precision"] = state.hf.precision()
    return web.json_response(out)


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.load_error is not None:
        return web.json_response({"ready": False, "reason": state.load_error}, status=503)
    if state.draining:
        return web.json_response({"ready": False, "reason": "server is shutting down"}, status=503)
    if not state.loaded:
        return web.json_response({"ready": False, "reason": "model is still loading"},
                                 status=503)
    if state.reviewer is not None and state.access is None:
        # --request-auth: every POST answers 503 until the operator's first PUT /admin/access, so
        # the pod stays out of the endpoints until then (the operator pushes to any pod with an IP,
        # Ready or not: no deadlock).
        return web.json_response({"ready": False, "reason": (
            "no access rules received yet (--request-auth): requests are refused until the operator "
            "sends them (PUT /admin/access)")}, status=503)
    # A model call runs at most about --request-timeout (a generation job ends at a step
    # boundary when a request times out): one running much longer is stuck (a hung kernel), and
    # every request behind it would wait to its timeout, so the pod leaves the endpoints.
    busy = state.executor.busy_for if state.executor is not None else 0.0
    if busy > WEDGED_AFTER_TIMEOUTS * state.request_timeout_s:
        return web.json_response({"ready": False, "reason": (
            f"model thread stuck: one call has run {busy:.0f} s (more than "
            f"{WEDGED_AFTER_TIMEOUTS} x --request-timeout {state.request_timeout_s:g} s)")},
            status=503)
    return web.json_response({"ready": True, "gateVersion": state.gate.doc.version})


# The series set_expert_costs / set_placement_factors fill at scrape time.
COST_SERIES = ("sparsegate_expert_cost", "sparsegate_expert_placement_factor")


async def metrics(request: web.Request) -> web.Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    state = request.app[STATE]
    if state.metrics is None:
        raise ApiError(503, "model is still loading")
    # ?name[]=…: only these samples (as prometheus_client's own exposition server does); the
    # operator's analysis asks for the dozen it reads, not every per-expert series.
    names = request.query.getall("name[]", [])
    # Costs move with every dispatch: read them when scraped (and asked for).
    if not names or any(n.startswith(COST_SERIES) for n in names):
        if state.hf is not None:
            state.metrics.set_expert_costs([b.cost.vector().tolist() for b in state.hf.lm.blocks])
            state.metrics.set_placement_factors([b.cost.placement for b in state.hf.lm.blocks])
        elif state.model is not None:
            state.metrics.set_expert_costs([b.moe.cost.vector().tolist() for b in state.model.blocks])
    registry = state.metrics.registry.restricted_registry(names) if names else state.metrics.registry
    return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})


def _gate_json(gate: AppliedGate) -> dict[str, Any]:
    return {**gate.doc.to_json(), "precisions": list(gate.precisions),
            "appliedAt": gate.applied_at,
            "effectiveExpertsPerToken": {"min": gate.params.min_experts_per_token,
                                         "max": gate.params.max_experts_per_token}}


def _canary_json(canary: CanaryGate) -> dict[str, Any]:
    return {"version": canary.gate.doc.version, "checksum": canary.gate.doc.checksum,
            "weight": canary.weight, "stickyHeader": canary.sticky_header}


def _served_json(state: ServerState) -> dict[str, Any]:
    """``GET``/``PUT /admin/gate``'s answer: the stable gate, and the canary when one is held."""
    assert state.gate is not None
    out = _gate_json(state.gate)
    if state.canary is not None:
        out["canary"] = {**_canary_json(state.canary), "params": dict(state.canary.gate.doc.raw_params)}
    return out


def _check_admin(request: web.Request) -> None:
    try:
        check_bearer(request.headers.get("Authorization", ""), request.app[AUTH].token())
    except AdminDenied as e:
        raise ApiError(e.status, e.message) from None


async def get_gate(request: web.Request) -> web.Response:
    _check_admin(request)
    state = request.app[STATE]
    if state.gate is None:
        raise ApiError(503, "model is still loading")
    return web.json_response(_served_json(state))


async def put_gate(request: web.Request) -> web.Response:
    """Apply a gate document, or a stable + canary set (contracts ``canary``). Versions already
    held are kept as they are (a canary's threshold controller keeps its state when only the
    weight moves); the new pair is assigned together, between requests. PUTs apply one at a
    time, in the order their bodies arrived."""
    _check_admin(request)
    state = request.app[STATE]
    if state.gate is None or not state.loaded or state.metrics is None:
        raise ApiError(503, "model is still loading")
    body = await read_json(request)
    # Serialised (state.gate_lock): the operator may push the next set while a PUT it gave up on
    # still runs here; the later one must be applied last and compared with what the earlier left.
    async with state.gate_lock:
        return await _apply_gate_set(state, body)


async def _apply_gate_set(state: ServerState, body: Any) -> web.Response:
    """``PUT /admin/gate``'s work once it holds ``state.gate_lock``: apply ``body`` and answer."""
    assert state.gate is not None and state.metrics is not None
    num_experts = state.hf.num_experts if state.hf is not None else state.model_config.num_experts
    try:
        wanted = parse_gate_set(body, num_experts=num_experts)
        if wanted.key == _held_key(state) and (
                state.canary is None or state.canary.sticky_header == wanted.sticky_header):
            state.metrics.gate_applies.labels(result="unchanged").inc()
            return web.json_response({**_served_json(state), "applied": False})
        previous = state.gate.doc.version
        doc = wanted.stable
        stable_changes = doc.version != previous
        # The canary first: a checkpoint's is checked against the stable it will sit beside
        # before anything changes, so a refused set leaves the server as it was.
        canary = await _canary_for(state, wanted, stable_changes=stable_changes)
        if not stable_changes:
            new = state.gate
        elif state.hf is not None:
            # A checkpoint swaps on the model thread, between batches: set_gate may re-store
            # weights, which must not overlap a forward (it records state.installed there). A
            # promoted canary keeps its threshold controller.
            controller = (state.canary.gate.controller if state.canary is not None
                          and state.canary.gate.doc.version == doc.version
                          else threshold_controller(doc.params))
            new = await asyncio.get_running_loop().run_in_executor(
                state.executor, lambda: _swap_checkpoint_gate(state, doc, controller))
        elif state.canary is not None and state.canary.gate.doc.version == doc.version:
            new = state.canary.gate  # promotion: the canary becomes stable, controller and all
        else:
            new = _applied(doc, state.model)
        # The swap: reference assignments on the event loop thread, no await between them.
        state.gate, state.canary = new, canary
    except GateParamsError as e:
        state.metrics.gate_applies.labels(result="rejected").inc()
        raise ApiError(422, f"{e} (this model has {num_experts} experts)") from None
    state.metrics.set_gate(version=doc.version, checksum=doc.checksum)
    if canary is not None:
        state.metrics.serving(canary.gate.doc.version)
    # Versions no longer held keep their series for a few rollouts, then lose them (bounded).
    state.metrics.hold(g.doc.version for g in _held_gates(state))
    state.metrics.gate_applies.labels(result="applied").inc()
    _publish_controller(state, new)
    if canary is not None:
        _publish_controller(state, canary.gate)
    # Before answering (the operator reads the probe gauges once the PUT returns): a new stable
    # or canary is scored, versions no longer held lose their gauges.
    await _score_probes(state)
    log.info("gate %s -> %s", previous, wanted.key)
    return web.json_response({**_served_json(state), "applied": True, "previousVersion": previous})


async def get_access(request: web.Request) -> web.Response:
    _check_admin(request)
    return await request_guard.get_access(request)


async def put_access(request: web.Request) -> web.Response:
    """The model's per-request access rules (`request_guard`), from the operator."""
    _check_admin(request)
    return await request_guard.put_access(request)


def _held_key(state: ServerState) -> str:
    assert state.gate is not None
    held = GateSet(stable=state.gate.doc, canary=state.canary.gate.doc if state.canary else None,
                   weight=state.canary.weight if state.canary else 0.0,
                   sticky_header=state.canary.sticky_header if state.canary else DEFAULT_STICKY_HEADER)
    return held.key


async def _canary_for(state: ServerState, wanted: GateSet, *, stable_changes: bool) -> CanaryGate | None:
    """The canary half of ``wanted``, reusing the applied canary when its version is unchanged.
    A checkpoint's canary is prepared on the model thread and pinned per request beside the
    stable gate (same weight storage as ``wanted.stable``: `hf.loader.SparseGatedCausalLM.prepare_gate`)."""
    if wanted.canary is None:
        return None
    held, doc = state.canary, wanted.canary
    if held is not None and held.gate.doc.version == doc.version and not (state.hf is not None and stable_changes):
        gate = held.gate
    elif state.hf is not None:
        hf, beside = state.hf, wanted.stable if stable_changes else None
        # Re-prepared beside a new stable, a held canary keeps its controller's state, and so does
        # a stable that becomes the canary.
        if held is not None and held.gate.doc.version == doc.version:
            controller = held.gate.controller
        elif state.gate is not None and state.gate.doc.version == doc.version:
            controller = state.gate.controller
        else:
            controller = threshold_controller(doc.params)
        active = await asyncio.get_running_loop().run_in_executor(
            state.executor, lambda: hf.prepare_gate(doc, beside=beside, controller=controller))
        gate = AppliedGate(doc=doc, precisions=active.precisions, applied_at=time.time(), params=doc.params,
                           controller=active.controller, hf_gate=active)
    elif state.gate is not None and state.gate.doc.version == doc.version:
        gate = state.gate
    else:
        assert state.model is not None
        gate = _applied(doc, state.model)
    return CanaryGate(gate=gate, weight=wanted.weight, sticky_header=wanted.sticky_header)


def _swap_checkpoint_gate(state: ServerState, doc: GateDocument,
                          controller: ThresholdController | None) -> AppliedGate:
    """On the model thread: install ``doc`` in the checkpoint (routed by ``controller`` when it
    has targetExpertsPerToken), then publish it (a checkpoint has no per-token bounds of its own
    beyond its expert count, so params are the document's)."""
    assert state.hf is not None
    active = state.hf.set_gate(doc, controller=controller)
    state.installed = AppliedGate(doc=doc, precisions=active.precisions, applied_at=time.time(),
                                  params=doc.params, controller=active.controller)
    return state.installed  # state.gate is assigned on the event loop, together with the canary


async def _load_model(app: web.Application) -> None:
    state = app[STATE]
    try:
        await _load_and_install(state)
    except Exception as e:  # the model cannot be served: say so on /healthz and /readyz, and log it
        # Any step, not only reading the weights: a failure after them (e.g. while wiring the
        # decoder or reading the probe set) must not leave the pod alive, unready and silent.
        # CheckpointError messages name the offending file.
        state.load_error = f"model failed to load: {type(e).__name__}: {e}"
        log.exception("model failed to load")
        if app[EXIT_ON_LOAD_ERROR]:
            # The process entry point: exit (main() turns it into exit code 1) so the pod
            # restarts and shows the reason, rather than lingering unready.
            signal.raise_signal(signal.SIGTERM)


async def _load_and_install(state: ServerState) -> None:
    """Build or load the model on the model thread, then make it the one the server serves."""
    state.executor = ModelThread()
    loop = asyncio.get_running_loop()
    if state.model_path is not None:
        hf = await loop.run_in_executor(state.executor, lambda: _load_checkpoint(state))
        # --expert-groups-json was parsed before the checkpoint's expert count was known.
        request_access.parse_expert_groups(
            [{"name": n, "experts": list(e)} for n, e in state.expert_groups.items()],
            num_experts=hf.num_experts)
        metrics_ = ServerMetrics(n_layers=hf.n_layers, num_experts=hf.num_experts,
                                 model_name=hf.name)
    else:
        model = await loop.run_in_executor(
            state.executor, lambda: build_model(state.model_config,
                                                gate=DEFAULT_DOCUMENT.params))
        doc = parse_document(state.pending_doc.to_json(), num_experts=model.cfg.num_experts)
        metrics_ = ServerMetrics(n_layers=model.cfg.n_layers,
                                 num_experts=model.cfg.num_experts,
                                 model_name=BUILTIN_MODEL_NAME)
    if state.model_path is not None:
        assert state.gate is not None
        metrics_.set_gate(version=state.gate.doc.version, checksum=state.gate.doc.checksum)
        _publish_controller(state, state.gate)
        decoder = BatchDecoder(hf)
        decoder.on_prompts_scored = metrics_.quality.observe
        decoder.on_threshold = lambda version, threshold: metrics_.controlled_threshold.labels(
            gate_version=version or quality.NO_VERSION).set(threshold)
        runner = None
        if hf.lm.tool_head is not None:  # the loader allows a head only with a tokenizer
            gen_tools = GenerationTools(state.tools, hf.tokenizer, vocab_size=hf.vocab_size,
                                        metrics=metrics_.tools)
            decoder.tool_select, runner = gen_tools.select, gen_tools.run
        state.engine = BatchEngine(decoder, executor=state.executor,
                                   max_num_seqs=state.max_num_seqs, metrics=metrics_,
                                   tool_runner=runner)
        try:
            # Off the event loop (a probe file is read and tokenized): /healthz answers meanwhile.
            metrics_.quality.probe = await loop.run_in_executor(
                state.tokenizer_thread, lambda: quality.checkpoint_probe(
                    state.model_path, hf.tokenizer, vocab_size=hf.vocab_size,
                    context_length=hf.context_length))
        except (ValueError, OSError) as e:  # e.g. a probe file shorter than one window, or
            # one this user may not read: serve without it (quality is then not reported)
            log.warning("no probe set: %s", e)
        state.metrics, state.hf = metrics_, hf
        await _score_probes(state)
        return
    metrics_.set_gate(version=doc.version, checksum=doc.checksum)
    metrics_.quality.probe = quality.random_probe(vocab_size=model.cfg.vocab_size,
                                                  seq_len=min(quality.PROBE_SEQ_LEN,
                                                              model.cfg.max_seq_len))
    state.metrics, state.model = metrics_, model
    state.gate = _applied(doc, model)
    _publish_controller(state, state.gate)
    await _score_probes(state)


async def _score_probes(state: ServerState) -> None:
    """Score the probe set under every version held that has no published score yet (the
    stable gate, and a request-level canary's), on the model thread after any swap queued
    there; then publish exactly the versions held (quality.py), so a version promoted away or
    rolled back loses its gauges. A failure is logged, never fatal: quality is then simply not
    reported for that version."""
    m = state.metrics
    if m is None or state.gate is None or m.quality.probe is None:
        return
    probe = m.quality.probe
    known = m.quality.probe_scores
    todo = [g for g in _held_gates(state) if (g.doc.version or quality.NO_VERSION) not in known]
    scored: dict[str, quality.Score] = {}
    for gate in todo:
        version = gate.doc.version
        try:
            score = await asyncio.get_running_loop().run_in_executor(
                state.executor, lambda g=gate: _probe_score(state, g, probe))
        except Exception:  # noqa: BLE001 - quality must never take serving down
            log.exception("gate %s: probe set not scored", version)
            continue
        if score is None:
            continue  # another PUT installed a newer stable meanwhile; it scores its own
        scored[version or quality.NO_VERSION] = score
        log.info("gate %s: probe perplexity %.4f over %d tokens (%s)", version,
                 score.perplexity, score.tokens, probe.source)
    # Re-read: the versions held now (a PUT may have landed while the model thread scored).
    scores = {**m.quality.probe_scores, **scored}
    held = [g.doc.version or quality.NO_VERSION for g in _held_gates(state)]
    m.quality.publish_probes({v: scores[v] for v in held if v in scores})


def _held_gates(state: ServerState) -> list[AppliedGate]:
    """The stable gate, then the request-level canary's when one is held."""
    assert state.gate is not None
    return [state.gate] + ([state.canary.gate] if state.canary is not None else [])


def _probe_score(state: ServerState, gate: AppliedGate, probe: quality.ProbeSet) -> quality.Score | None:
    """On the model thread: the probe scored under ``gate`` as its requests are served (a
    controlled gate at its controller's threshold now, which at install is its start). A
    checkpoint's canary is pinned for the forward (its hf_gate); its stable is the installed
    gate, None when that is no longer ``gate``'s version. The probe does not feed a controller."""
    if state.hf is not None:
        active = gate.hf_gate
        if active is None:
            active = state.hf.lm.gate
            if active.version != gate.doc.version:
                return None
        return quality.score_checkpoint_probe(state.hf.lm, probe, gate=active)
    assert state.model is not None
    return quality.score_builtin_probe(state.model, probe, gate=gate.routed_params(), precisions=gate.precisions)


def _load_checkpoint(state: ServerState) -> hf_serving.HFServedModel:
    assert state.model_path is not None
    try:
        hf = hf_serving.load(state.model_path, gate=state.pending_doc, name=state.served_name,
                             dtype=state.model_dtype, device=resolve_device(state.device),
                             placement=state.expert_placement)
    except GateParamsError as e:  # say which gate, as a CheckpointError says which file
        raise GateParamsError(f"gate {state.pending_doc.version} (--gate-config) does not fit "
                              f"checkpoint {state.model_path}: {e}") from e
    controller = threshold_controller(state.pending_doc.params)
    active = hf.set_gate(state.pending_doc, controller=controller) if controller is not None else hf.lm.gate
    state.gate = state.installed = AppliedGate(doc=state.pending_doc, precisions=active.precisions,
                                               applied_at=time.time(), params=state.pending_doc.params,
                                               controller=active.controller)
    return hf


async def _startup(app: web.Application) -> None:
    # Serve probes immediately; /readyz turns 200 when the model is built.
    app[LOADER] = asyncio.create_task(_load_model(app))


def _install_graceful_sigterm(delay_s: float) -> Callable[[web.Application], Awaitable[None]]:
    """An on_startup hook (the entry point only) replacing aiohttp's SIGTERM handler, which
    closes the listener at once and then fails every generation in flight with 503. A pod's
    SIGTERM comes while its endpoints may still route to it, so instead: /readyz turns 503 at
    once and requests are still served for ``delay_s``; then new inference requests get 503
    (``Connection: close``, so clients reconnect elsewhere) while the admitted ones finish
    (at most --request-timeout more); then the server stops (exit 0). A server that never loaded
    (nothing to drain, or a load error: ``_load_model``) stops at once. SIGINT stays immediate."""
    async def install(app: web.Application) -> None:
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task[None]] = []  # referenced, so the task is not collected

        def on_sigterm() -> None:
            state = app[STATE]
            if not state.draining:
                state.draining = True
                stopping.append(loop.create_task(_stop_gracefully(state, delay_s)))
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    return install


DRAIN_SLACK_S = 2.0  # past --request-timeout, for the last answers to be written


async def _stop_gracefully(state: ServerState, delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    if state.loaded:
        log.info("SIGTERM: unready; serving for %g s more, then draining", delay_s)
        await asyncio.sleep(delay_s)
        state.refusing = True
        log.info("refusing new requests (503); waiting for %d in flight", state.inflight)
        deadline = loop.time() + state.request_timeout_s + DRAIN_SLACK_S
        while state.inflight > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if state.inflight:
            log.warning("stopping with %d requests still in flight", state.inflight)
    loop.call_soon(_graceful_exit)


def _graceful_exit() -> None:
    raise GracefulExit()  # as aiohttp's own signal handler: run_app then cleans up and returns


async def _close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    if request.app[STATE].draining:
        response.force_close()  # its headers are already built: say so too
        response.headers["Connection"] = "close"


async def _drain(app: web.Application) -> None:
    # Shutdown: whatever is still queued or decoding (after a graceful SIGTERM, only what
    # outlived the drain) ends with 503 rather than hang up mid-stream.
    state = app[STATE]
    if state.engine is not None:
        await state.engine.close("server is shutting down")


async def _cleanup(app: web.Application) -> None:
    app[LOADER].cancel()
    state = app[STATE]
    if state.executor is not None:
        state.executor.shutdown(wait=False, cancel_futures=True)
    state.tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def create_app(*, gate_doc: GateDocument = DEFAULT_DOCUMENT, model_config: ModelConfig = ModelConfig(),
               fault_seed: int = 0, max_inflight: int = DEFAULT_MAX_INFLIGHT,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               admin: AdminListener | None = None, model_path: str | None = None,
               served_name: str | None = None, model_dtype: str = "float32",
               device: str = "auto", max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
               exit_on_load_error: bool = False,
               tool_registry: tools.ToolRegistry | None = None,
               expert_groups: Mapping[str, tuple[int, ...]] | None = None,
               reviewer: CachedReviewer | None = None,
               expert_placement: dict | None = None,
               graceful_sigterm_delay_s: float | None = None,
               keepalive_timeout_s: float = connections.DEFAULT_KEEPALIVE_TIMEOUT_S,
               max_connections: int | None = None) -> web.Application:
    """The inference app (no /admin routes). ``admin``: also serve :func:`create_admin_app` on
    its own TLS listener for as long as this app runs (None: no admin channel at all).
    ``model_path``: serve that Hugging Face checkpoint directory instead of the built-in model
    (``model_config`` is then unused) in ``model_dtype`` on ``device`` (auto|cpu|cuda);
    ``served_name`` is its OpenAI model id; its generations decode in batches of up to
    ``max_num_seqs`` sequences (`batch_engine`).
    ``exit_on_load_error``: a failed load also sends this process SIGTERM (the entry point).
    ``tool_registry``: the HTTP tools the tool gate may call (`tools`).
    ``expert_groups``: SparseModel spec.expertGroups, parsed (``sparsegate_contracts.request_access``).
    ``reviewer``: verify callers and apply the access rules the admin channel sets (`request_guard`).
    ``expert_placement``: a checkpoint's experts on their own dtype/device (hf.placement, parsed).
    ``graceful_sigterm_delay_s``: handle this process's SIGTERM as a pod's graceful stop
    (`_install_graceful_sigterm`; the entry point's --shutdown-delay). None: aiohttp's handling.
    ``keepalive_timeout_s`` / ``max_connections`` (None: from RLIMIT_NOFILE): the admin listener's
    and, through :func:`serve`, the inference listener's connection limits (`connections`)."""
    app = web.Application(middlewares=[json_errors, request_guard.access_guard], client_max_size=MAX_BODY_BYTES)
    app[STATE] = ServerState(model_config=model_config,
                             rng=random.Random(fault_seed), pending_doc=gate_doc,
                             max_inflight=max_inflight, request_timeout_s=request_timeout_s,
                             model_path=model_path, served_name=served_name,
                             model_dtype=model_dtype, device=device,
                             max_num_seqs=max_num_seqs,
                             tools=tool_registry or tools.ToolRegistry(),
                             expert_groups=dict(expert_groups or {}), reviewer=reviewer,
                             expert_placement=expert_placement)
    app[EXIT_ON_LOAD_ERROR] = exit_on_load_error
    app[KEEPALIVE_S] = keepalive_timeout_s
    app[LIMITER] = connections.ConnectionLimiter(
        connections.default_max_connections() if max_connections is None else max_connections)
    openai_api.add_routes(app)
    app.router.add_post("/v1/infer", infer)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/v1/model", model_info)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.on_startup.append(_startup)
    if graceful_sigterm_delay_s is not None:
        app.on_startup.append(_install_graceful_sigterm(graceful_sigterm_delay_s))
    app.on_response_prepare.append(_close_when_draining)
    app.on_shutdown.append(_drain)
    if admin is not None:
        app.on_startup.append(lambda a: _start_admin(a, admin))
        app.on_cleanup.append(_stop_admin)
    app.on_cleanup.append(_cleanup)
    return app


def create_admin_app(app: web.Application, *, auth: AdminAuth) -> web.Application:
    """``GET``/``PUT /admin/gate`` and ``/admin/access`` over the same state as ``app`` (the
    inference app); every request needs ``auth``'s Bearer token. TLS is the listener's
    (:class:`AdminListener`)."""
    admin = web.Application(middlewares=[json_errors], client_max_size=MAX_BODY_BYTES)
    admin[STATE] = app[STATE]
    admin[AUTH] = auth
    admin.router.add_get("/admin/gate", get_gate)
    admin.router.add_put("/admin/gate", put_gate)
    admin.router.add_get("/admin/access", get_access)
    admin.router.add_put("/admin/access", put_access)
    return admin


async def _start_admin(app: web.Application, listener: AdminListener) -> None:
    # The same keep-alive and connection cap as the inference listener (a bare AppRunner keeps an
    # idle connection about an hour): both take this process's descriptors.
    runner = web.AppRunner(create_admin_app(app, auth=listener.files), access_log=None,
                           keepalive_timeout=app[KEEPALIVE_S])
    await runner.setup()
    await connections.LimitedTCPSite(runner, listener.host, listener.port, limiter=app[LIMITER],
                                     ssl_context=listener.files.ssl_context(),
                                     ssl_handshake_timeout=min(app[KEEPALIVE_S], 60.0)).start()
    app[ADMIN_RUNNER] = runner


async def _stop_admin(app: web.Application) -> None:
    runner = app.get(ADMIN_RUNNER)
    if runner is not None:
        await runner.cleanup()


async def wait_ready(app: web.Application) -> None:
    """For in-process users (tests): wait until the model is loaded."""
    await app[LOADER]


def load_gate_file(path: str, *, num_experts: int) -> GateDocument:
    with open(path, encoding="utf-8") as f:
        return parse_document(json.load(f), num_experts=num_experts)


_DEFAULT = ModelConfig()


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model shape flags (SparseModel spec.model); defaults build today's TinyMoELM."""
    g = p.add_argument_group("model shape")
    g.add_argument("--d-model", type=int, default=_DEFAULT.d_model, help="hidden size (dModel)")
    g.add_argument("--experts", type=int, default=_DEFAULT.num_experts,
                   help="experts per MoE layer")
    g.add_argument("--layers", type=int, default=_DEFAULT.n_layers, help="MoE blocks")
    g.add_argument("--heads", type=int, default=None,
                   help="attention heads (default: 4, or 2 or 1 when 4 does not divide --d-model)")
    g.add_argument("--d-ff", type=int, default=None,
                   help="expert hidden size (default: 2 x --d-model)")
    g.add_argument("--vocab", type=int, default=_DEFAULT.vocab_size, help="vocabulary size")
    g.add_argument("--max-seq-len", type=int, default=_DEFAULT.max_seq_len)
    g.add_argument("--min-experts-per-token", type=int, default=_DEFAULT.min_experts_per_token,
                   help="fewest experts the model lets a token use")
    g.add_argument("--max-experts-per-token", type=int, default=None,
                   help="most experts the model lets a token use (default: --experts)")


def model_config_from_args(args: argparse.Namespace) -> ModelConfig:
    """Raises ValueError naming every problem with the shape."""
    return ModelConfig(d_model=args.d_model, num_experts=args.experts, n_layers=args.layers,
                       n_heads=args.heads or default_heads(max(args.d_model, 1)),
                       d_ff=args.d_ff or 2 * args.d_model,
                       vocab_size=args.vocab, max_seq_len=args.max_seq_len, seed=args.seed,
                       min_experts_per_token=args.min_experts_per_token,
                       max_experts_per_token=args.max_experts_per_token)


THREADS_ENV = "SPARSEGATE_TORCH_THREADS"


def torch_threads(flag: int | None, environ: Mapping[str, str] = os.environ, *,
                  cgroup_root: str = cgroup_limits.CGROUP_ROOT) -> int:
    """``--threads``, else ``$SPARSEGATE_TORCH_THREADS`` (empty counts as unset), else the
    container's CPU limit (cgroup ``cpu.max`` / CFS quota, rounded up, at most the CPUs this process
    may use), else 1 (no limit: many servers share a machine). Never ``os.cpu_count()``: that is
    the node's cores, and that many threads under a smaller quota are throttled every period.
    Raises ValueError naming the flag or the variable when the value is not an integer >= 1."""
    if flag is not None:
        if flag < 1:
            raise ValueError(f"--threads must be at least 1, got {flag}")
        return flag
    raw = environ.get(THREADS_ENV, "").strip()
    if not raw:
        return cgroup_limits.threads_for_limit(cgroup_limits.cpu_limit(cgroup_root)) or 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"${THREADS_ENV} must be an integer of at least 1, got {raw!r}")
    return value


# The operator sets the pod's delay in the environment, not as a flag: a model-server image older
# than the operator (a pinned spec.image) ignores a variable it does not know, but would exit 2 on
# an unknown flag.
SHUTDOWN_DELAY_ENV = "SPARSEGATE_SHUTDOWN_DELAY"


def shutdown_delay(flag: float | None, environ: Mapping[str, str] = os.environ) -> float:
    """``--shutdown-delay``, else ``$SPARSEGATE_SHUTDOWN_DELAY`` (empty counts as unset), else
    0. Raises ValueError naming the flag or the variable unless the value is in [0, 3600] s."""
    if flag is not None:
        value, source = flag, "--shutdown-delay"
    else:
        raw = environ.get(SHUTDOWN_DELAY_ENV, "").strip()
        if not raw:
            return DEFAULT_SHUTDOWN_DELAY_S
        source = f"${SHUTDOWN_DELAY_ENV}"
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{source} must be a number of seconds, got {raw!r}") from None
    if not 0 <= value <= 3600:  # float() takes "nan" and "inf"
        raise ValueError(f"{source} must be in [0, 3600] seconds, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """Every flag of ``python -m sparsegate_workload.server`` (what the operator renders into pods)."""
    p = argparse.ArgumentParser(prog="python -m sparsegate_workload.server")
    p.add_argument("--version", action="version", version=version_line("sparsegate_workload.server"))
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--gate-config", help="gate document JSON (the <model>-gate ConfigMap)")
    p.add_argument("--admin-port", type=int, default=DEFAULT_ADMIN_PORT,
                   help="TLS port of GET/PUT /admin/gate and /admin/access (bound on --host)")
    p.add_argument("--admin-token-file", help="file holding the admin Bearer token")
    p.add_argument("--admin-tls-cert", help="PEM certificate the admin listener presents")
    p.add_argument("--admin-tls-key", help="PEM private key of --admin-tls-cert")
    p.add_argument("--threads", type=int, default=None,
                   help=f"torch intra-op threads (default: ${THREADS_ENV} when set and not empty, "
                        "else the container's CPU limit rounded up (cgroup cpu.max), else 1: "
                        "many servers share a machine)")
    p.add_argument("--seed", type=int, default=0, help="model init seed")
    p.add_argument("--model-path", metavar="DIR",
                   help="serve this local Hugging Face MoE checkpoint (config.json, safetensors, "
                        "tokenizer files) instead of the built-in model; the shape flags are "
                        "then ignored. Nothing is downloaded.")
    p.add_argument("--served-model-name",
                   help="model id on the OpenAI API and in vLLM metrics (default: the "
                        "--model-path directory's name)")
    p.add_argument("--model-dtype", choices=sorted(hf_serving.DTYPES), default="float32",
                   help="compute dtype of --model-path (bfloat16 halves a bf16 checkpoint's "
                        "memory against the float32 default)")
    p.add_argument("--device", choices=DEVICE_CHOICES, default="auto",
                   help="where --model-path runs (weights, KV caches, MoE dispatch): auto = cuda "
                        "when torch sees a GPU, else cpu; cuda without one exits with the reason. "
                        "The built-in model always runs on the CPU")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                   help="generations decoded together in one model step (continuous batching); "
                        "more wait in the queue bounded by --max-inflight")
    p.add_argument("--fault-seed", type=int, default=0, help="seed of the fault-injection RNG")
    p.add_argument("--max-inflight", type=int, default=DEFAULT_MAX_INFLIGHT,
                   help="inference requests admitted at once (running + queued; an OpenAI request holds one "
                        "per sequence: each prompt and each of its n choices); beyond it: 429")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT_S,
                   help="seconds a request waits for its result before answering 503")
    p.add_argument("--keepalive-timeout", type=float,
                   default=connections.DEFAULT_KEEPALIVE_TIMEOUT_S,
                   help="seconds an idle connection (or one that has not sent a whole request) "
                        "stays open, on both listeners")
    p.add_argument("--max-connections", type=int, default=None,
                   help="connections open at once over both listeners; beyond it a new one "
                        "closes the oldest idle connection, or, when none is idle and "
                        f"{connections.PROBE_RESERVE} more are open, is closed at once (default: "
                        "the soft RLIMIT_NOFILE less a quarter, at least "
                        f"{connections.MIN_HEADROOM_FDS}, and that reserve, at most "
                        f"{connections.MAX_DEFAULT_CONNECTIONS})")
    p.add_argument("--shutdown-delay", type=float, default=None,
                   help="on SIGTERM: seconds to keep serving while /readyz answers 503 (endpoints "
                        "catch up), before new requests get 503 and those in flight finish "
                        f"(at most --request-timeout); then exit 0 (default: ${SHUTDOWN_DELAY_ENV} "
                        "when set and not empty, else 0)")
    p.add_argument("--tools-json", default="[]",
                   help="HTTP tools the tool gate may call on /v1/infer (the built-in model's, or a "
                        "checkpoint's sparsegate_tool_gate.safetensors head; with that head on "
                        "the OpenAI routes too), besides the built-in "
                        "calculator: a JSON list of {name, url, timeoutMs} (SparseModel spec.tools)")
    p.add_argument("--request-auth", choices=("off", "in-cluster"), default="off",
                   help="in-cluster: verify callers' ServiceAccount tokens (audience sparsegate) by "
                        "TokenReview with this pod's ServiceAccount, and refuse POSTs until the "
                        "access rules arrive on PUT /admin/access")
    p.add_argument("--token-cache-ttl", type=float, default=30.0,
                   help="seconds a TokenReview answer is reused for the same token")
    p.add_argument("--expert-groups-json", default="[]",
                   help="named expert groups: a JSON list of {name, experts: [index, ...]} "
                        "(SparseModel spec.expertGroups)")
    p.add_argument("--expert-placement-json", default=None,
                   help="with --model-path: experts stored in their own dtype/device, "
                        "'{\"<layer>|*:<expert>\": {\"dtype\": \"float32|bfloat16|float16\", "
                        "\"device\": \"cpu|cuda:N\"}}'; their cost placement factor is measured at load")
    add_model_flags(p)
    return p


def serve(app: web.Application, *, host: str, port: int) -> None:
    """``web.run_app(app, host=, port=)`` (signals, GracefulExit, clean-up as there), with the
    app's keep-alive timeout and its connection cap on the listener (`connections`)."""
    # handler_cancellation: a client that disconnects cancels its handler, so its generation
    # leaves the batch and frees its slot (aiohttp's default since 3.8 is not to).
    # shutdown_timeout: what is left after the graceful drain (_stop_gracefully) was already
    # answered 503 by _drain; its handlers only write that out.
    async def run() -> None:
        runner = web.AppRunner(app, handle_signals=True, access_log=None,
                               keepalive_timeout=app[KEEPALIVE_S], shutdown_timeout=DRAIN_SLACK_S,
                               handler_cancellation=True)
        await runner.setup()
        try:
            await connections.LimitedTCPSite(runner, host, port, limiter=app[LIMITER]).start()
            while True:
                await asyncio.sleep(3600)
        finally:
            await runner.cleanup()

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    main_task = loop.create_task(run())
    try:
        loop.run_until_complete(main_task)
    except (GracefulExit, KeyboardInterrupt):
        pass
    finally:
        if not main_task.done():
            main_task.cancel()
            with suppress(asyncio.CancelledError):
                loop.run_until_complete(main_task)
        rest = asyncio.all_tasks(loop)
        for task in rest:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*rest, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    try:
        args.threads = torch_threads(args.threads)
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    log.info("torch intra-op threads: %d (container CPU limit: %s)", args.threads,
             cgroup_limits.cpu_limit() or "none")
    # Fail before serving, with the reason: a pod that cannot serve its gate should crash-loop
    # visibly rather than answer probes.
    try:
        cfg = model_config_from_args(args)
    except ValueError as e:
        p.error(str(e))
    try:
        args.shutdown_delay = shutdown_delay(args.shutdown_delay)
    except ValueError as e:
        p.error(str(e))
    # float() takes "nan" and "inf": a NaN timeout fired at once (every request 503), an infinite one
    # never (and the SIGTERM drain waited for it forever).
    if args.max_inflight < 1 or not 0 < args.request_timeout < math.inf or args.max_num_seqs < 1:
        p.error("--max-inflight and --max-num-seqs must be at least 1 and --request-timeout "
                "a finite number above 0")
    if not 0 < args.keepalive_timeout <= 3600:  # float() takes "nan" and "inf"
        p.error(f"--keepalive-timeout must be in (0, 3600] seconds, got {args.keepalive_timeout}")
    if args.max_connections is not None and args.max_connections < 1:
        p.error(f"--max-connections must be at least 1, got {args.max_connections}")
    if args.model_path:
        try:
            check_model_dtype(resolve_device(args.device), args.model_dtype)
        except DeviceError as e:
            p.error(str(e))
    elif args.device == "cuda":
        p.error("--device cuda needs --model-path: the built-in model runs on the CPU only")
    # A checkpoint's expert count is known once it has loaded; the load then checks the gate.
    num_experts = None if args.model_path else cfg.num_experts
    try:
        doc = (load_gate_file(args.gate_config, num_experts=num_experts)
               if args.gate_config else DEFAULT_DOCUMENT)
    except (OSError, json.JSONDecodeError, GateParamsError) as e:
        p.error(f"--gate-config {args.gate_config}: {e}" + (
            f" (this model has {cfg.num_experts} experts)" if num_experts else ""))
    try:
        registry = tools.ToolRegistry(http=tools.parse_tools(json.loads(args.tools_json)))
    except (json.JSONDecodeError, tools.ToolSpecError) as e:
        p.error(f"--tools-json: {e}")
    try:
        groups = request_access.parse_expert_groups(json.loads(args.expert_groups_json),
                                                    num_experts=num_experts)
    except (json.JSONDecodeError, request_access.AccessDocumentError) as e:
        p.error(f"--expert-groups-json: {e}")
    placement = None
    if args.expert_placement_json is not None:
        if not args.model_path:
            p.error("--expert-placement-json needs --model-path (it places a checkpoint's experts)")
        try:
            placement = parse_placement_json(args.expert_placement_json)
        except PlacementError as e:
            p.error(str(e))
    reviewer = None
    if args.request_auth == "in-cluster":
        if not 0 < args.token_cache_ttl <= 86400:  # float() takes "inf"/"nan": a refusal cached forever
            p.error(f"--token-cache-ttl must be in (0, 86400] seconds, got {args.token_cache_ttl}")
        try:
            reviewer = CachedReviewer(KubeTokenReview.in_cluster(), ttl_s=args.token_cache_ttl)
        except ValueError as e:
            p.error(f"--request-auth in-cluster: {e}")
    admin_files = (args.admin_token_file, args.admin_tls_cert, args.admin_tls_key)
    listener: AdminListener | None = None
    if any(admin_files):
        if not all(admin_files):
            p.error("--admin-token-file, --admin-tls-cert and --admin-tls-key go together")
        if args.admin_port == args.port:
            p.error("--admin-port must differ from --port")
        try:
            files = AdminFiles(token_file=args.admin_token_file, cert_file=args.admin_tls_cert,
                               key_file=args.admin_tls_key)
        except (OSError, ssl.SSLError, ValueError) as e:
            p.error(f"admin credentials: {e}")
        listener = AdminListener(host=args.host, port=args.admin_port, files=files)
    if reviewer is not None and listener is None:
        p.error("--request-auth in-cluster needs the admin channel (--admin-token-file ...): the access "
                "rules arrive on PUT /admin/access")
    app = create_app(gate_doc=doc, model_config=cfg, fault_seed=args.fault_seed,
                     max_inflight=args.max_inflight, request_timeout_s=args.request_timeout,
                     admin=listener, model_path=args.model_path,
                     served_name=args.served_model_name, model_dtype=args.model_dtype,
                     device=args.device, max_num_seqs=args.max_num_seqs,
                     exit_on_load_error=True, tool_registry=registry,
                     expert_groups=groups, reviewer=reviewer, expert_placement=placement,
                     graceful_sigterm_delay_s=args.shutdown_delay,
                     keepalive_timeout_s=args.keepalive_timeout, max_connections=args.max_connections)
    log.info("connections: keep-alive %g s, at most %d open (soft RLIMIT_NOFILE %d)",
             args.keepalive_timeout, app[LIMITER].max_connections,
             connections.soft_nofile_limit())
    log.info("serving on %s:%d gate %s model %s; admin %s", args.host, args.port, doc.version,
             json.dumps(app[STATE].shape(), sort_keys=True),
             f"TLS on {args.host}:{args.admin_port}" if listener else "disabled (no --admin-token-file)")
    serve(app, host=args.host, port=args.port)
    state = app[STATE]
    if state.load_error is not None:
        print(state.load_error, file=sys.stderr)
        sys.exit(1)
    if not state.loaded or (state.executor is not None and state.executor.busy_for > 0):
        # Stopped (SIGTERM) while the checkpoint was still loading, or with a model call (a probe
        # scoring) nobody waits for any more: the interpreter would join that non-daemon thread at
        # exit, i.e. finish a load of minutes, past the pod's grace period (then SIGKILL).
        log.info("stopped before the model finished loading (or with a model call still running): "
                 "exiting without waiting for it")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
