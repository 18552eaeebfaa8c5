"""Batched decoding of a Hugging Face MoE checkpoint with a per-sequence KV cache: the model
side of continuous batching (`batch_engine` schedules it from the event loop).

Every call here runs on the server's one model thread. Sequences join with a prefill of their
prompts packed end to end in one row (positions restarting per prompt, a block-diagonal causal
mask, up to `MAX_PREFILL_TOKENS` per forward), so no padding token ever reaches the MoE routing;
a config with a ``sliding_window`` prefills each prompt alone, since the packing mask would
ignore the window. The prefill gives each its first token and its KV cache. It then decodes in
a *group*: the sequences that run under the same gate version, decoded together one token per
model step. A group holds each
layer's keys/values as one left-padded tensor [N, heads, L, head_dim] plus a 0/1 mask [N, L];
a step feeds each sequence's last token at its own position (``position_ids``) with the mask
extended by one column, exactly what ``transformers``' own ``generate()`` does with a
left-padded batch. A joining sequence's cache is left-padded to the group's length (or the
group's to its); a leaving sequence's row is dropped and columns no row uses any more are
trimmed, so sequences join and leave between any two steps.

Threshold control: a gate with targetExpertsPerToken carries its PI controller
(`ActiveGate.controller`); every prefill and step under it routes with the controller's
threshold of the moment; after an engine job (`run`: its prefills and one step) in which that
gate's tokens since the last feed reach `CONTROL_FEED_TOKENS`, the controller is fed their mean
selected experts per token, so prefills and decode steps of all requests under one version
drive one loop, each token weighing alike. Forwards holding a token scoped to an expert group
are not counted (the group bounds its tokens' experts, not the threshold).

Gate versions: a sequence is prefilled under the gate in force then (`SparseGatedCausalLM.gate`)
and stays in that version's group until it ends, and every step runs under one group's pinned
gate (`pin_gate`), so a step never mixes versions and a gate swap between steps never changes
the routing params of a sequence already started. Groups are keyed by gate version, so two
versions can decode side by side while the old one drains. The weights are the exception: a
checkpoint holds one weight storage, so a swap whose precisionPolicy resolves to other
precisions re-stores them (`SparseGatedCausalLM.set_gate`) and the sequences already decoding
(or parked) under the old version compute their remaining steps with the new storage, still
routed by, and reported under, their own version.

Batched equals solo: greedy decoding (or sampling seeded per request) gives the same tokens as
`HFServedModel.generate` for the request alone, up to float rounding of the batched matmuls,
as long as the gate's capacity cap drops nothing: a capacity factor caps an expert's tokens per
*step*, and a step holds every sequence of the group, so under a binding cap sequences compete
(as in any capacity-capped MoE batch). Usage is split per sequence from each step's routing
(`GateCall.routings`): expert counts, kept and dropped assignments and per-call entropy, as the
solo path reports them.

Sampling and stops (`hf_serving.Sampling`, per request): logit_bias and the presence,
frequency and repetition penalties change a row's logits (greedy ones too), top_k / top_p
narrow each sampled row's distribution (`hf_serving.next_token`, the solo path's own function). A sequence ends at
the step whose token is an end-of-sequence token (unless ``ignore_eos``) or one of its
``stop_token_ids``, or whose decoded text (the tokenizer's, on this thread) then holds one of
its ``stop`` strings (`hf_serving.StopCheck`): its `Generation` says which
(``stop_reason``) and where the answer's text ends (``text_end``), and it leaves its group at
that step as at max_tokens. Tool-forced tokens end it only by a stop string their text
completes (then at once, so a stream never sends it) or by max_tokens; the end-of-sequence
and stop token ids are the model's choices only. Logprobs: a request with
``logprobs`` gets each sampled token's log-softmax of the raw logits row it was chosen from
(and the most probable alternatives); with ``prompt_logprobs``, its prefill applies the LM head
to its own prompt's positions of the packed hidden states, a chunk of positions at a time.

Expert groups (per-request access): a request with ``allowed_experts`` (its group's experts) may
activate only those. Sequences of any groups and unscoped ones share prefills and groups; each
forward pins a per-token mask (`GateCall.allowed` [T, E]: in a packed prefill each prompt token
gets its sequence's row, in a step each sequence's one token), so the gate masks a scoped row's
other experts before selection while an unscoped row's routing is what it would be alone. A forward
with no scoped sequence routes with no mask at all.

Tools: a request with ``max_tool_calls`` > 0 on a checkpoint with a tool-gate head
(`hf.tool_head`) has its tool-gate probability read at its last position after its prefill and
after every step (the hidden state the LM head reads, captured by a hook). Above its gate's
``toolGateThreshold``, when ``tool_select`` (set by the server) finds a tool call in the
sequence's text, the token just sampled is held back and the sequence is *parked*: it leaves its
group with its own KV cache (a `ToolFire` event tells the engine what to call) while the others
keep decoding. `run`'s ``resume`` brings it back: with the result's tokens, they are forced (one
forward over them on its cache, which grows by them), appended to the generation, and the token
after them is sampled from that forward; with None (the tool failed), the held-back token is
kept (plain decoding). Either way it rejoins its version's group. Forced tokens count toward
``max_tokens`` (cut there, finish ``length``) and are not scored as prompt quality.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Hashable, Sequence

import torch

from .experts import buckets_rows, row_bucket
from .hf.gated_block import ActiveGate, GateCall, pin_gate
from .hf.tool_head import final_hidden
from .hf_serving import (OFF, Generation, HFServedModel, Sampling, StopCheck, TokenLogprob, next_token,
                          prompt_logprobs, token_logprob)
from .quality import Score, score_packed_hidden

# Most prompt tokens one packed prefill forward holds (its attention mask is T x T booleans).
MAX_PREFILL_TOKENS = 2048
# Routed tokens (per MoE block) under a controlled gate between two feeds of its threshold
# controller (`BatchDecoder._feed_controllers`).
CONTROL_FEED_TOKENS = 32


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """What to generate for one request; ``key`` names it in events and removals."""

    key: Hashable
    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0
    # The gate to prefill (and so decode) under: a request-level canary's; None: the installed one.
    gate: ActiveGate | None = None
    # Most tool calls the tool gate may make for it (0: none; only with a tool-gate head).
    max_tool_calls: int = 0
    # The only experts its tokens may activate (its expert group, per-request access); None: all.
    allowed_experts: tuple[int, ...] | None = None
    # top_k / top_p, stop strings and token ids, ignore_eos, min_tokens, (prompt) logprobs
    # (`hf_serving.Sampling`).
    sampling: Sampling = OFF


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A token made for ``key``; ``generation`` is set on its last token. ``gate_version``: on
    its first token (the prefill's), the version it was prefilled and so decodes under."""

    key: Hashable
    token: int
    generation: Generation | None = None
    gate_version: str | None = None
    # perf_counter when the model made it (on the model thread, right after its forward): what
    # vllm:inter_token_latency_seconds measures between, not when the event loop got to it
    # (the engine hands tokens over in bunches, `batch_engine.STREAM_FLUSH_S`).
    made: float = dataclasses.field(default_factory=time.perf_counter, compare=False)
    # With `Sampling.logprobs`: this token's `TokenLogprob` (None for a token a tool forced).
    logprob: TokenLogprob | None = None


