"""Batched decoding of a Hugging Face MoE checkpoint with a per-sequence KV cache: the model
side of continuous batching (`batch_engine` schedules it from the event loop).

Every call here runs on the server's one model thread. A sequence joins with a prefill of its
prompt alone (batch of one, so no padding token ever reaches the MoE routing or its capacity),
which gives its first token and its KV cache. It then decodes in a *group*: the sequences that
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
from typing import Any, Hashable, Sequence

import torch

from .hf.gated_block import ActiveGate, GateCall, pin_gate
from .hf_serving import Generation, HFServedModel


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


@dataclasses.dataclass
class _Group:
    """The sequences decoding under one gate version, with their left-padded KV cache."""

    gate: ActiveGate
    seqs: list[_Seq]
    keys: list[torch.Tensor]     # per layer [N, heads, L, head_dim]
    values: list[torch.Tensor]
    mask: torch.Tensor           # [N, L] long: 1 where a cached position is real


class BatchDecoder:
    """Continuous-batching decoder over one loaded checkpoint (model thread only)."""

    def __init__(self, hf: HFServedModel) -> None:
        self.hf = hf
        self.lm = hf.lm
        self.device = next(self.lm.model.parameters()).device
        self._groups: dict[str | None, _Group] = {}
        self._where: dict[Hashable, _Group] = {}

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
        events = [self.add(req) for req in admit]
        events += self.step()
        return events

    def reset(self) -> None:
        """Forget every sequence (after a failed job: their caches may be half-updated)."""
        self._groups.clear()
        self._where.clear()

    def add(self, req: DecodeRequest) -> TokenEvent:
        """Prefill ``req`` alone; its first token, and its generation if that ended it."""
        if req.key in self._where:
            raise ValueError(f"sequence {req.key!r} is already decoding")
        seq = _Seq(req, n_layers=self.hf.n_layers, num_experts=self.hf.num_experts)
        ids = torch.tensor([list(req.prompt_ids)], dtype=torch.long, device=self.device)
        with torch.inference_mode(), pin_gate(self.lm.gate) as call:
            out = self.lm.model(input_ids=ids, use_cache=True)
        seq.gate_version = call.gate.version
        self._account_prefill(seq, call)
        token = self._sample([seq], out.logits[:, -1])[0]
        done = self._append(seq, token)
        if done is not None:
            return TokenEvent(req.key, token, done)
        cache = out.cache
        keys = [layer.keys for layer in cache.layers]
        values = [layer.values for layer in cache.layers]
        mask = torch.ones(1, ids.shape[1], dtype=torch.long, device=self.device)
        self._join(call.gate, seq, keys, values, mask)
        return TokenEvent(req.key, token)

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
        from transformers import DynamicCache

        seqs = group.seqs
        n = len(seqs)
        last = torch.tensor([[s.generated[-1]] for s in seqs], dtype=torch.long,
                            device=self.device)
        positions = torch.tensor([[s.next_position] for s in seqs], dtype=torch.long,
                                 device=self.device)
        mask = torch.cat([group.mask, group.mask.new_ones(n, 1)], dim=1)
        cache = DynamicCache(ddp_cache_data=list(zip(group.keys, group.values)))
        with torch.inference_mode(), pin_gate(group.gate, keep_routing=True) as call:
            out = self.lm.model(input_ids=last, attention_mask=mask, position_ids=positions,
                                cache=cache, use_cache=True)
        group.keys = [layer.keys for layer in out.cache.layers]
        group.values = [layer.values for layer in out.cache.layers]
        group.mask = mask
        self._account_step(seqs, call)
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

    def _account_prefill(self, seq: _Seq, call: GateCall) -> None:
        n_blocks = self.hf.n_layers
        for i, st in enumerate(call.layers):
            row = seq.counts[i % n_blocks]
            for e, c in enumerate(st.counts):
                row[e] += c
            seq.pairs += st.num_tokens
            seq.kept += sum(st.counts)
            seq.dropped += st.dropped
            seq.entropies.append(st.entropy)

    def _account_step(self, seqs: Sequence[_Seq], call: GateCall) -> None:
        """Split one step's routing (row i = sequence i, one token each) per sequence, with
        one host transfer for all layers."""
        assert call.routings is not None
        n, n_experts = len(seqs), self.hf.num_experts
        experts = torch.arange(n_experts, device=self.device)
        per_layer = []
        for r in call.routings:
            expert_of = experts.repeat_interleave(
                torch.tensor(r.counts, device=self.device))
            counts = torch.bincount(r.token_idx * n_experts + expert_of,
                                    minlength=n * n_experts).view(n, n_experts)
            probs = r.probs
            entropy = -(probs * probs.clamp_min(1e-12).log()).sum(dim=-1)
            per_layer.append(torch.cat([counts.double(), r.selected.double().unsqueeze(1),
                                        entropy.double().unsqueeze(1)], dim=1))
        table: list[Any] = torch.stack(per_layer).tolist()  # [layers, n, E + 2]
        n_blocks = self.hf.n_layers
        for layer, rows in enumerate(table):
            for seq, row in zip(seqs, rows):
                counts = [int(c) for c in row[:n_experts]]
                kept = sum(counts)
                target = seq.counts[layer % n_blocks]
                for e, c in enumerate(counts):
                    target[e] += c
                seq.pairs += 1
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
            group.keys = [torch.cat([_left_pad(a, width), _left_pad(b, width)])
                          for a, b in zip(group.keys, keys)]
            group.values = [torch.cat([_left_pad(a, width), _left_pad(b, width)])
                            for a, b in zip(group.values, values)]
            group.mask = torch.cat([_left_pad_mask(group.mask, width),
                                    _left_pad_mask(mask, width)])
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
        group.keys = [k.index_select(0, index)[:, :, first:] for k in group.keys]
        group.values = [v.index_select(0, index)[:, :, first:] for v in group.values]
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
