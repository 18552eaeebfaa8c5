"""Batched decoding of a Hugging Face MoE checkpoint with a per-sequence KV cache: the model
side of continuous batching (`batch_engine` schedules it from the event loop).

Every call here runs on the server's one model thread. Sequences join with a prefill of their
prompts packed end to end in one row (positions restarting per prompt, a block-diagonal causal
mask; up to `MAX_PREFILL_TOKENS` per forward, so no padding token ever reaches the MoE routing;
a checkpoint with a sliding attention window prefills each prompt alone, since the packing mask
would ignore the window), which gives each its first token and its KV cache. It then decodes in a *group*: the sequences that
run under the same gate version, decoded together one token per model step. A group holds each
layer's keys/values as one left-padded tensor [N, heads, L, head_dim] plus a 0/1 mask [N, L];
a step feeds each sequence's last token at its own position (``position_ids``) with the mask
extended by one column, exactly what ``transformers``' own ``generate()`` does with a
left-padded batch. A joining sequence's cache is left-padded to the group's length (or the
group's to its); a leaving sequence's row is dropped and columns no row uses any more are
trimmed, so sequences join and leave between any two steps.

Gate versions: a sequence is prefilled under the gate in force then (`SparseGatedCausalLM.gate`)
and stays in that version's group until it ends, and every step runs under one group's pinned
gate (`pin_gate`), so a step never mixes versions and a gate swap between steps never changes
the routing of a sequence already started. Groups are keyed by gate version, so two versions
can decode side by side while the old one drains.

Batched equals solo: greedy decoding (or sampling seeded per request) gives the same tokens as
`HFServedModel.generate` for the request alone, up to float rounding of the batched matmuls,
as long as the gate's capacity cap drops nothing: a capacity factor caps an expert's tokens per
*step*, and a step holds every sequence of the group, so under a binding cap sequences compete
(as in any capacity-capped MoE batch). Usage is split per sequence from each step's routing
(`GateCall.routings`): expert counts, kept and dropped assignments and per-call entropy, as the
solo path reports them.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Hashable, Sequence

import torch

from .hf.gated_block import ActiveGate, GateCall, pin_gate
from .hf_serving import Generation, HFServedModel

# Most prompt tokens one packed prefill forward holds (its attention mask is T x T booleans).
MAX_PREFILL_TOKENS = 2048


@dataclasses.dataclass(frozen=True)
class DecodeRequest:
    """What to generate for one request; ``key`` names it in events and removals."""

    key: Hashable
    prompt_ids: Sequence[int]
    max_tokens: int
    temperature: float = 0.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class TokenEvent:
    """A token made for ``key``; ``generation`` is set on its last token."""

    key: Hashable
    token: int
    generation: Generation | None = None


class _Seq:
    """One sequence's decoding state and usage accumulators (model thread only)."""

    def __init__(self, req: DecodeRequest, *, n_layers: int, num_experts: int) -> None:
        self.req = req
        self.generator = torch.Generator().manual_seed(req.seed)
        self.generated: list[int] = []
        self.counts = [[0] * num_experts for _ in range(n_layers)]
        self.pairs = 0           # (token, MoE layer) pairs routed
        self.kept = 0            # kept assignments over them
        self.dropped = 0
        self.entropies: list[float] = []  # one per block call, as the solo path averages them
        self.gate_version: str | None = None

    @property
    def next_position(self) -> int:
        """Position id of the last generated token (the one the next step feeds)."""
        return len(self.req.prompt_ids) + len(self.generated) - 1