@dataclasses.dataclass(frozen=True)
class ToolFire:
    """``key``'s tool gate fired at ``position`` (its last token, prompt + generated) and its
    text selects ``tool`` with ``arguments``: the sequence is parked until `BatchDecoder.run`
    gets its resume."""

    key: Hashable
    tool: str
    arguments: str
    position: int
    gate_probability: float
    gate_version: str | None = None  # the version it decodes under


@dataclasses.dataclass(frozen=True)
class SeqFailed:
    """``key``'s prefill (or its resume after a tool) raised a RuntimeError even alone, e.g. out
    of memory for its prompt: it is dropped, and only it fails (`BatchDecoder._alone`)."""

    key: Hashable
    error: str  # "<exception type>: <message>"


class _Seq:
    """One sequence's decoding state (model thread only); its usage lives in its group."""

    def __init__(self, req: DecodeRequest, stops: StopCheck, allowed: torch.Tensor | None = None) -> None:
        self.req = req
        self.stops = stops      # its end conditions (eos, stop token ids and strings, max_tokens)
        self.allowed = allowed  # [E] bool of req.allowed_experts (None: every expert)
        self.generator = torch.Generator().manual_seed(req.seed)
        self.generated: list[int] = []
        # With req.sampling.logprobs: one per generated token, and the sampled token's not yet
        # appended (a token held back for a tool may be replaced by the tool's text).
        self.logprobs: list[TokenLogprob | None] = []
        self.pending_logprob: TokenLogprob | None = None
        self.prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # req.sampling.prompt_logprobs
        self.gate_version: str | None = None
        self.tool_calls = 0

    @property
    def ids(self) -> list[int]:
        return [*self.req.prompt_ids, *self.generated]

    @property
    def next_position(self) -> int:
        """Position id of the last generated token (the one the next step feeds)."""
        return len(self.req.prompt_ids) + len(self.generated) - 1


# Usage accumulators, per sequence and MoE block: [experts..., selected, entropy sum over calls,
# tokens routed, calls]. "selected" counts assignments before the capacity cap (kept = the sum
# of the expert counts), and each block call adds the mean entropy of the sequence's tokens in
# it, as the solo path averages per call.
_SELECTED, _ENTROPY, _TOKENS, _CALLS = range(-4, 0)


@dataclasses.dataclass
class _Parked:
    """A sequence waiting for its tool: its cache (no padding), usage and held-back token."""

    seq: _Seq
    gate: ActiveGate
    keys: list[torch.Tensor]     # per layer [1, heads, length, head_dim]
    values: list[torch.Tensor]
    acc: torch.Tensor            # [blocks, experts + 4]
    held: int                    # the token the model sampled where the gate fired


@dataclasses.dataclass
class _Joiner:
    """A prefilled sequence on its way into a group: its own cache and usage."""

    seq: _Seq
    keys: list[torch.Tensor]     # per layer [1, heads, prompt length, head_dim]
    values: list[torch.Tensor]
    mask: torch.Tensor           # [1, prompt length] ones
    acc: torch.Tensor            # [blocks, experts + 4]


