"""A Hugging Face MoE checkpoint as the server runs it: token-id batches (``/v1/infer``) and
text generation (the OpenAI API), both pinned to one gate version per request.

Pure torch + the `hf` loader (no web framework), so the server stays a thin adapter. Every call
here runs on the server's single model thread; `set_gate` too, so a gate swap (which may
re-store weights) never overlaps a forward.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from sparsegate_contracts.gate import GateDocument

from . import cgroup_limits
from .devices import check_model_dtype
from .gating import tool_fires
from .inference import InferenceResult
from .moe import MoEStats
from .quality import score_hidden_rows
from .threshold_control import ThresholdController

log = logging.getLogger("sparsegate.workload")

if TYPE_CHECKING:  # the hf package loads transformers: only when a checkpoint is loaded
    from .hf.gated_block import ActiveGate


@dataclasses.dataclass(frozen=True)
class Generation:
    """One completion: what was generated and how the experts were used doing it."""

    prompt_tokens: int
    token_ids: list[int]               # generated ids (the stop token included when it ended it)
    # "stop" (an end-of-sequence token, a stop token id or a stop string) or "length" (max_tokens)
    finish_reason: str
    gate_version: str | None
    expert_counts: list[list[int]]     # [layer][expert] tokens processed, prompt + generated
    mean_experts_per_token: float      # kept assignments per (token, MoE layer), all tokens
    dropped_assignments: int
    gate_entropy: float                # mean over block calls (nats)
    first_token_s: float | None = None  # set by the caller that times it
    # vLLM's stop_reason: the stop string (str) or stop token id (int) that ended it; None for
    # an end-of-sequence token or max_tokens.
    stop_reason: str | int | None = None
    # With a stop string: where the answer's text ends, in characters of the generated tokens'
    # text (`decode`; the stop string starts there and is not part of the answer, or ends there
    # with `Sampling.include_stop_str`).
    text_end: int | None = None
    # vLLM's include_stop_str_in_output: the text keeps the stop token id's text too.
    keeps_stop: bool = False
    # With `Sampling.logprobs`: per generated token, its `TokenLogprob` (None for a token a
    # tool forced, which the model did not choose); else None.
    logprobs: tuple[TokenLogprob | None, ...] | None = None
    # With `Sampling.prompt_logprobs`: per prompt token, its `TokenLogprob` given the tokens
    # before it (None for the first, which has none); else None.
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def text(self, tokenizer: Any) -> str:
        """The answer's text: the generated tokens decoded (special tokens skipped), without a
        stop token id that ended them and cut before a stop string that did (with
        `keeps_stop`: with that token's text, cut after that string)."""
        ids = self.token_ids[:-1] if isinstance(self.stop_reason, int) and not self.keeps_stop else self.token_ids
        return decode(tokenizer, ids)[:self.text_end]


# A generated token's log probability under the model (its raw logits' log-softmax, before
# logit_bias, the penalties, temperature, top_k / top_p and min_tokens, as vLLM reports by
# default) and the ``n`` most probable (token id, log probability) pairs there, most probable
# first.
TokenLogprob = tuple[float, tuple[tuple[int, float], ...]]


def token_logprob(logits: torch.Tensor, token: int, n: int) -> TokenLogprob:
    """``token``'s `TokenLogprob` from the logits it was chosen from (one row)."""
    return logprob_rows(logits[None], [token], n)[0]


def logprob_rows(logits: torch.Tensor, targets: Sequence[int], n: int) -> list[TokenLogprob]:
    """The `TokenLogprob` of ``targets[i]`` from row i of ``logits`` [rows, vocab], all rows at once."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(targets), device=logprobs.device)[:, None])[:, 0].tolist()
    if not n:
        return [(c, ()) for c in chosen]
    top = logprobs.topk(min(n, logprobs.shape[1]), dim=-1)
    return [(c, tuple(zip(i, v))) for c, i, v in zip(chosen, top.indices.tolist(), top.values.tolist())]


def prompt_logprobs(logits_of: Callable[[slice], torch.Tensor], ids: Sequence[int], n: int,
                    *, chunk: int = 64) -> tuple[TokenLogprob | None, ...]:
    """Per prompt token, its `TokenLogprob` given the ones before it (None for the first).
    ``logits_of(rows)``: the logits [rows, vocab] at those prompt positions; asked ``chunk``
    positions at a time, so a long prompt never holds its whole [length, vocab] logits."""
    out: list[TokenLogprob | None] = [None]
    for start in range(0, len(ids) - 1, chunk):
        rows = slice(start, min(start + chunk, len(ids) - 1))
        out += logprob_rows(logits_of(rows), ids[rows.start + 1:rows.stop + 1], n)
    return tuple(out)


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Generated ids as text: what the OpenAI answers and the stop strings read. Special tokens
    skipped, and never ``clean_up_tokenization_spaces`` (a tokenizer config may turn it on): it
    drops a space before punctuation once the punctuation's token comes, so the text of the
    first k tokens would not start the text of k + 1, and a stream, which sends the former,
    would end unlike the whole answer (vLLM's detokenizer does not clean up either)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_BYTE_IDS: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def run_joining_ids(tokenizer: Any) -> frozenset[int]:
    """The ids after which `GrowingText` never ends a window: a byte-fallback tokenizer's byte
    tokens (``<0xNN>``, SentencePiece's and Llama's; byte-level BPE has none) and the special
    tokens, which `decode` skips, so the byte runs on either side of one read as one. Read once
    per tokenizer."""
    ids = _BYTE_IDS.get(tokenizer)
    if ids is None:
        ids = frozenset(i for t, i in tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))
        ids |= frozenset(tokenizer.all_special_ids)
        _BYTE_IDS[tokenizer] = ids
    return ids


class GrowingText:
    """`decode` of a token list that only grows, at the cost of decoding a few tokens per token
    added (vLLM's incremental detokenizer): decoding the whole list after every token made a
    generation's text cost quadratic in its length, on the server's event loop for a stream.

    Kept: ``text``, the decoding of ``ids[:read]``, and ``prefix``, the start of the window
    before ``read``. The text of the tokens past ``read`` is the window decoded from ``prefix``
    minus the window's text before ``read``: both start at the same token, so a tokenizer that
    drops the leading space of a first word (SentencePiece's metaspace) drops it from both.
    ``read`` moves only where the text ends on a whole character and not right after a byte
    token of a byte-fallback tokenizer or a special token (`run_joining_ids`): its decoder reads
    a run of byte tokens as one (all "\ufffd" when the run is not valid UTF-8), so no window
    may split one. Equal to `decode` of all ids whenever that does not end in an incomplete
    character (tested on byte-level BPE and metaspace tokenizers with byte fallback: multi-byte
    characters, arbitrary ids, special tokens); while one is incomplete both end in "\ufffd",
    which a stream holds back."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.hold = run_joining_ids(tokenizer)  # no window ends right after these
        self.ids: list[int] = []
        self.text = ""  # decode(ids[:read])
        self.prefix = 0
        self.read = 0
        self.pending = ""  # the text of ids[read:]

    def extend(self, ids: Sequence[int]) -> str:
        """Append ``ids``; the whole text so far (see the class for when it equals `decode`)."""
        if not ids:
            return self.text + self.pending
        self.ids.extend(ids)
        before = decode(self.tokenizer, self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        window = decode(self.tokenizer, self.ids[self.prefix:])
        if not window.startswith(before):  # never seen in tests; decoding it all is always right
            self.text, self.prefix, self.read = "", 0, 0
            before, window = "", decode(self.tokenizer, self.ids)
        self.pending = window[len(before):]
        if self.pending and not self.pending.endswith("\ufffd") and self.ids[-1] not in self.hold:
            self.text += self.pending
            self.pending = ""
            self.prefix, self.read = self.read, len(self.ids)
        return self.text + self.pending


@dataclasses.dataclass(frozen=True)
class Sampling:
    """vLLM's sampling and stop parameters beyond temperature and seed (defaults: off).

    ``top_k`` (0: off) then ``top_p`` narrow the distribution a token is sampled from (above
    temperature 0 only; greedy ignores them). A generation ends ("stop") at an end-of-sequence
    token unless ``ignore_eos``, at a token of ``stop_token_ids``, or once the text of its
    generated tokens holds a string of ``stop``. Before ``min_tokens`` tokens, the
    end-of-sequence (unless ignored) and stop token ids are never chosen (their logits are
    masked) and stop strings are not looked for, as vLLM does. ``logit_bias`` (token id, bias)
    and the penalties change the logits before any choice, greedy included (`adjust_logits`)."""

    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    min_tokens: int = 0
    # vLLM's include_stop_str_in_output: the answer ends after the stop string (and keeps a stop
    # token id's text) instead of before it.
    include_stop_str: bool = False
    # Report each generated token's log probability and this many most probable alternatives
    # (`TokenLogprob`, `Generation.logprobs`); None: none.
    logprobs: int | None = None
    # The same for each prompt token (`Generation.prompt_logprobs`); None: none.
    prompt_logprobs: int | None = None
    # OpenAI's presence and frequency penalties, vLLM's repetition_penalty (1: off) and OpenAI's
    # logit_bias as (token id, bias) pairs (`adjust_logits`).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def penalizes(self) -> bool:
        """Whether any penalty is on (they read the tokens so far, `adjust_logits`)."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    @property
    def adjusts(self) -> bool:
        """Whether `adjust_logits` changes anything."""
        return bool(self.logit_bias) or self.penalizes

    def banned(self, eos_ids: frozenset[int], generated: int) -> list[int]:
        """Token ids the next token may not be, with ``generated`` tokens made so far."""
        if generated >= self.min_tokens:
            return []
        return sorted(self.stop_token_ids | (frozenset() if self.ignore_eos else eos_ids))


OFF = Sampling()


class StopCheck:
    """One sequence's end conditions, checked after each token it makes (`check`)."""

    def __init__(self, sampling: Sampling, *, eos_ids: frozenset[int], max_tokens: int,
                 tokenizer: Any) -> None:
        self.sampling = sampling
        self.eos_ids = eos_ids
        self.max_tokens = max_tokens
        self.tokenizer = tokenizer if sampling.stop else None
        self.checked = 0  # characters of text already searched for the stop strings
        self.text = GrowingText(tokenizer) if self.tokenizer is not None else None
        self.stop_reason: str | int | None = None
        self.text_end: int | None = None

    def check(self, generated: Sequence[int], *, forced: bool = False) -> str | None:
        """The finish reason when the last token of ``generated`` ends the sequence, else None.
        A stop string is looked for in the text from where a match could not yet have been
        complete (one ending before the text the last token added was found already, or came
        before ``min_tokens``); the earliest match ends it, and its start ends the answer.
        ``forced``: the last tokens are a tool's text (`batch_decode`), which the model did not
        choose: only the stop strings and max_tokens end it there."""
        s, token, n = self.sampling, generated[-1], len(generated)
        if n > s.min_tokens and not forced:
            if token in self.eos_ids and not s.ignore_eos:
                return "stop"
            if token in s.stop_token_ids:
                self.stop_reason = token
                return "stop"
        if self.text is not None:
            text = self.text.extend(generated[len(self.text.ids):])
            if n > s.min_tokens:
                found = [(at, stop) for stop in s.stop
                         if (at := text.find(stop, max(0, self.checked - len(stop) + 1))) >= 0]
                if found:
                    at, stop = min(found)
                    self.text_end, self.stop_reason = at + len(stop) if s.include_stop_str else at, stop
                    return "stop"
            # A trailing partial UTF-8 character reads "\ufffd" until its next token completes it.
            self.checked = len(text.rstrip("\ufffd"))
        if n >= self.max_tokens:
            return "length"
        return None


class HFServedModel:
    """A loaded checkpoint plus the few facts the server reports about it."""

    def __init__(self, lm: Any, *, name: str) -> None:
        self.lm = lm
        self.name = name
        cfg = lm.model.config
        self.vocab_size = int(cfg.vocab_size)
        self.context_length = int(cfg.max_position_embeddings)
        self.n_layers = len(lm.blocks)
        self.num_experts = int(lm.num_experts)
        self.tokenizer = lm.tokenizer
        # Where a checkpoint's end-of-sequence ids live: config.json and generation_config.json,
        # which transformers' generate() stops on (chat checkpoints list their end-of-turn
        # token there only, e.g. Qwen's <|im_end|> beside config.json's <|endoftext|>).
        gen_cfg = getattr(lm.model, "generation_config", None)
        self.eos_ids = frozenset(
            int(i) for eos in (cfg.eos_token_id, getattr(gen_cfg, "eos_token_id", None))
            for i in (eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos]))
        self.device = next(lm.model.parameters()).device

    def shape(self) -> dict[str, Any]:
        """What ``/healthz`` and ``/v1/model`` report for a checkpoint."""
        return {"source": str(self.lm.path), "family": self.lm.family.model_type,
                "name": self.name, "experts": self.num_experts, "layers": self.n_layers,
                "vocab": self.vocab_size, "maxSeqLen": self.context_length,
                "topK": self.lm.top_k, "tokenizer": self.tokenizer is not None,
                "device": str(self.device)}

    def precision(self) -> dict[str, Any]:
        """What ``/v1/model`` reports about weight storage: the installed gate's policy, where
        the variances ``auto`` resolves from came from ("file": the checkpoint's precision file,
        "measured": calibrated in this process, "unmeasured": none, so auto keeps fp32), and
        per MoE layer the precisions and bytes as stored now (read from the stored tensors)."""
        lm = self.lm
        router, experts = lm.gate_sensitivity, lm.expert_sensitivity
        layers = [{**b.to_json(),
                   "routerVariance": _finite(router[i]) if router is not None else None,
                   "expertVariance": _finite(experts[i]) if experts is not None else None}
                  for i, b in enumerate(lm.weight_bytes())]
        return {"policy": lm.gate.params.precision_policy, "source": lm.sensitivity_source,
                "file": str(lm.precision_file) if lm.precision_file is not None else None,
                "calibrationData": lm.calibration_data,
                "bytes": sum(x["gateBytes"] + x["expertBytes"] for x in layers),
                "fp32Bytes": sum(x["gateFp32Bytes"] + x["expertFp32Bytes"] for x in layers),
                "layers": layers}

    def set_gate(self, doc: GateDocument, *, controller: ThresholdController | None = None) -> ActiveGate:
        """Install ``doc`` (raises GateParamsError), routed by ``controller``'s threshold when
        given (targetExpertsPerToken); returns the gate as installed."""
        return self.lm.set_gate(doc, controller=controller)

    def prepare_gate(self, doc: GateDocument, *, beside: GateDocument | None = None,
                     controller: ThresholdController | None = None) -> ActiveGate:
        """``doc`` ready to pin beside the installed gate, or ``beside`` once installed (a
        request-level canary); raises GateParamsError when it would need another weight storage
        (`SparseGatedCausalLM.prepare_gate`)."""
        return self.lm.prepare_gate(doc, beside=beside, controller=controller)

    def run_batch(self, tokens: Sequence[Sequence[int]], *, return_logits: bool = False,
                  gate: ActiveGate | None = None, allowed_experts: Sequence[int] | None = None
                  ) -> tuple[InferenceResult, str | None]:
        """The ``/v1/infer`` result for a checkpoint (under ``gate``, else the installed gate),
        and the gate version that computed it. ``allowed_experts``: the request's expert group.
        A gate with a threshold controller routed with its threshold and is fed this batch's
        mean selected experts per token (the threshold of the next batch), unless the batch is
        scoped to an expert group.
        Tool gate: with a tool-gate head beside the weights (`hf.tool_head`), ``toolCalls`` are
        the positions whose probability exceeds the routing gate's toolGateThreshold and
        ``last_tool_prob`` each row's last one (the server then calls tools); without one,
        ``toolCalls`` are empty and the fire rate 0."""
        batch = torch.tensor(tokens, dtype=torch.long, device=self.device)
        out, hidden = self.lm.last_position_forward(batch, gate=gate, allowed_experts=allowed_experts)
        if out.gate.controller is not None and allowed_experts is None:
            # A scoped batch's experts are bounded by its group, not by the threshold.
            out.gate.controller.update(out.mean_selected_experts)
        last = out.logits[:, -1, :].float()
        with torch.inference_mode():  # the LM head a chunk of positions at a time
            score = score_hidden_rows(hidden, self.lm.model.get_output_embeddings(), batch)
        n = max(len(out.layers), 1)
        tool_calls: list[list[int]] = [[] for _ in tokens]
        fire_rate, last_tool_prob = 0.0, []
        if out.tool_prob is not None:
            fired = tool_fires(out.tool_prob, threshold=out.gate.params.tool_gate_threshold)
            tool_calls = [row.nonzero().squeeze(1).tolist() for row in fired]
            fire_rate, last_tool_prob = float(fired.float().mean()), out.tool_prob[:, -1].tolist()
        result = InferenceResult(
            next_tokens=last.argmax(dim=-1).tolist(),
            last_logits=last.tolist() if return_logits else None,
            expert_counts=[st.counts for st in out.layers],
            active_experts_per_token=out.mean_active_experts,
            selected_experts_per_token=out.mean_selected_experts,
            dropped_assignments=out.dropped,
            gate_entropy=sum(st.entropy for st in out.layers) / n,
            tool_calls=tool_calls, tool_gate_fire_rate=fire_rate, last_tool_prob=last_tool_prob,
            num_tokens=batch.numel(), prompt_score=score)
        return result, out.gate.version

    def generate(self, prompt: Sequence[int], *, max_tokens: int, temperature: float = 0.0,
                 seed: int = 0, on_token: Callable[[int], None] | None = None,
                 sampling: Sampling = OFF) -> Generation:
        """Decode up to ``max_tokens`` after ``prompt`` with the KV cache, under one pinned gate.
        temperature 0 is greedy; above 0, softmax sampling with a generator seeded by ``seed``
        (same seed, same tokens; drawn on the CPU whatever the device), narrowed by
        ``sampling``'s top_k and top_p. Stops early at the checkpoint's end-of-sequence token
        and ``sampling``'s stops (`StopCheck`). One sequence alone: the server decodes through
        `batch_decode` instead, which this is the reference for. A controlled gate routes
        with its controller's threshold of the moment and is not fed (the server feeds it)."""
        generator = torch.Generator().manual_seed(seed)
        generated: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        stops = StopCheck(sampling, eos_ids=self.eos_ids, max_tokens=max_tokens,
                          tokenizer=self.tokenizer)
        finish: str | None = None
        with torch.inference_mode(), self.lm.pinned_gate() as call:
            out = self.lm.model(input_ids=torch.tensor([list(prompt)], device=self.device),
                                use_cache=True)
            prompt_lps = None if sampling.prompt_logprobs is None else prompt_logprobs(
                lambda rows: out.logits[0, rows], list(prompt), sampling.prompt_logprobs)
            while finish is None:
                token = next_token(out.logits[0, -1], temperature=temperature, sampling=sampling,
                                   generator=generator,
                                   banned=sampling.banned(self.eos_ids, len(generated)),
                                   prompt=prompt, generated=generated)
                if sampling.logprobs is not None:
                    logprobs.append(token_logprob(out.logits[0, -1], token, sampling.logprobs))
                generated.append(token)
                if on_token is not None:
                    on_token(token)
                finish = stops.check(generated)
                if finish is None:  # no forward for a token nobody will read
                    out = self.lm.model(input_ids=torch.tensor([[token]], device=self.device),
                                        cache=out.cache, use_cache=True)
        return dataclasses.replace(
            _generation(call.layers, n_blocks=self.n_layers, num_experts=self.num_experts,
                        prompt_tokens=len(prompt), token_ids=generated, finish=finish,
                        gate_version=call.gate.version),
            stop_reason=stops.stop_reason, text_end=stops.text_end, keeps_stop=sampling.include_stop_str,
            logprobs=tuple(logprobs) if sampling.logprobs is not None else None,
            prompt_logprobs=prompt_lps)


def _finite(v: float) -> float | None:
    return None if math.isnan(v) else v  # NaN (a failed measurement) is not JSON


def sampling_probs(logits: torch.Tensor, temperature: float, *, top_p: float = 1.0,
                   top_k: int = 0) -> torch.Tensor:
    """Softmax of ``logits / temperature`` on the CPU (where the seeded generators draw), in
    float64 and shifted by the max first: a vanishing temperature then gives the greedy
    token's one-hot instead of NaN (which would make the draw raise). Then, as vLLM: ``top_k``
    > 0 keeps the k most probable tokens (and any tied with the k-th), and ``top_p`` < 1 the
    smallest set of the most probable whose probability sums to at least top_p (renormalised
    after top_k; the most probable token always stays). The others get probability 0 (the
    draw needs no renormalising)."""
    logits = logits.double().cpu()
    probs = torch.softmax((logits - logits.max()) / temperature, dim=-1)
    if 0 < top_k < probs.numel():
        probs = torch.where(probs >= probs.topk(top_k).values[-1], probs, 0.0)
    if top_p < 1:
        ordered, order = probs.sort(descending=True)
        before = ordered.cumsum(0) - ordered  # the mass of the more probable tokens
        drop = before >= top_p * ordered.sum()
        drop[0] = False
        probs = probs.scatter(0, order, ordered.masked_fill(drop, 0.0))
    return probs


def adjust_logits(logits: torch.Tensor, sampling: Sampling, prompt: Sequence[int],
                  generated: Sequence[int]) -> torch.Tensor:
    """One row's logits as vLLM changes them before the choice: ``logit_bias`` added, then the
    ``repetition_penalty`` over every token in the prompt or generated so far (a positive logit
    divided by it, a negative one multiplied), then ``frequency_penalty`` times the token's
    count among the generated ones and ``presence_penalty`` once if it is among them,
    subtracted (OpenAI's formula). A copy, in float32."""
    s = sampling
    logits = logits.float().clone()
    if s.logit_bias:
        ids, bias = zip(*s.logit_bias)
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    if s.penalizes:
        vocab = logits.shape[-1]
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long, device=logits.device),
                                minlength=vocab)[:vocab].to(logits.dtype)
        if s.repetition_penalty != 1:
            seen = counts > 0
            seen[torch.tensor(list(prompt), dtype=torch.long, device=logits.device)] = True
            penalty = s.repetition_penalty
            logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
        logits = logits - s.frequency_penalty * counts - s.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def next_token(logits: torch.Tensor, *, temperature: float, sampling: Sampling,
               generator: torch.Generator, banned: Sequence[int] = (), prompt: Sequence[int] = (),
               generated: Sequence[int] = ()) -> int:
    """One sequence's next token from its last logits: greedy at temperature 0, else drawn
    with its own seeded generator from `sampling_probs`; never one of ``banned``. The logits
    are first `adjust_logits`'s (``prompt`` and ``generated``: the sequence's tokens so far)."""
    logits = logits.float()
    if sampling.adjusts:
        logits = adjust_logits(logits, sampling, prompt, generated)
    if banned:
        logits = logits.clone()
        logits[list(banned)] = float("-inf")
    if temperature > 0:
        probs = sampling_probs(logits, temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        return int(torch.multinomial(probs, 1, generator=generator))
    return int(logits.argmax())


def _generation(layers: list[MoEStats], *, n_blocks: int, num_experts: int, prompt_tokens: int,
                token_ids: list[int], finish: str, gate_version: str | None) -> Generation:
    # Block calls arrive in layer order once per forward: call i belongs to block i % n_blocks.
    counts = [[0] * num_experts for _ in range(n_blocks)]
    for i, st in enumerate(layers):
        for e, c in enumerate(st.counts):
            counts[i % n_blocks][e] += c
    pairs = sum(st.num_tokens for st in layers)
    kept = sum(sum(st.counts) for st in layers)
    return Generation(prompt_tokens=prompt_tokens, token_ids=token_ids, finish_reason=finish,
                      gate_version=gate_version, expert_counts=counts,
                      mean_experts_per_token=kept / pairs if pairs else 0.0,
                      dropped_assignments=sum(st.dropped for st in layers),
                      gate_entropy=(sum(st.entropy for st in layers) / len(layers)
                                    if layers else 0.0))


# --model-dtype values: the compute dtypes the loader accepts.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load(path: str | Path, *, gate: GateDocument, name: str | None = None,
         dtype: str = "float32", device: str | torch.device = "cpu",
         placement: dict | None = None) -> HFServedModel:
    """Load the checkpoint under ``gate`` in ``dtype`` (a DTYPES key) onto ``device`` (weights,
    KV caches and the MoE dispatch all run there; raises CheckpointError naming the file,
    GateParamsError, or DeviceError for a dtype the GPU cannot run). ``name``: the OpenAI model
    id (default: the directory's name).
    ``placement``: experts on their own dtype/device (hf.placement; PlacementError)."""
    from .hf import load_moe_checkpoint  # transformers loads here, not when the server starts

    for warning in (check_model_dtype(torch.device(device), dtype),
                    weight_memory_warning(path, DTYPES[dtype], limit=cgroup_limits.memory_limit())):
        if warning:
            log.warning("%s", warning)
    lm = load_moe_checkpoint(path, gate=gate, dtype=DTYPES[dtype], device=device,
                             placement=placement)
    return HFServedModel(lm, name=name or Path(path).resolve().name)


def weight_memory_warning(path: str | Path, dtype: torch.dtype, *, limit: int | None) -> str | None:
    """What to log when the checkpoint's weights alone, in ``dtype``, exceed ``limit`` (the
    container's memory limit, cgroup memory.max): transformers holds them all in host memory
    while it loads (before any move to a GPU or precision change), so the pod is likely
    OOMKilled, and restarted into the same load. None when they fit, or when there is no limit
    or the files cannot be read (the load then says why)."""
    from .hf.checkpoint_files import CheckpointError, check_weight_files, safetensors_header

    if limit is None:
        return None
    try:
        shards = check_weight_files(Path(path))
        numel = sum(math.prod(entry["shape"]) for shard in shards
                    for key, entry in safetensors_header(shard).items() if key != "__metadata__")
    except (CheckpointError, OSError, KeyError, TypeError):
        return None
    need = numel * dtype.itemsize
    if need <= limit:
        return None
    return (f"checkpoint {path}: its weights take {need / 2**30:.2f} GiB in {dtype}, more than "
            f"this container's memory limit of {limit / 2**30:.2f} GiB (cgroup memory.max): the "
            "load is likely to be OOMKilled; raise the pod's memory limit or use a smaller "
            "--model-dtype")
