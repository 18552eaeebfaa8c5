"""Tools on the OpenAI generation routes: what the continuous-batching decoder (`batch_decode`)
and engine (`batch_engine`) need from the tool registry, for a checkpoint with a tool-gate head.

``select`` runs on the model thread when a sequence's tool gate fires at its last position: the
checkpoint's tokenizer decodes the sequence and the registry picks the tool exactly as on
``/v1/infer`` (`tools.ToolRegistry.select`). ``run`` runs on the event loop while the sequence is
parked: one `tools.call` (its timeout, audit log line and metrics as on ``/v1/infer``), recorded
on the request's handle; it returns the result's tokens to force, or None (timeout, error,
refused) so the sequence decodes on as if the gate had not fired. A request makes at most
`MAX_TOOL_CALLS_PER_REQUEST` calls, failed ones included, so a gate that keeps firing cannot
loop.

What a completion reports (``usage.sparsegate.tool_calls``, one object per call, in order):
``tool``, ``outcome`` (ok|timeout|error|refused), ``position`` (the token, counted over prompt
and completion, where the gate fired), ``completion_offset`` (the completion token index where
the forced tokens start), ``gate_probability``, ``latency_ms``, ``arguments_digest`` (sha256 hex;
the arguments are never echoed), ``forced_text`` and ``forced_tokens`` (the result as forced;
"" and 0 unless ok; a completion that reaches ``max_tokens`` inside it keeps only its first
tokens) and ``detail`` (why, when not ok). The forced text is also part of the completion text
(and of the stream's chunks).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import aiohttp

from . import tools

if TYPE_CHECKING:
    from .batch_decode import ToolFire
    from .batch_engine import GenerationHandle

MAX_TOOL_CALLS_PER_REQUEST = 4


@dataclasses.dataclass(frozen=True)
class GenerationToolCall:
    """One tool call of a completion: the audit record and where its result went."""

    record: tools.ToolCall
    completion_offset: int
    forced_text: str

    def to_usage(self) -> dict[str, Any]:
        r = self.record
        return {"tool": r.tool, "outcome": r.outcome, "position": r.position,
                "completion_offset": self.completion_offset,
                "gate_probability": r.gate_probability, "latency_ms": r.latency_ms,
                "arguments_digest": r.arguments_digest, "forced_text": self.forced_text,
                "forced_tokens": len(r.tokens), "detail": r.detail}


class GenerationTools:
    """The registry, the checkpoint's tokenizer and the tool metrics, bound for the engine."""

    def __init__(self, registry: tools.ToolRegistry, tokenizer: Any, *, vocab_size: int,
                 metrics: tools.ToolMetrics | None) -> None:
        self.registry = registry
        self.tokenizer = tokenizer
        self.codec = tools.tokenizer_codec(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size
        self.metrics = metrics

    def select(self, ids: list[int]) -> tuple[str, str] | None:
        """(tool, arguments) the text of ``ids`` calls, or None (model thread)."""
        return self.registry.select(self.codec.segment(ids))

    async def run(self, handle: GenerationHandle, fire: ToolFire) -> list[int] | None:
        """Call ``fire``'s tool for ``handle``'s request; the tokens to force, or None."""
        async with aiohttp.ClientSession() as session:
            record = await tools.call(
                self.registry, session, tool=fire.tool, arguments=fire.arguments,
                request_id=handle.request_id, sequence=0, position=fire.position,
                gate_probability=fire.gate_probability, vocab_size=self.vocab_size,
                metrics=self.metrics, codec=self.codec)
        offset = fire.position + 1 - len(handle.request.prompt_ids)
        # What the decoder will force: the result cut at max_tokens (`BatchDecoder._resume`).
        tokens = record.tokens
        kept = tokens[:max(0, handle.request.max_tokens - offset)]
        if len(kept) < len(tokens):
            record = dataclasses.replace(record, tokens=kept)
        handle.tool_calls.append(GenerationToolCall(
            record=record, completion_offset=offset,
            forced_text=self.tokenizer.decode(kept) if kept else ""))
        return tokens or None