class _Group:
    """The sequences decoding under one gate version, with their left-padded KV cache (one
    ``DynamicCache`` kept across steps, rebuilt only when a sequence joins or leaves) and their
    usage accumulators ``acc`` [N, blocks, experts + 4] (one add per step)."""

    def __init__(self, gate: ActiveGate, seqs: list[_Seq], keys: list[torch.Tensor],
                 values: list[torch.Tensor], mask: torch.Tensor, acc: torch.Tensor) -> None:
        self.gate = gate
        self.seqs = seqs
        self.acc = acc
        self.mask = mask          # [N, L] long: 1 where a cached position is real
        self.padded = False       # some row has padding (else no mask is passed: cheaper)
        self.allowed = _allowed_rows(seqs)  # [N, E] bool when some row is scoped, else None
        self.set_cache(keys, values)

    def set_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Per layer [N, heads, L, head_dim] keys and values."""
        from transformers import DynamicCache

        self.cache = DynamicCache(ddp_cache_data=list(zip(keys, values)))
        self.padded = not bool(self.mask.all())

    def set_allowed(self) -> None:
        """Rebuild the per-row expert mask after ``seqs`` changed (None while no row is scoped,
        so an unscoped group routes exactly as before)."""
        self.allowed = _allowed_rows(self.seqs)

    @property
    def keys(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.cache.layers]

    @property
    def values(self) -> list[torch.Tensor]:
        return [layer.values for layer in self.cache.layers]


class BatchDecoder:
    """Continuous-batching decoder over one loaded checkpoint (model thread only)."""

    def __init__(self, hf: HFServedModel) -> None:
        self.hf = hf
        self.lm = hf.lm
        self.device = next(self.lm.model.parameters()).device
        self._groups: dict[str | None, _Group] = {}
        self._where: dict[Hashable, _Group] = {}
        # Packing prompts needs a mask of our own, which would ignore a sliding window.
        self._packable = not _uses_sliding_window(self.lm.model.config)
        self._buckets = buckets_rows(self.device, self.lm.model.dtype)  # the prefill pads (_prefill)
        # Called with (gate version, prompt NLL) after each prefill: live quality (quality.py),
        # scored from the prefill's own forward (its LM head applied a chunk of positions at a time).
        self.on_prompts_scored: Callable[[str | None, Score], None] | None = None
        # Called with (gate version, next threshold) after a forward fed a gate's threshold
        # controller (targetExpertsPerToken): the server's gauge.
        self.on_threshold: Callable[[str | None, float], None] | None = None
        # id(controller) -> [gate, selected assignments, routed tokens] since the last feed.
        self._measured: dict[int, list[Any]] = {}
        # A sequence's text (prompt + generated ids) -> (tool, arguments) it calls, or None:
        # set by the server (its tool registry and the tokenizer's text); None: no tool calls.
        self.tool_select: Callable[[list[int]], tuple[str, str] | None] | None = None
        self._parked: dict[Hashable, _Parked] = {}
        # Called after every forward with its sequences' keys and their expert counts in it
        # ([n, MoE blocks, experts] tokens routed): which experts each sequence used, per step.
        self.on_routed: Callable[[list[Hashable], torch.Tensor], None] | None = None

    @property
    def running(self) -> int:
        """Sequences in a decode group (parked ones wait for their tool outside)."""
        return len(self._where)

    @property
    def parked(self) -> int:
        return len(self._parked)

    def group_sizes(self) -> dict[str | None, int]:
        """Sequences decoding per gate version now."""
        return {v: len(g.seqs) for v, g in self._groups.items()}

    def run(self, admit: Sequence[DecodeRequest], leave: Sequence[Hashable],
            resume: Sequence[tuple[Hashable, list[int] | None]] = ()
            ) -> list[TokenEvent | ToolFire]:
        """One engine job: drop ``leave``, resume parked sequences (their tool's tokens, or
        None: plain decoding), prefill ``admit`` (packed, under the gate in force now), then one
        decode step per gate group. Returns the tokens made and the tool fires, in order.
        Controlled gates are fed once, after the whole job."""
        for key in leave:
            self.remove(key)
        events: list[TokenEvent | ToolFire] = []
        for key, forced in resume:
            events += self._alone([key], lambda: self._resume(key, forced))
        events += self._add_many(admit)
        events += self._step()
        self._feed_controllers()
        return events

    def reset(self) -> None:
        """Forget every sequence (after a failed job: their caches may be half-updated)."""
        self._groups.clear()
        self._where.clear()
        self._measured.clear()
        self._parked.clear()

    def add(self, req: DecodeRequest) -> TokenEvent:
        """Prefill ``req`` alone; its first token, and its generation if that ended it."""
        return self.add_many([req])[0]

    def add_many(self, reqs: Sequence[DecodeRequest]) -> list[TokenEvent]:
        """Prefill ``reqs`` under the gate in force, packed into as few forwards as
        `MAX_PREFILL_TOKENS` allows; each one's first token (and generation if that ended it)."""
        events = self._add_many(reqs)
        self._feed_controllers()
        return events

    def _add_many(self, reqs: Sequence[DecodeRequest]) -> list[TokenEvent | ToolFire]:
        keys = [r.key for r in reqs]
        if len(set(keys)) < len(keys) or any(k in self._where or k in self._parked for k in keys):
            raise ValueError(f"a sequence of {keys!r} is already decoding")
        events: list[TokenEvent | ToolFire] = []
        pack: list[DecodeRequest] = []
        for req in reqs:
            # One forward runs under one gate: a request for another version starts a new pack.
            if pack and (sum(len(r.prompt_ids) for r in pack) + len(req.prompt_ids)
                         > MAX_PREFILL_TOKENS or not self._packable or req.gate is not pack[0].gate):
                events += self._prefill_isolated(pack)
                pack = []
            pack.append(req)
        if pack:
            events += self._prefill_isolated(pack)
        return events

    def _prefill_isolated(self, reqs: Sequence[DecodeRequest]
                          ) -> list[TokenEvent | ToolFire | SeqFailed]:
        """`_prefill`, where a RuntimeError (torch's out of memory among them) of a packed
        prefill retries its requests one at a time, and one that raises alone ends in a
        `SeqFailed`: a prefill builds its own cache, so the sequences already decoding are
        untouched and go on (they all failed with it before)."""
        if len(reqs) == 1:
            return self._alone([reqs[0].key], lambda: self._prefill(reqs))
        try:
            return self._prefill(reqs)
        except RuntimeError:
            for req in reqs:  # whatever of the pack got in before it raised
                self.remove(req.key)
        events: list[TokenEvent | ToolFire | SeqFailed] = []
        for req in reqs:
            events += self._alone([req.key], lambda: self._prefill([req]))
        return events

    def _alone(self, keys: Sequence[Hashable], run: Callable[[], list[Any]]) -> list[Any]:
        """``run()``'s events; if it raises a RuntimeError, ``keys`` are dropped and each gets
        a `SeqFailed` (the other sequences are not touched by ``run``: a prefill or a resume
        works on its own cache)."""
        try:
            return run()
        except RuntimeError as e:
            for key in keys:
                self.remove(key)
            return [SeqFailed(key, f"{type(e).__name__}: {e}") for key in keys]

    def _prefill(self, reqs: Sequence[DecodeRequest]) -> list[TokenEvent | ToolFire]:
        """One forward over the prompts of ``reqs`` packed end to end in one row (no padding
        reaches the MoE routing): positions restart at 0 for each prompt and a block-diagonal
        causal mask keeps each prompt to itself. Then each joins its gate version's group."""
        seqs = [_Seq(r, StopCheck(r.sampling, eos_ids=self.hf.eos_ids, max_tokens=r.max_tokens,
                                  tokenizer=self.hf.tokenizer), self.allowed_mask(r.allowed_experts))
                for r in reqs]
        lengths = [len(r.prompt_ids) for r in reqs]
        total = sum(lengths)
        # bf16 on CPU: the forward's length rounded up to a shape bucket (experts.row_bucket), so
        # oneDNN builds its kernels for few lengths instead of every new one (~4 ms a matmul
        # shape here). The padding goes last, its own block of the mask: causal attention keeps
        # every prompt from seeing it, the MoE blocks do not route it (pin_gate rows), and its
        # hidden states and cache columns are never read.
        pad = row_bucket(total) - total if self._buckets else 0
        ids = torch.tensor([[*(t for r in reqs for t in r.prompt_ids), *[0] * pad]], dtype=torch.long,
                           device=self.device)
        blocks = [*lengths, pad] if pad else lengths
        owner = torch.repeat_interleave(torch.arange(len(blocks), device=self.device),
                                        torch.tensor(blocks, device=self.device))
        kwargs: dict[str, Any] = {}
        if len(reqs) > 1:
            starts = torch.tensor([0, *itertools.accumulate(blocks)][:-1],
                                  device=self.device)
            positions = torch.arange(ids.shape[1], device=self.device) - starts[owner]
            same = owner.unsqueeze(1) == owner.unsqueeze(0)
            causal = positions.unsqueeze(1) >= positions.unsqueeze(0)
            kwargs = {"position_ids": positions.unsqueeze(0),
                      "attention_mask": (same & causal)[None, None]}  # [1, 1, T, T], True: attend
        owner = owner[:total]
        gate = reqs[0].gate or self.lm.gate  # add_many packs only requests of one gate
        rows = _allowed_rows(seqs)  # per token: its sequence's experts
        allowed = None if rows is None else rows.index_select(0, owner)
        # The base model to its final hidden states (what the LM head reads), not the whole
        # model: its logits would be [T, vocab] (GBs for a 150k vocabulary and a long prefill);
        # the head runs only at each prompt's last position, and in chunks for the score.
        with torch.inference_mode(), pin_gate(gate, keep_routing=len(reqs) > 1, allowed=allowed,
                                              rows=total if pad else None) as call:
            out = self.lm.model.base_model(input_ids=ids, use_cache=True, **kwargs)
        self._measure(call)
        table = (self._usage_rows(call, owner=owner, n=len(reqs)) if len(reqs) > 1
                 else self._usage_alone(call))
        self._routed(seqs, table)
        ends = list(itertools.accumulate(lengths))
        hidden = out.last_hidden_state[0, :total]  # [T, hidden]
        head = self.lm.model.get_output_embeddings()
        at_ends = hidden[[e - 1 for e in ends]]  # [n, hidden]: each prompt's last position
        with torch.inference_mode():
            if self.on_prompts_scored is not None:
                self.on_prompts_scored(call.gate.version,
                                       score_packed_hidden(hidden, head, ids[0, :total], lengths))
            last = head(at_ends)
            for seq, end, length in zip(seqs, ends, lengths):
                n = seq.req.sampling.prompt_logprobs
                if n is not None:  # the head over its prompt's positions, a chunk at a time
                    seq.prompt_logprobs = prompt_logprobs(
                        lambda rows, start=end - length: head(hidden[start + rows.start:start + rows.stop]),
                        list(seq.req.prompt_ids), n)
        tokens = self._sample(seqs, last)
        fires = self._tool_fires(seqs, call.gate, at_ends if self._may_call_tool(seqs) else None)
        layers = out.cache.layers
        events: list[TokenEvent | ToolFire] = []
        joiners = []
        for i, (seq, token, end, length) in enumerate(zip(seqs, tokens, ends, lengths)):
            seq.gate_version = call.gate.version
            cols = slice(end - length, end)
            if fires[i] is not None:
                # Copies: a view would keep the whole packed prefill's cache alive while parked.
                self._parked[seq.req.key] = _Parked(
                    seq, call.gate, keys=[layer.keys[:, :, cols].clone() for layer in layers],
                    values=[layer.values[:, :, cols].clone() for layer in layers], acc=table[i],
                    held=token)
                events.append(fires[i])
                continue
            finish = self._append(seq, token)
            if finish is not None:
                events.append(TokenEvent(seq.req.key, token,
                                         self._generation(seq, finish, table[i]),
                                         gate_version=seq.gate_version, logprob=_last_logprob(seq)))
                continue
            events.append(TokenEvent(seq.req.key, token, gate_version=seq.gate_version,
                                     logprob=_last_logprob(seq)))
            joiners.append(_Joiner(
                seq, keys=[layer.keys[:, :, cols] for layer in layers],
                values=[layer.values[:, :, cols] for layer in layers],
                mask=torch.ones(1, length, dtype=torch.long, device=self.device), acc=table[i]))
        self._join(call.gate, joiners)
        return events

    def remove(self, key: Hashable) -> bool:
        """Drop ``key``'s sequence (no-op when it is not decoding or parked); True if it was."""
        if self._parked.pop(key, None) is not None:
            return True
        group = self._where.pop(key, None)
        if group is None:
            return False
        keep = [i for i, s in enumerate(group.seqs) if s.req.key != key]
        self._keep_rows(group, keep)
        return True

    def step(self) -> list[TokenEvent | ToolFire]:
        """One token for every decoding sequence: one model forward per gate group."""
        events = self._step()
        self._feed_controllers()
        return events

    def _step(self) -> list[TokenEvent | ToolFire]:
        events: list[TokenEvent | ToolFire] = []
        for version in list(self._groups):
            events += self._step_group(self._groups[version])
        return events

    # -- internals -------------------------------------------------------------------------

    def _step_group(self, group: _Group) -> list[TokenEvent | ToolFire]:
        seqs = group.seqs
        n = len(seqs)
        last = torch.tensor([[s.generated[-1]] for s in seqs], dtype=torch.long,
                            device=self.device)
        positions = torch.tensor([[s.next_position] for s in seqs], dtype=torch.long,
                                 device=self.device)
        mask = torch.cat([group.mask, group.mask.new_ones(n, 1)], dim=1)
        # One row needs no split of its routing: the block stats are its own.
        with torch.inference_mode(), pin_gate(group.gate, keep_routing=n > 1, allowed=group.allowed) as call:
            out, hidden = self._forward(seqs, input_ids=last,
                                        attention_mask=mask if group.padded else None,
                                        position_ids=positions, cache=group.cache, use_cache=True)
        self._measure(call)
        group.mask = mask  # the cache grew by one column in place
        used = (self._usage_rows(call, owner=torch.arange(n, device=self.device), n=n)
                if n > 1 else self._usage_alone(call))
        group.acc += used
        self._routed(seqs, used)
        tokens = self._sample(seqs, out.logits[:, -1])
        fires = self._tool_fires(seqs, group.gate, None if hidden is None else hidden[:, -1])
        events: list[TokenEvent | ToolFire] = []
        keep: list[int] = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if fires[i] is not None:
                first = int(group.mask[i].nonzero()[0])  # its left padding stays behind
                # Copies: a view would keep the whole group's cache of this step alive while parked.
                self._parked[seq.req.key] = _Parked(
                    seq, group.gate, keys=[k[i:i + 1, :, first:].clone() for k in group.keys],
                    values=[v[i:i + 1, :, first:].clone() for v in group.values],
                    acc=group.acc[i].clone(), held=token)
                del self._where[seq.req.key]
                events.append(fires[i])
                continue
            finish = self._append(seq, token)
            if finish is None:
                events.append(TokenEvent(seq.req.key, token, logprob=_last_logprob(seq)))
                keep.append(i)
            else:
                events.append(TokenEvent(seq.req.key, token,
                                         self._generation(seq, finish, group.acc[i]),
                                         logprob=_last_logprob(seq)))
                del self._where[seq.req.key]
        if len(keep) < n:
            self._keep_rows(group, keep)
        return events

    def _forward(self, seqs: Sequence[_Seq], **inputs: Any) -> tuple[Any, torch.Tensor | None]:
        """The model's output, and the hidden state its LM head read when a sequence here may
        still call a tool (else None: no hook)."""
        if not self._may_call_tool(seqs):
            return self.lm.model(**inputs), None
        return final_hidden(self.lm.model, **inputs)

    def _may_call_tool(self, seqs: Sequence[_Seq]) -> bool:
        """Whether a sequence here may still call a tool (so its tool gate is read)."""
        return self.lm.tool_head is not None and self.tool_select is not None and any(
            s.tool_calls < s.req.max_tool_calls for s in seqs)

    def _tool_fires(self, seqs: Sequence[_Seq], gate: ActiveGate,
                    hidden: torch.Tensor | None) -> list[ToolFire | None]:
        """Per sequence, the call its tool gate makes at its last position ([N, hidden] states
        there): above the gate's toolGateThreshold, within its call budget, and only when its
        text selects a tool."""
        fires: list[ToolFire | None] = [None] * len(seqs)
        if hidden is None:
            return fires
        assert self.lm.tool_head is not None and self.tool_select is not None
        probs = self.lm.tool_head.probs(hidden).tolist()
        for i, (seq, prob) in enumerate(zip(seqs, probs)):
            if prob > gate.params.tool_gate_threshold and seq.tool_calls < seq.req.max_tool_calls:
                chosen = self.tool_select(seq.ids)
                if chosen is not None:
                    seq.tool_calls += 1
                    fires[i] = ToolFire(seq.req.key, *chosen, position=len(seq.ids) - 1,
                                        gate_probability=prob, gate_version=gate.version)
        return fires

    def _resume(self, key: Hashable, forced: list[int] | None) -> list[TokenEvent | ToolFire]:
        """Bring a parked sequence back (no-op when it left meanwhile): ``forced`` fed on its
        cache and appended, the token after them sampled (it may fire again); None keeps the
        token held back. Then it rejoins its version's group, or ends."""
        parked = self._parked.pop(key, None)
        if parked is None:
            return []
        seq, acc = parked.seq, parked.acc
        keys, values, token = parked.keys, parked.values, parked.held
        events: list[TokenEvent | ToolFire] = []
        if forced:
            room = seq.req.max_tokens - len(seq.generated)
            made = time.perf_counter()  # one output, as vLLM's several tokens of one step
            for t in forced[:room]:
                seq.generated.append(t)
                if seq.req.sampling.logprobs is not None:
                    seq.logprobs.append(None)  # forced, not chosen by the model
                events.append(TokenEvent(key, t, made=made))
            # The forced text reached max_tokens, or holds a stop string: it ends there (a stop
            # string found only at the next sampled token had been streamed by then).
            finish = seq.stops.check(seq.generated, forced=True)
            if finish is not None:
                last = events.pop()
                return [*events, TokenEvent(key, last.token, self._generation(seq, finish, acc),
                                            made=made)]
            from transformers import DynamicCache

            cache = DynamicCache(ddp_cache_data=list(zip(keys, values)))
            start = len(seq.ids) - len(forced)
            positions = torch.arange(start, start + len(forced), device=self.device)[None]
            with torch.inference_mode(), pin_gate(parked.gate, allowed=seq.allowed) as call:
                # Logits (and the hidden state the head reads) at the last position only.
                out, hidden = self._forward([seq], input_ids=torch.tensor([forced], device=self.device),
                                            position_ids=positions, cache=cache, use_cache=True,
                                            logits_to_keep=1)
            self._measure(call)
            used = self._usage_alone(call)
            self._routed([seq], used)
            acc = acc + used[0]
            keys = [layer.keys for layer in out.cache.layers]
            values = [layer.values for layer in out.cache.layers]
            token = self._sample([seq], out.logits[:, -1])[0]
            fire = self._tool_fires([seq], parked.gate, None if hidden is None else hidden[:, -1])[0]
            if fire is not None:
                self._parked[key] = _Parked(seq, parked.gate, keys, values, acc, held=token)
                return [*events, fire]
        finish = self._append(seq, token)
        if finish is not None:
            return [*events, TokenEvent(key, token, self._generation(seq, finish, acc),
                                        logprob=_last_logprob(seq))]
        events.append(TokenEvent(key, token, logprob=_last_logprob(seq)))
        self._join(parked.gate, [_Joiner(seq, keys=keys, values=values, acc=acc,
                                         mask=torch.ones(1, keys[0].shape[2], dtype=torch.long,
                                                         device=self.device))])
        return events

    def allowed_mask(self, experts: Sequence[int] | None) -> torch.Tensor | None:
        """[E] bool of a request's expert group (None: every expert); ValueError naming
        ``allowed_experts`` for an empty group or an index this model does not have."""
        if experts is None:
            return None
        n = self.hf.num_experts
        if not experts or any(isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < n for e in experts):
            raise ValueError(f"allowed_experts must be a non-empty list of expert indices below {n}, "
                             f"got {list(experts)}")
        allowed = torch.zeros(n, dtype=torch.bool, device=self.device)
        allowed[list(experts)] = True
        return allowed

    def _routed(self, seqs: Sequence[_Seq], usage: torch.Tensor) -> None:
        if self.on_routed is not None:
            self.on_routed([s.req.key for s in seqs], usage[:, :, :self.hf.num_experts])

    def _measure(self, call: GateCall) -> None:
        """Count the selected assignments and routed tokens of a forward under a controlled
        gate (targetExpertsPerToken), toward its controller's next update. A forward with a
        token scoped to an expert group is not counted: a group smaller than the target could
        never reach it, and the loop would push every request of the version to its threshold
        bound."""
        controller = call.gate.controller
        if controller is None or call.allowed is not None:
            return
        entry = self._measured.setdefault(id(controller), [call.gate, 0.0, 0])
        for st in call.layers:
            entry[1] += st.mean_selected * st.num_tokens
            entry[2] += st.num_tokens

    def _feed_controllers(self) -> None:
        """Feed each controlled gate that has routed at least `CONTROL_FEED_TOKENS` tokens since
        its last feed their mean selected experts per token, so the next job routes with the
        updated threshold. Token-weighted over a window rather than once per forward: a decode
        step of one sequence routes one token, and per-forward feeding would weigh that token as
        much as a whole prefill (the loop would then hold generated tokens at the target and let
        prompt tokens drift), besides following single-token noise."""
        for key, (gate, selected, tokens) in list(self._measured.items()):
            if tokens >= CONTROL_FEED_TOKENS:
                del self._measured[key]
                threshold = gate.controller.update(selected / tokens)
                if self.on_threshold is not None:
                    self.on_threshold(gate.version, threshold)

    def _sample(self, seqs: Sequence[_Seq], logits: torch.Tensor) -> list[int]:
        """Next token per row: greedy at temperature 0, else softmax sampling (narrowed by its
        top_k / top_p) with the sequence's own seeded generator: the same draws as the solo
        path (`hf_serving.next_token`), which also keeps a row under its min_tokens off its
        stop tokens and applies its logit_bias and penalties (to that row only)."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            sampling = seq.req.sampling
            banned = sampling.banned(self.hf.eos_ids, len(seq.generated))
            if seq.req.temperature > 0 or banned or sampling.adjusts:
                tokens[i] = next_token(logits[i], temperature=seq.req.temperature,
                                       sampling=sampling, generator=seq.generator,
                                       banned=banned, prompt=seq.req.prompt_ids,
                                       generated=seq.generated)
            if seq.req.sampling.logprobs is not None:
                seq.pending_logprob = token_logprob(logits[i], tokens[i], seq.req.sampling.logprobs)
        return tokens

    def _append(self, seq: _Seq, token: int) -> str | None:
        """Record ``token``; the finish reason when it ends the sequence (`StopCheck`: a stop
        string is found in the decoded text here, so the sequence leaves at this very step)."""
        seq.generated.append(token)
        if seq.req.sampling.logprobs is not None:
            seq.logprobs.append(seq.pending_logprob)
        return seq.stops.check(seq.generated)

    def _generation(self, seq: _Seq, finish: str, acc: torch.Tensor) -> Generation:
        """The finished sequence's result; ``acc`` is its usage [blocks, experts + 4]."""
        rows: list[list[float]] = acc.tolist()
        n_experts = self.hf.num_experts
        counts = [[int(c) for c in row[:n_experts]] for row in rows]
        kept = sum(map(sum, counts))
        tokens = sum(row[_TOKENS] for row in rows)
        calls = sum(row[_CALLS] for row in rows)
        return Generation(
            prompt_tokens=len(seq.req.prompt_ids), token_ids=list(seq.generated),
            finish_reason=finish, gate_version=seq.gate_version, expert_counts=counts,
            mean_experts_per_token=kept / tokens if tokens else 0.0,
            dropped_assignments=int(sum(row[_SELECTED] for row in rows)) - kept,
            gate_entropy=sum(row[_ENTROPY] for row in rows) / calls if calls else 0.0,
            stop_reason=seq.stops.stop_reason if finish == "stop" else None,
            text_end=seq.stops.text_end if finish == "stop" else None,
            keeps_stop=seq.req.sampling.include_stop_str,
            logprobs=tuple(seq.logprobs) if seq.req.sampling.logprobs is not None else None,
            prompt_logprobs=seq.prompt_logprobs)

    def _usage_alone(self, call: GateCall) -> torch.Tensor:
        """[1, blocks, experts + 4] usage of a forward that routed one sequence's tokens alone
        (its prefill, or a step of one): the block stats are its own."""
        rows = [[*st.counts, sum(st.counts) + st.dropped, st.entropy, st.num_tokens, 1]
                for st in call.layers]
        return torch.tensor([rows], dtype=torch.float64, device=self.device)

    def _usage_rows(self, call: GateCall, *, owner: torch.Tensor, n: int) -> torch.Tensor:
        """[n, blocks, experts + 4] usage of a forward whose token t belongs to sequence
        ``owner[t]``, split as if each had been routed alone (counts, kept and dropped
        assignments, one entropy per call: the mean over its tokens). No host sync."""
        routings = call.routings
        assert routings is not None
        n_experts, n_blocks, dev = self.hf.num_experts, len(routings), self.device
        # All blocks at once: assignment a is (block, expert) slot b*E + e of sequence owner[t].
        slot_of = torch.arange(n_blocks * n_experts, device=dev).repeat_interleave(
            torch.tensor([c for r in routings for c in r.counts], device=dev))
        seq_of = owner[torch.cat([r.token_idx for r in routings])]
        counts = torch.bincount(seq_of * (n_blocks * n_experts) + slot_of,
                                minlength=n * n_blocks * n_experts).view(n, n_blocks, n_experts)
        probs = torch.stack([r.probs for r in routings])                    # [blocks, T, E]
        entropy = -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)       # [blocks, T]
        selected = torch.stack([r.selected for r in routings]).double()    # [blocks, T]
        per_seq = torch.zeros(2, n_blocks, n, dtype=torch.float64, device=dev).index_add_(
            2, owner, torch.stack([selected, entropy.double()]))
        tokens = torch.bincount(owner, minlength=n).double()
        return torch.cat([counts.double(), per_seq[0].T.unsqueeze(2),
                          (per_seq[1] / tokens).T.unsqueeze(2),
                          tokens.view(n, 1, 1).expand(n, n_blocks, 1),
                          torch.ones(n, n_blocks, 1, dtype=torch.float64, device=dev)], dim=2)

    def _join(self, gate: ActiveGate, joiners: Sequence[_Joiner]) -> None:
        """Add prefilled sequences to ``gate``'s group: every cache left-padded to the widest,
        concatenated once per layer."""
        if not joiners:
            return
        version = gate.version
        group = self._groups.get(version)
        parts = ([] if group is None else
                 [(group.keys, group.values, group.mask)]) + [
            (j.keys, j.values, j.mask) for j in joiners]
        width = max(mask.shape[1] for _, _, mask in parts)
        n_layers = len(parts[0][0])
        keys = [torch.cat([_left_pad(k[i], width) for k, _, _ in parts]) for i in range(n_layers)]
        values = [torch.cat([_left_pad(v[i], width) for _, v, _ in parts])
                  for i in range(n_layers)]
        mask = torch.cat([_left_pad_mask(m, width) for _, _, m in parts])
        acc = torch.stack([j.acc for j in joiners])
        seqs = [j.seq for j in joiners]
        if group is None:
            group = self._groups[version] = _Group(gate=gate, seqs=seqs, keys=keys,
                                                   values=values, mask=mask, acc=acc)
        else:
            acc = torch.cat([group.acc, acc])  # allocated before the group changes at all
            group.acc = acc
            group.mask = mask
            group.set_cache(keys, values)
            group.seqs.extend(seqs)
            group.set_allowed()
        for seq in seqs:
            self._where[seq.req.key] = group

    def _keep_rows(self, group: _Group, keep: list[int]) -> None:
        version = group.gate.version
        if not keep:
            del self._groups[version]
            return
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = group.mask.index_select(0, index)
        # Columns no remaining row uses (the left padding of sequences that left) go too.
        first = int(mask.any(dim=0).nonzero()[0])
        group.mask = mask[:, first:]
        group.acc = group.acc.index_select(0, index)
        group.set_cache([k.index_select(0, index)[:, :, first:] for k in group.keys],
                        [v.index_select(0, index)[:, :, first:] for v in group.values])
        group.seqs = [group.seqs[i] for i in keep]
        group.set_allowed()


