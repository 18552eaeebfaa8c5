"""Quality as a live metric: how well the served model predicts text, per gate version.

Two measurements, both as negative log-likelihood (NLL, nats per token; mean log-probability is
its negative, perplexity its exponential):

* **Live traffic**: the prompt tokens of every request, scored by the forward that serves it
  (no second forward: a checkpoint's ``/v1/infer`` batch and the OpenAI API's prefill keep the
  final hidden states and apply the LM head to `SCORE_CHUNK` positions at a time,
  `score_hidden_rows` / `score_packed_hidden`; the built-in model's batches score their
  logits). Token t is scored by the logits at t-1, within its own sequence.
  Generated tokens are not scored: under greedy decoding their log-probability is the model's
  confidence in its own choice, not a measure of how well it predicts text.
  Exported as counters, so ``rate(nll) / rate(tokens)`` is the mean NLL over any window.
  A token whose NLL is not a finite number (NaN or infinite logits: a broken gate version, an
  overflow) counts ``NONFINITE_NLL`` nats, worse than any real prediction: a NaN added to a
  counter would stay there for the pod's life (and a query reading NaN as "no data" would see a
  perfect score), while this keeps every series finite and such a version's quality the worst.
* **Probe set**: a small fixed text scored whenever a gate version is installed, under that
  gate exactly as served (its capacity cap included; a checkpoint's request-level canary pinned
  for the probe forward as for a request). Every version the server holds is scored: the stable
  one, and the canary of a request-level canary beside it. Canary and stable score the same
  tokens, so their difference is the gate's doing, not the traffic's. The text comes from
  ``sparsegate_probe.txt`` beside the checkpoint's weights when present (one text per line,
  placed there by whoever ships the checkpoint; ``sparsegate-train`` writes its held-out lines
  there); otherwise, for a checkpoint with a tokenizer,
  64 lines of the synthetic training corpus made in code from a fixed seed (`training.corpus`;
  held out for a model that ``sparsegate-train`` trained with another seed); for the
  built-in model (no tokenizer), token ids drawn from a fixed seed.

Metrics (labelled ``gate_version``; ``none`` for a gate without a version):
``sparsegate_quality_nll_total``, ``sparsegate_quality_tokens_total`` (counters, live traffic),
``sparsegate_probe_nll_per_token``, ``sparsegate_probe_perplexity`` and
``sparsegate_probe_tokens`` (gauges, one per version held: a version the server no longer
holds, after a promotion or a rollback, loses its gauges).
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry, Counter, Gauge

PROBE_FILE = "sparsegate_probe.txt"  # one probe text per line, beside a checkpoint's weights
PROBE_SEED = 7_777                   # the code-made probe set (corpus lines or token ids)
PROBE_LINES = 64                     # corpus lines in the code-made probe set
PROBE_SEQ_LEN = 64                   # tokens per probe window
PROBE_MAX_TOKENS = 4096              # at most this many probe tokens are scored
NO_VERSION = "none"                  # label of a gate without a version
NONFINITE_NLL = 1e4                  # nats counted for a token whose NLL is NaN or infinite
SCORE_CHUNK = 256                    # prompt positions whose logits one scoring step holds


@dataclasses.dataclass(frozen=True)
class Score:
    """Summed NLL (nats) over ``tokens`` scored tokens."""

    nll: float
    tokens: int

    @property
    def mean_nll(self) -> float:
        return self.nll / self.tokens if self.tokens else math.nan

    @property
    def mean_logprob(self) -> float:
        return -self.mean_nll

    @property
    def perplexity(self) -> float:
        if not self.tokens:
            return math.nan
        return math.exp(self.mean_nll) if self.mean_nll < 700 else math.inf  # exp overflows past ~709.78


def _nll_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy (a 0-d tensor, no host sync) of ``targets`` [N] under ``logits``
    [N, V], each token's NaN or infinite NLL counted as ``NONFINITE_NLL`` (module docstring)."""
    nll = F.cross_entropy(logits.float(), targets, reduction="none")
    return torch.nan_to_num(nll, nan=NONFINITE_NLL, posinf=NONFINITE_NLL).sum()


def _summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> float:
    return float(_nll_sum(logits, targets))