class _Group:
    """The sequences decoding under one gate version, with their left-padded KV cache: one
    ``DynamicCache`` kept across steps (rebuilt only when a sequence joins or leaves)."""

    def __init__(self, gate: ActiveGate, seqs: list[_Seq], keys: list[torch.Tensor],
                 values: list[torch.Tensor], mask: torch.Tensor) -> None:
        self.gate = gate
        self.seqs = seqs
        self.mask = mask          # [N, L] long: 1 where a cached position is real
        self.padded = False       # some row has padding (else no mask is passed: cheaper)
        self.set_cache(keys, values)

    def set_cache(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        """Per layer [N, heads, L, head_dim] keys and values."""
        from transformers import DynamicCache

        self.cache = DynamicCache(ddp_cache_data=list(zip(keys, values)))
        self.padded = not bool(self.mask.all())

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
        self._packable = getattr(self.lm.model.config, "sliding_window", None) is None

    @property
    def running(self) -> int:
        return len(self._where)

    def group_sizes(self) -> dict[str | None, int]:
        """Sequences decoding per gate version now."""
        return {v: len(g.seqs) for v, g in self._groups.items()}

    def run(self, admit: Sequence[DecodeRequest], leave: Sequence[Hashable]) -> list[TokenEvent]:
        """One engine job: drop ``leave``, prefill ``admit`` (each alone, under the gate in force
        now), then one decode step per gate group. Returns the tokens made, in order."""
        for key in leave:
            self.remove(key)
        events = self.add_many(admit)
        events += self.step()
        return events

    def reset(self) -> None:
        """Forget every sequence (after a failed job: their caches may be half-updated)."""
        self._groups.clear()
        self._where.clear()

    def add(self, req: DecodeRequest) -> TokenEvent:
        """Prefill ``req`` alone; its first token, and its generation if that ended it."""
        return self.add_many([req])[0]

    def add_many(self, reqs: Sequence[DecodeRequest]) -> list[TokenEvent]:
        """Prefill ``reqs`` under the gate in force, packed into as few forwards as
        `MAX_PREFILL_TOKENS` allows; each one's first token (and generation if that ended it)."""
        keys = [r.key for r in reqs]
        if len(set(keys)) < len(keys) or any(k in self._where for k in keys):
            raise ValueError(f"a sequence of {keys!r} is already decoding")
        events: list[TokenEvent] = []
        pack: list[DecodeRequest] = []
        for req in reqs:
            if pack and (sum(len(r.prompt_ids) for r in pack) + len(req.prompt_ids)
                         > MAX_PREFILL_TOKENS or not self._packable):
                events += self._prefill(pack)
                pack = []
            pack.append(req)
        if pack:
            events += self._prefill(pack)
        return events

    def _prefill(self, reqs: Sequence[DecodeRequest]) -> list[TokenEvent]:
        """One forward over the prompts of ``reqs`` packed end to end in one row (no padding
        reaches the MoE routing): positions restart at 0 for each prompt and a block-diagonal
        causal mask keeps each prompt to itself. Then each joins its gate version's group."""
        seqs = [_Seq(r, n_layers=self.hf.n_layers, num_experts=self.hf.num_experts)
                for r in reqs]
        lengths = [len(r.prompt_ids) for r in reqs]
        ids = torch.tensor([[t for r in reqs for t in r.prompt_ids]], dtype=torch.long,
                           device=self.device)
        owner = torch.repeat_interleave(torch.arange(len(reqs), device=self.device),
                                        torch.tensor(lengths, device=self.device))
        kwargs: dict[str, Any] = {}
        if len(reqs) > 1:
            starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1],
                                  device=self.device)
            positions = torch.arange(ids.shape[1], device=self.device) - starts[owner]
            same = owner.unsqueeze(1) == owner.unsqueeze(0)
            causal = positions.unsqueeze(1) >= positions.unsqueeze(0)
            kwargs = {"position_ids": positions.unsqueeze(0),
                      "attention_mask": (same & causal)[None, None]}  # [1, 1, T, T], True: attend
        with torch.inference_mode(), pin_gate(self.lm.gate, keep_routing=len(reqs) > 1) as call:
            out = self.lm.model(input_ids=ids, use_cache=True, **kwargs)
        if len(reqs) > 1:
            self._account_rows(seqs, call, owner=owner)
        else:
            self._account_calls(seqs[0], call)
        ends = list(itertools.accumulate(lengths))
        last = out.logits[0, [e - 1 for e in ends]]
        tokens = self._sample(seqs, last)
        layers = out.cache.layers
        events = []
        for seq, token, end, length in zip(seqs, tokens, ends, lengths):
            seq.gate_version = call.gate.version
            done = self._append(seq, token)
            events.append(TokenEvent(seq.req.key, token, done))
            if done is not None:
                continue
            cols = slice(end - length, end)
            self._join(call.gate, seq, [layer.keys[:, :, cols] for layer in layers],
                       [layer.values[:, :, cols] for layer in layers],
                       torch.ones(1, length, dtype=torch.long, device=self.device))
        return events

    def remove(self, key: Hashable) -> bool:
        """Drop ``key``'s sequence (no-op when it is not decoding); True if it was."""
        group = self._where.pop(key, None)
        if group is None:
            return False
        keep = [i for i, s in enumerate(group.seqs) if s.req.key != key]
        self._keep_rows(group, keep)
        return True

    def step(self) -> list[TokenEvent]:
        """One token for every decoding sequence: one model forward per gate group."""
        events: list[TokenEvent] = []
        for version in list(self._groups):
            events += self._step_group(self._groups[version])
        return events

    # -- internals -------------------------------------------------------------------------

    def _step_group(self, group: _Group) -> list[TokenEvent]:
        seqs = group.seqs
        n = len(seqs)
        last = torch.tensor([[s.generated[-1]] for s in seqs], dtype=torch.long,
                            device=self.device)
        positions = torch.tensor([[s.next_position] for s in seqs], dtype=torch.long,
                                 device=self.device)
        mask = torch.cat([group.mask, group.mask.new_ones(n, 1)], dim=1)
        # One row needs no split of its routing: the block stats are its own.
        with torch.inference_mode(), pin_gate(group.gate, keep_routing=n > 1) as call:
            out = self.lm.model(input_ids=last, attention_mask=mask if group.padded else None,
                                position_ids=positions, cache=group.cache, use_cache=True)
        group.mask = mask  # the cache grew by one column in place
        if n > 1:
            self._account_rows(seqs, call, owner=torch.arange(n, device=self.device))
        else:
            self._account_calls(seqs[0], call)
        tokens = self._sample(seqs, out.logits[:, -1])
        events, keep = [], []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            done = self._append(seq, token)
            events.append(TokenEvent(seq.req.key, token, done))
            if done is None:
                keep.append(i)
            else:
                del self._where[seq.req.key]
        if len(keep) < n:
            self._keep_rows(group, keep)
        return events

    def _sample(self, seqs: Sequence[_Seq], logits: torch.Tensor) -> list[int]:
        """Next token per row: greedy at temperature 0, else softmax sampling with the
        sequence's own seeded generator (the same draws as the solo path)."""
        logits = logits.float()
        tokens = logits.argmax(dim=-1).tolist()
        for i, seq in enumerate(seqs):
            t = seq.req.temperature
            if t > 0:
                probs = torch.softmax(logits[i].cpu() / t, dim=-1)
                tokens[i] = int(torch.multinomial(probs, 1, generator=seq.generator))
        return tokens

    def _append(self, seq: _Seq, token: int) -> Generation | None:
        seq.generated.append(token)
        if token in self.hf.eos_ids:
            return self._generation(seq, "stop")
        if len(seq.generated) >= seq.req.max_tokens:
            return self._generation(seq, "length")
        return None

    def _generation(self, seq: _Seq, finish: str) -> Generation:
        return Generation(
            prompt_tokens=len(seq.req.prompt_ids), token_ids=list(seq.generated),
            finish_reason=finish, gate_version=seq.gate_version, expert_counts=seq.counts,
            mean_experts_per_token=seq.kept / seq.pairs if seq.pairs else 0.0,
            dropped_assignments=seq.dropped,
            gate_entropy=sum(seq.entropies) / len(seq.entropies) if seq.entropies else 0.0)

    def _account_calls(self, seq: _Seq, call: GateCall) -> None:
        """Add block calls that routed ``seq``'s tokens alone (its prefill, or a step of one)."""
        n_blocks = self.hf.n_layers
        for i, st in enumerate(call.layers):
            row = seq.counts[i % n_blocks]
            for e, c in enumerate(st.counts):
                row[e] += c
            seq.pairs += st.num_tokens
            seq.kept += sum(st.counts)
            seq.dropped += st.dropped
            seq.entropies.append(st.entropy)

    def _account_rows(self, seqs: Sequence[_Seq], call: GateCall, *,
                      owner: torch.Tensor) -> None:
        """Split block calls that routed several sequences' tokens (token t belongs to
        ``seqs[owner[t]]``) per sequence, as if each had been routed alone: expert counts, kept
        and dropped assignments, and one entropy per call (the mean over its tokens). One host
        transfer for all layers."""
        assert call.routings is not None
        n, n_experts = len(seqs), self.hf.num_experts
        experts = torch.arange(n_experts, device=self.device)
        tokens = torch.bincount(owner, minlength=n).double()
        per_layer = []
        for r in call.routings:
            expert_of = experts.repeat_interleave(torch.tensor(r.counts, device=self.device))
            counts = torch.bincount(owner[r.token_idx] * n_experts + expert_of,
                                    minlength=n * n_experts).view(n, n_experts)
            probs = r.probs
            entropy = -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)
            selected = torch.zeros(n, dtype=torch.float64, device=self.device).index_add_(
                0, owner, r.selected.double())
            mean_entropy = torch.zeros(n, dtype=torch.float64, device=self.device).index_add_(
                0, owner, entropy.double()) / tokens
            per_layer.append(torch.cat([counts.double(), selected.unsqueeze(1),
                                        mean_entropy.unsqueeze(1), tokens.unsqueeze(1)], dim=1))
        table: list[Any] = torch.stack(per_layer).tolist()  # [layers, n, E + 3]
        n_blocks = self.hf.n_layers
        for layer, rows in enumerate(table):
            for seq, row in zip(seqs, rows):
                counts = [int(c) for c in row[:n_experts]]
                kept = sum(counts)
                target = seq.counts[layer % n_blocks]
                for e, c in enumerate(counts):
                    target[e] += c
                seq.pairs += int(row[n_experts + 2])
                seq.kept += kept
                seq.dropped += int(row[n_experts]) - kept
                seq.entropies.append(row[n_experts + 1])

    def _join(self, gate: ActiveGate, seq: _Seq, keys: list[torch.Tensor],
              values: list[torch.Tensor], mask: torch.Tensor) -> None:
        version = gate.version
        group = self._groups.get(version)
        if group is None:
            self._groups[version] = _Group(gate=gate, seqs=[seq], keys=keys, values=values,
                                           mask=mask)
        else:
            have, new = group.mask.shape[1], mask.shape[1]
            width = max(have, new)
            group.mask = torch.cat([_left_pad_mask(group.mask, width),
                                    _left_pad_mask(mask, width)])
            group.set_cache([torch.cat([_left_pad(a, width), _left_pad(b, width)])
                             for a, b in zip(group.keys, keys)],
                            [torch.cat([_left_pad(a, width), _left_pad(b, width)])
                             for a, b in zip(group.values, values)])
            group.seqs.append(seq)
        self._where[seq.req.key] = self._groups[version]

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
        group.set_cache([k.index_select(0, index)[:, :, first:] for k in group.keys],
                        [v.index_select(0, index)[:, :, first:] for v in group.values])
        group.seqs = [group.seqs[i] for i in keep]


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