def _last_logprob(seq: _Seq) -> TokenLogprob | None:
    """The `TokenLogprob` of the token ``seq`` just appended (None without logprobs)."""
    return seq.logprobs[-1] if seq.req.sampling.logprobs is not None else None


def _allowed_rows(seqs: Sequence[_Seq]) -> torch.Tensor | None:
    """[N, E] bool: each sequence's allowed experts (all True for an unscoped one); None when no
    sequence is scoped, so unscoped batches route without a mask."""
    scoped = next((s.allowed for s in seqs if s.allowed is not None), None)
    if scoped is None:
        return None
    everything = torch.ones_like(scoped)
    return torch.stack([everything if s.allowed is None else s.allowed for s in seqs])


def _uses_sliding_window(config: Any) -> bool:
    """Whether some attention layer of the model may slide its window: ``sliding_window`` set,
    except Qwen2-MoE's 0 (what its config holds when ``use_sliding_window`` is off, as in every
    released Qwen2-MoE checkpoint) with no sliding layer in ``layer_types``."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return False
    types = getattr(config, "layer_types", None)
    if window == 0 and types is not None:
        return "sliding_attention" in types
    return True


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, H, width, D], zeros on the left of the sequence axis."""
    missing = width - t.shape[2]
    if missing == 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], t.shape[1], missing, t.shape[3]), t], dim=2)


def _left_pad_mask(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros(mask.shape[0], missing), mask], dim=1)