def score_rows(logits: torch.Tensor, ids: torch.Tensor) -> Score:
    """Next-token NLL of every row of ``ids`` [B, S] under ``logits`` [B, S, V] (same forward):
    token t of a row is scored by the logits at t-1; the first token of each row is not."""
    if ids.shape[1] < 2:
        return Score(0.0, 0)
    nll = _summed_nll(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    return Score(nll, int(ids.shape[0] * (ids.shape[1] - 1)))


def _packed_keep(ids: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
    """[T - 1] bool: which positions of a packed row score the next token (not the last of a
    sequence, which would predict the next one's first)."""
    keep = torch.ones(max(ids.shape[0] - 1, 0), dtype=torch.bool, device=ids.device)
    end = 0
    for n in lengths[:-1]:
        end += n
        keep[end - 1] = False  # position end-1 (last of a sequence) would predict the next one's first
    return keep


def score_packed(logits: torch.Tensor, ids: torch.Tensor, lengths: Sequence[int]) -> Score:
    """Next-token NLL of sequences packed end to end in one row: ``logits`` [T, V], ``ids``
    [T], ``lengths`` summing to T. No token is scored by another sequence's last position."""
    keep = _packed_keep(ids, lengths)
    if keep.numel() == 0 or not bool(keep.any()):
        return Score(0.0, 0)
    return Score(_summed_nll(logits[:-1][keep], ids[1:][keep]), int(keep.sum()))


def score_packed_hidden(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                        ids: torch.Tensor, lengths: Sequence[int], *,
                        chunk: int = SCORE_CHUNK) -> Score:
    """`score_packed` from the final hidden states ``hidden`` [T, hidden] and the LM ``head``
    that maps them to logits: the logits of ``chunk`` positions at a time, so scoring a prefill
    holds O(chunk x vocab) floats, never its whole [T, vocab] logits (GBs for a 150k
    vocabulary)."""
    keep = _packed_keep(ids, lengths)
    rows = keep.nonzero().squeeze(1)  # position t scores ids[t + 1]
    if rows.numel() == 0:
        return Score(0.0, 0)
    targets = ids[1:][keep]
    total = hidden.new_zeros((), dtype=torch.float64)
    for i in range(0, rows.numel(), chunk):
        total += _nll_sum(head(hidden.index_select(0, rows[i:i + chunk])), targets[i:i + chunk])
    return Score(float(total), int(rows.numel()))


def score_hidden_rows(hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor],
                      ids: torch.Tensor, *, chunk: int = SCORE_CHUNK) -> Score:
    """`score_rows` from the final hidden states ``hidden`` [B, S, hidden] and the LM ``head``,
    ``chunk`` positions at a time (`score_packed_hidden`): never the [B, S, vocab] logits."""
    b, s = ids.shape
    return score_packed_hidden(hidden.reshape(b * s, -1), head, ids.reshape(-1), [s] * b,
                               chunk=chunk)


# ------------------------------------------------------------------------ probe set


@dataclasses.dataclass(frozen=True)
class ProbeSet:
    windows: torch.Tensor  # [n, seq_len] token ids, scored in one forward
    source: str            # where the text came from (logged and tested)


def _windows(ids: Sequence[int], seq_len: int) -> torch.Tensor:
    ids = list(ids)[:PROBE_MAX_TOKENS]
    n = len(ids) // seq_len
    if n == 0:
        raise ValueError(f"probe set has {len(ids)} tokens, fewer than one window of {seq_len}")
    return torch.tensor(ids[:n * seq_len], dtype=torch.long).view(n, seq_len)


def checkpoint_probe(model_dir: str | Path, tokenizer: Any | None, *, vocab_size: int,
                     context_length: int) -> ProbeSet:
    """The probe set of a checkpoint (see module docstring for where its text comes from)."""
    seq_len = min(PROBE_SEQ_LEN, context_length)
    path = Path(model_dir) / PROBE_FILE
    if tokenizer is None:
        return random_probe(vocab_size=vocab_size, seq_len=seq_len)
    if path.is_file():
        # Read and tokenized only as far as PROBE_MAX_TOKENS: a shipped file may be a whole
        # validation set, and every line of a 30 MB one took ~30 s to tokenize at each load.
        with path.open(encoding="utf-8") as f:
            ids = _probe_ids((part for ln in f for part in ln.splitlines()), tokenizer)
        source = str(path)
    else:
        from .training.corpus import generate_lines

        ids = _probe_ids((text for text, _ in generate_lines(PROBE_LINES, seed=PROBE_SEED)), tokenizer)
        source = f"synthetic corpus lines (seed {PROBE_SEED})"
    return ProbeSet(windows=_windows(ids, seq_len), source=source)


def _probe_ids(lines: Iterable[str], tokenizer: Any) -> list[int]:
    """The ids of the non-blank ``lines`` (each followed by a newline), up to PROBE_MAX_TOKENS."""
    ids: list[int] = []
    for line in lines:
        if line.strip():
            ids += tokenizer(line + "\n", add_special_tokens=False)["input_ids"]
            if len(ids) >= PROBE_MAX_TOKENS:
                break
    return ids


def random_probe(*, vocab_size: int, seq_len: int = PROBE_SEQ_LEN, windows: int = 4) -> ProbeSet:
    """Token ids from a fixed seed: a model without a tokenizer (the built-in one) has no text
    to read, so its probe measures only how the gate changes its predictions."""
    r = random.Random(PROBE_SEED)
    ids = [r.randrange(vocab_size) for _ in range(seq_len * windows)]
    return ProbeSet(windows=_windows(ids, seq_len), source=f"random token ids (seed {PROBE_SEED})")


def score_checkpoint_probe(lm: Any, probe: ProbeSet, *, gate: Any = None) -> Score:
    """Score ``probe`` through a `SparseGatedCausalLM` under ``gate`` (an `ActiveGate` pinned
    for the forward, as a request-level canary is for a request), else the gate installed now."""
    device = next(lm.model.parameters()).device
    ids = probe.windows.to(device)
    # The final hidden states and the LM head a chunk at a time: the logits of every probe
    # position would be [PROBE_MAX_TOKENS, vocab] (GBs for a 150k vocabulary), at every install.
    _, hidden = lm.last_position_forward(ids, gate=gate)
    with torch.inference_mode():
        return score_hidden_rows(hidden, lm.model.get_output_embeddings(), ids)


def score_builtin_probe(model: Any, probe: ProbeSet, *, gate: Any, precisions: Any) -> Score:
    """Score ``probe`` through the built-in TinyMoELM under ``gate``."""
    with torch.inference_mode():
        out = model(probe.windows, gate=gate, precisions=precisions)
    return score_rows(out.logits, probe.windows)


# ------------------------------------------------------------------------ metrics


class QualityMetrics:
    """The quality series of one model server, on its registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.nll = Counter("sparsegate_quality_nll",
                           "Live traffic: summed negative log-likelihood (nats) of scored prompt "
                           "tokens; rate / rate of sparsegate_quality_tokens_total = mean NLL",
                           ["gate_version"], registry=r)
        self.tokens = Counter("sparsegate_quality_tokens",
                              "Live traffic: prompt tokens scored for quality",
                              ["gate_version"], registry=r)
        self.probe_nll = Gauge("sparsegate_probe_nll_per_token",
                               "Probe set: mean NLL per token (nats) under each gate version held",
                               ["gate_version"], registry=r)
        self.probe_ppl = Gauge("sparsegate_probe_perplexity",
                               "Probe set: perplexity under each gate version held",
                               ["gate_version"], registry=r)
        self.probe_tokens = Gauge("sparsegate_probe_tokens", "Probe set: tokens scored",
                                  ["gate_version"], registry=r)
        self.probe: ProbeSet | None = None  # set by the server once the model is loaded
        self.probe_scores: dict[str, Score] = {}  # published now, by gate_version label

    def observe(self, version: str | None, score: Score) -> None:
        if score.tokens:
            label = version or NO_VERSION
            self.nll.labels(gate_version=label).inc(score.nll)
            self.tokens.labels(gate_version=label).inc(score.tokens)

    def publish_probes(self, scores: Mapping[str | None, Score]) -> None:
        """Publish the probe scores of exactly the versions in ``scores`` (the versions held:
        stable, and a request-level canary's); every other version's gauges are removed, so
        ``/metrics`` never shows a version the server no longer serves."""
        wanted = {(version or NO_VERSION): score for version, score in scores.items()}
        for label in set(self.probe_scores) - set(wanted):
            for g in (self.probe_nll, self.probe_ppl, self.probe_tokens):
                g.remove(label)
        for label, score in wanted.items():
            self.probe_nll.labels(gate_version=label).set(score.mean_nll)
            self.probe_ppl.labels(gate_version=label).set(score.perplexity)
            self.probe_tokens.labels(gate_version=label).set(score.tokens)
        self.probe_scores = wanted

    def set_probe(self, version: str | None, score: Score) -> None:
        """Publish the probe score of ``version`` as the only version held."""
        self.publish_probes({version: score})
