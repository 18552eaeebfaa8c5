"""Continuous batching for the OpenAI generation endpoints: the event-loop side.

Requests are submitted as `GenerationHandle`s into a FIFO queue. One driver task runs engine
*jobs* on the server's single model thread (the executor every model call shares, so a gate
swap or a ``/v1/infer`` batch lands between two jobs, never inside one). A job drops the
sequences that left (timed out, client gone), prefills the queued requests that fit in
``max_num_seqs`` and runs one decode step for every decoding sequence (`BatchDecoder.run`).
On a `model_thread.ModelThread` it then keeps stepping while nothing else needs a step
boundary: no other model call queued, no request submitted, cancelled or answered by its tool,
no sequence ended while requests wait. Tokens are handed to the event loop without the model
thread waiting for it: after the job's first step (first tokens), a step that ends a sequence
or fires a tool, and otherwise at most `STREAM_FLUSH_S` apart (see `_job` for the measured
cost that bounds). On any other executor a job is one step.
Back on the event loop, each request gets its tokens (``handle.tokens``) and, on its last one,
its `Generation` (``handle.done``). So requests join and leave between steps.

The queue's bound is the server's admission (``--max-inflight`` running + queued: beyond it
429). A handle's timeout fails it with 503 at once; a queued one leaves the queue then, a
decoding one leaves its batch at the next step boundary, and only then is its ``on_leave``
called (the admission slot freed), so the slot counts what really occupies the model. Closing
the engine (server shutdown) fails everything still queued or decoding with 503.

The vLLM gauges stay true: ``waiting`` counts queued handles, ``running`` decoding ones; the
vLLM token counters count a prompt once prefilled and each token as it is made.

Tools: when the decoder parks a sequence on a tool (`batch_decode.ToolFire`), the engine runs
``tool_runner(handle, fire)`` as its own task on the event loop (it must not raise for a tool's
failure: it returns the forced tokens, or None for plain decoding) while the other sequences
keep stepping; its answer is handed to the next job's ``resume``. With only parked sequences
left, the driver sleeps until a tool answers or a request is cancelled (no empty jobs).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import logging
import threading
import time
from typing import Awaitable, Callable

from .batch_decode import BatchDecoder, DecodeRequest, SeqFailed, TokenEvent, ToolFire
from .hf.gated_block import ActiveGate
from .hf_serving import OFF, Generation, Sampling, TokenLogprob
from .metrics import ServerMetrics
from .model_thread import ModelThread
from .server_state import ApiError

log = logging.getLogger("sparsegate.workload.batch")

DEFAULT_MAX_NUM_SEQS = 32  # sequences decoded together (vLLM's name: max_num_seqs)
STREAM_FLUSH_S = 0.005     # longest a decoded token waits on the model thread within a job

_ids = itertools.count()


class GenerationHandle:
    """One submitted generation, as its HTTP request sees it (event loop only)."""

    def __init__(self, request: DecodeRequest, *, on_leave: Callable[[], None] | None,
                 request_id: str = "", arrived: float | None = None) -> None:
        self.request = request
        self.arrived = arrived  # perf_counter of its HTTP request's arrival (TTFT counts from it)
        self.request_id = request_id  # what its tool calls' audit records name
        self.tokens: asyncio.Queue[int] = asyncio.Queue()
        # With sampling.logprobs: each token's `TokenLogprob` (None: forced by a tool), in the
        # order of ``tokens``, appended before its token is queued.
        self.logprobs: list[TokenLogprob | None] = []
        self.done: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.first_token_at: float | None = None   # perf_counter when its first token arrived
        # When the model made its first and its latest token (`TokenEvent.made`): vLLM's
        # inter-token latency and per-request time per output token count between these.
        self.first_made: float | None = None
        self.last_made: float | None = None
        # The gate version its prefill ran under (it decodes wholly under it), once prefilled:
        # what its request is counted under, also when it fails after (a timeout mid-generation).
        self.gate_version: str | None = None
        self.state = "waiting"                     # -> "running" -> "left"
        self.prompt_counted = False                # in vllm:prompt_tokens_total (prefilled)
        self.cancelled = False
        self._on_leave = on_leave
        self._timer: asyncio.TimerHandle | None = None
        self._tool_task: asyncio.Task[None] | None = None
        # What its tools did, in call order: whatever the engine's tool_runner records here.
        self.tool_calls: list[object] = []

    @property
    def key(self) -> object:
        return self.request.key

    def fail(self, error: Exception) -> None:
        if not self.done.done():
            self.done.set_exception(error)
            self.done.exception()  # retrieved here: a client that left reads it never

    def _left(self) -> None:
        self.state = "left"
        if self._timer is not None:
            self._timer.cancel()
        if self._tool_task is not None and not self._tool_task.done():
            self._tool_task.cancel()
        on_leave, self._on_leave = self._on_leave, None
        if on_leave is not None:
            on_leave()


ToolRunner = Callable[[GenerationHandle, ToolFire], Awaitable[list[int] | None]]


class BatchEngine:
    """Schedules generations into batched decode steps of one `BatchDecoder`."""

    def __init__(self, decoder: BatchDecoder, *, executor: concurrent.futures.Executor,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 metrics: ServerMetrics | None = None,
                 tool_runner: ToolRunner | None = None) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.decoder = decoder
        self.max_num_seqs = max_num_seqs
        self._executor = executor
        self._metrics = metrics
        self._waiting: collections.deque[GenerationHandle] = collections.deque()
        self._running: dict[object, GenerationHandle] = {}
        self._driver: asyncio.Task[None] | None = None
        self._tool_runner = tool_runner
        self._answered: dict[object, list[int] | None] = {}  # parked key -> its tool's answer
        self._wake = asyncio.Event()  # a tool answered, a request came or was cancelled
        # The same news for a running job (read on the model thread): end at the next step.
        self._interrupt = threading.Event()
        self.closed: str | None = None   # why new work is refused (None: open)
        self.steps = 0                   # decode steps run (each: one per gate group)
        self.jobs = 0                    # jobs run (each: one step or more, see _job)
        self.max_batch = 0               # most sequences decoding at once so far

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, prompt_ids: list[int], *, max_tokens: int, temperature: float = 0.0,
               seed: int = 0, timeout_s: float | None = None,
               on_leave: Callable[[], None] | None = None,
               gate: ActiveGate | None = None, max_tool_calls: int = 0,
               request_id: str = "", allowed_experts: tuple[int, ...] | None = None,
               arrived: float | None = None, sampling: Sampling = OFF) -> GenerationHandle:
        """Queue one generation. ``timeout_s``: fail with 503 after that long, and leave.
        ``gate``: prefill and decode under it (a request-level canary), else the installed gate.
        ``on_leave``: called once when it no longer occupies the queue or a batch.
        ``max_tool_calls``: most tool calls its tool gate may make (`batch_decode`).
        ``allowed_experts``: the only experts it may activate (its expert group; None: all);
        an index the model lacks raises ValueError here, before it can fail a batch.
        ``arrived``: when its request arrived (perf_counter): its first token is observed in
        vllm:time_to_first_token_seconds from then, whatever the request's outcome after it.
        ``sampling``: top_k / top_p and the stop conditions (`hf_serving.Sampling`)."""
        if self.closed is not None:
            raise ApiError(503, self.closed)
        self.decoder.allowed_mask(allowed_experts)
        request = DecodeRequest(key=next(_ids), prompt_ids=list(prompt_ids),
                                max_tokens=max_tokens, temperature=temperature, seed=seed, gate=gate,
                                max_tool_calls=max_tool_calls, allowed_experts=allowed_experts,
                                sampling=sampling)
        handle = GenerationHandle(request, on_leave=on_leave, request_id=request_id,
                                  arrived=arrived)
        if timeout_s is not None:
            handle._timer = asyncio.get_running_loop().call_later(
                timeout_s, self._expire, handle, timeout_s)
        self._waiting.append(handle)
        if self._metrics is not None:
            self._metrics.waiting.inc()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        self._poke()  # a driver sleeping on parked sequences admits it now
        return handle

    def cancel(self, handle: GenerationHandle, error: Exception | None = None) -> None:
        """The request is gone (client left, or timed out): fail it, and free its place — at
        once when queued, at the next step boundary when decoding."""
        if handle.state == "left" or handle.cancelled:
            return
        handle.cancelled = True
        handle.fail(error or ApiError(499, "client closed the request"))
        if handle.state == "waiting":
            self._waiting.remove(handle)
            if self._metrics is not None:
                self._metrics.waiting.dec()
            handle._left()
        self._poke()

    def _expire(self, handle: GenerationHandle, timeout_s: float) -> None:
        self.cancel(handle, ApiError(503, f"no result within {timeout_s:g} s"))

    async def close(self, reason: str = "server is shutting down") -> None:
        """Refuse new work and fail what is queued or decoding (503 ``reason``)."""
        self.closed = reason
        for handle in list(self._waiting):
            self.cancel(handle, ApiError(503, reason))
        for handle in list(self._running.values()):
            self.cancel(handle, ApiError(503, reason))
        if self._driver is not None:
            try:
                await self._driver
            except Exception:  # already logged by the driver
                pass

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while self._waiting or self._running:
            self._interrupt.clear()  # before reading the news: later news ends the job
            admit: list[GenerationHandle] = []
            while self._waiting and len(self._running) + len(admit) < self.max_num_seqs:
                if self.closed is not None:
                    break
                admit.append(self._waiting.popleft())
            leave = [h for h in self._running.values() if h.cancelled]
            resume = [(k, t) for k, t in self._answered.items() if k in self._running
                      and not self._running[k].cancelled]
            self._answered.clear()
            if not admit and not leave and not resume and self.decoder.running == 0:
                # Everything running waits for its tool: sleep until one answers.
                self._wake.clear()
                await self._wake.wait()
                continue
            for h in admit:
                h.state = "running"
                self._running[h.key] = h
            if self._metrics is not None and admit:
                self._metrics.waiting.dec(len(admit))
                self._metrics.running.inc(len(admit))
            self.jobs += 1
            try:
                # Each step's tokens reach the loop (_stepped) before the job's own result.
                await loop.run_in_executor(self._executor, self._job, loop,
                                           [h.request for h in admit], leave, resume)
            except Exception as e:  # the model failed: every sequence in it fails too
                log.exception("batched decode step failed")
                await loop.run_in_executor(self._executor, self.decoder.reset)
                for h in list(self._running.values()):
                    h.fail(ApiError(500, f"generation failed: {type(e).__name__}: {e}"))
                    self._leave(h)
                continue

    def _job(self, loop: asyncio.AbstractEventLoop, admit: list[DecodeRequest],
             leave: list[GenerationHandle], resume: list[tuple[object, list[int] | None]]
             ) -> None:
        """On the model thread: one `BatchDecoder.run`, then further plain steps while no one
        needs a step boundary (module docstring). Results go to the loop (`_stepped`) after the
        first step (first tokens), a step that ended a sequence or fired a tool, the last step,
        and otherwise at most `STREAM_FLUSH_S` apart: each hand-off wakes the loop thread, whose
        contention for the GIL cost ~0.1 ms per step of a tiny model when every step woke it."""
        thread = self._executor if isinstance(self._executor, ModelThread) else None
        events = self.decoder.run(admit, [h.key for h in leave], resume)
        pending: list[TokenEvent | ToolFire] = []
        steps = batch = 0
        posted_at = None
        while True:
            ended = sum(1 for e in events if isinstance(e, SeqFailed)
                        or isinstance(e, TokenEvent) and e.generation is not None)
            steps += 1
            batch = max(batch, self.decoder.running + ended)
            pending += events
            last = (thread is None or thread.queued or self._interrupt.is_set()
                    or not self.decoder.running or bool(ended and self._waiting))
            now = time.perf_counter()
            if (last or ended or posted_at is None or now - posted_at >= STREAM_FLUSH_S
                    or any(isinstance(e, ToolFire) for e in events)):
                loop.call_soon_threadsafe(self._stepped, pending, leave, steps, batch)
                pending, leave, steps, batch, posted_at = [], [], 0, 0, now
            if last:
                return
            events = self.decoder.run((), (), ())

    def _stepped(self, events: list[TokenEvent | ToolFire], left: list[GenerationHandle],
                 steps: int, batch: int) -> None:
        """On the loop: the results of ``steps`` steps (``left``: the handles the first one
        dropped; ``batch``: the most sequences one of them decoded)."""
        self.steps += steps
        for h in left:
            self._leave(h)
        self._dispatch(events)
        self.max_batch = max(self.max_batch, batch)

    def _dispatch(self, events: list[TokenEvent | ToolFire]) -> None:
        now = time.perf_counter()
        for event in events:
            handle = self._running.get(event.key)
            if handle is None:
                continue
            if isinstance(event, SeqFailed):  # its prefill (or resume) raised, even alone
                log.warning("generation %s failed alone (the others go on): %s",
                            handle.request_id or handle.key, event.error)
                handle.fail(ApiError(500, f"generation failed: {event.error}"))
                self._leave(handle)
                continue
            if handle.gate_version is None and event.gate_version is not None:
                handle.gate_version = event.gate_version
            if self._metrics is not None:
                # vLLM's token counters: what was processed, counted as it is (its prompt on its
                # first event, each token as it comes), whatever the request's outcome.
                if not handle.prompt_counted:
                    handle.prompt_counted = True
                    self._metrics.prompt_tokens.inc(len(handle.request.prompt_ids))
                if isinstance(event, TokenEvent):
                    self._metrics.generation_tokens.inc()
            if isinstance(event, ToolFire):
                handle._tool_task = asyncio.create_task(self._call_tool(handle, event))
                continue
            if not handle.cancelled:
                if handle.first_token_at is None:
                    handle.first_token_at = now
                    if self._metrics is not None and handle.arrived is not None:
                        self._metrics.ttft.observe(now - handle.arrived)
                self._made(handle, event)
                if handle.request.sampling.logprobs is not None:
                    handle.logprobs.append(event.logprob)
                handle.tokens.put_nowait(event.token)
                if event.generation is not None:
                    handle.done.set_result(event.generation)
            if event.generation is not None:
                self._leave(handle)

    def _made(self, handle: GenerationHandle, event: TokenEvent) -> None:
        """vLLM's vllm:inter_token_latency_seconds (each model output after a request's first:
        the time since its previous one; tokens one output made together, as a tool's forced
        text, count once) and, as its generation ends, vllm:request_time_per_output_token_seconds
        (its first to last token over its tokens after the first; 0 for one token)."""
        if handle.first_made is None:
            handle.first_made = event.made
        elif event.made > handle.last_made and self._metrics is not None:  # type: ignore[operator]
            self._metrics.itl.observe(event.made - handle.last_made)  # type: ignore[operator]
        handle.last_made = event.made
        if event.generation is not None and self._metrics is not None:
            after_first = len(event.generation.token_ids) - 1
            self._metrics.tpot.observe((event.made - handle.first_made) / after_first
                                       if after_first > 0 else 0.0)

    async def _call_tool(self, handle: GenerationHandle, fire: ToolFire) -> None:
        """Run the tool on the event loop; its answer (None: plain decoding) goes to the next
        job. A runner that raises degrades to plain decoding too."""
        forced: list[int] | None = None
        if self._tool_runner is not None:
            try:
                forced = await self._tool_runner(handle, fire)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("tool runner failed for %s; decoding goes on without it", fire.tool)
        self._answered[handle.key] = forced
        self._poke()

    def _poke(self) -> None:
        """News for the driver: wake it if asleep, end a running job at its next step."""
        self._wake.set()
        self._interrupt.set()

    def _leave(self, handle: GenerationHandle) -> None:
        if self._running.pop(handle.key, None) is not None and self._metrics is not None:
            self._metrics.running.dec()
        handle._left()
