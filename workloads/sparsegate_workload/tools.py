"""Tools the tool gate calls: the registry (built-in ``calculator`` plus HTTP tools declared on
the SparseModel, ``--tools-json``), argument extraction, the calls with their timeouts, and the
audit record of each call (a JSON log line and two Prometheus series).

Tools are called on ``/v1/infer`` by the built-in model's tool-gate head, and by a checkpoint's
when one ships beside its weights (`hf.tool_head`; without it a checkpoint reports no tool calls);
with such a head, also while the OpenAI routes generate (`generation_tools`, `batch_decode`).
The built-in model's token ids are read as text for this purpose: ids 0-255 are bytes (Latin-1),
any higher id ends a segment like a newline; a checkpoint's are decoded by its tokenizer, and a
result is encoded by it (`TextCodec`). When the gate fires at the LAST position
of a sequence (the one whose next token is being decoded), the segment is the text since the last
newline up to that position, and:

* ``<name>: <arguments>`` with ``name`` a declared HTTP tool calls it with ``<arguments>``;
* otherwise a segment ending in ``=`` calls ``calculator`` with the arithmetic characters
  (digits, ``. + - * / % ( )`` and spaces) just before the ``=``, if there are any (the
  calculator may still refuse them: outcome ``refused``);
* anything else calls nothing.

A result becomes tokens (its UTF-8 bytes, or its tokenizer ids; at most ``MAX_RESULT_TOKENS``) that re-rank the
continuation by forcing it: the result is ranked above every token the model proposes, so the
sequence's next token is the result's first token and the whole result is returned as the forced
continuation. A timeout or error leaves the model's own next token (plain decoding); it never
fails the request. Calls run on the event loop, never on the model thread, so other requests'
batches go on while one waits for its tool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import re
import time
from typing import Any, Callable, Mapping

import aiohttp
from prometheus_client import CollectorRegistry, Counter, Histogram

log = logging.getLogger("sparsegate.tools")

CALCULATOR = "calculator"
MAX_RESULT_TOKENS = 64
MAX_ARGUMENT_CHARS = 256
MIN_TIMEOUT_MS, MAX_TIMEOUT_MS = 1, 10_000  # the CRD's bounds on spec.tools[].timeoutMs
DEFAULT_TIMEOUT_MS = 1000
CALCULATOR_TIMEOUT_MS = 0  # computed inline, bounded by MAX_ARGUMENT_CHARS and MAX_EXPONENT
NAME_RE = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
OUTCOMES = ("ok", "timeout", "error", "refused")
DURATION_BUCKETS = (0.0001, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class ToolSpecError(ValueError):
    """A tool declaration is invalid; the message names the field."""


class CalculatorError(ValueError):
    """The calculator refused its input; the message says why."""


# --- calculator: a recursive-descent parser over numbers, + - * / // % ** and parentheses ----

MAX_EXPONENT = 64          # |b| of a ** b, so no input can make a huge integer
MAX_MAGNITUDE = 1e100      # any intermediate beyond it is refused
# Parentheses, signs and exponents nested in each other: the parser recurses per level, and
# ~200 "(" (inside MAX_ARGUMENT_CHARS) passed Python's recursion limit: a 500 on /v1/infer.
MAX_NESTING = 64
_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?|\.\d+)|(\*\*|//|[-+*/%()]))")


def _lex(text: str) -> list[str]:
    out: list[str] = []
    pos = 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CalculatorError(f"unexpected character {text[pos:].lstrip()[:1]!r} at "
                                  f"{len(text) - len(text[pos:].lstrip())}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.i = tokens, 0
        self.depth = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise CalculatorError("expression ends too early")
        self.i += 1
        return tok

    def expr(self) -> int | float:          # expr := term (('+'|'-') term)*
        value = self.term()
        while self.peek() in ("+", "-"):
            value = _checked(value + self.term() if self.take() == "+" else value - self.term())
        return value

    def term(self) -> int | float:          # term := unary (('*'|'/'|'//'|'%') unary)*
        value = self.unary()
        while self.peek() in ("*", "/", "//", "%"):
            op, rhs = self.take(), self.unary()
            if rhs == 0:
                raise CalculatorError("division by zero")
            value = _checked(value * rhs if op == "*" else value / rhs if op == "/"
                             else value // rhs if op == "//" else value % rhs)
        return value

    def unary(self) -> int | float:         # unary := ('+'|'-') unary | power
        # Every recursion ('(' expr, a sign, an exponent) passes here: the depth bound.
        if self.depth >= MAX_NESTING:
            raise CalculatorError(f"expression nested deeper than {MAX_NESTING} levels")
        self.depth += 1
        try:
            if self.peek() in ("+", "-"):
                return _checked(-self.unary() if self.take() == "-" else self.unary())
            return self.power()
        finally:
            self.depth -= 1

    def power(self) -> int | float:         # power := atom ('**' unary)?
        base = self.atom()
        if self.peek() == "**":
            self.take()
            exp = self.unary()
            if abs(exp) > MAX_EXPONENT:
                raise CalculatorError(f"exponent {exp} exceeds {MAX_EXPONENT}")
            if base == 0 and exp < 0:
                raise CalculatorError("division by zero")
            try:
                result = base ** exp
            except OverflowError:  # a float power past float range (an int one stays exact, then checked)
                raise CalculatorError(f"a value exceeds {MAX_MAGNITUDE:g}") from None
            if isinstance(result, complex):
                raise CalculatorError("result is not a real number")
            return _checked(result)
        return base

    def atom(self) -> int | float:          # atom := number | '(' expr ')'
        tok = self.take()
        if tok == "(":
            value = self.expr()
            if self.take() != ")":
                raise CalculatorError("expected ')'")
            return value
        if tok[0].isdigit() or tok[0] == ".":
            return _checked(float(tok) if "." in tok else int(tok))
        raise CalculatorError(f"unexpected {tok!r}")


def _checked(value: int | float) -> int | float:
    if abs(value) > MAX_MAGNITUDE or value != value:
        raise CalculatorError(f"a value exceeds {MAX_MAGNITUDE:g} in magnitude")
    return value


def calculate(expression: str) -> str:
    """The value of an arithmetic expression as text (integers exact, others to 12 significant
    digits). No eval: anything but numbers, + - * / // % **, parentheses and spaces is refused."""
    if len(expression) > MAX_ARGUMENT_CHARS:
        raise CalculatorError(f"expression longer than {MAX_ARGUMENT_CHARS} characters")
    tokens = _lex(expression)
    if not tokens:
        raise CalculatorError("empty expression")
    parser = _Parser(tokens)
    value = parser.expr()
    if parser.peek() is not None:
        raise CalculatorError(f"unexpected {parser.peek()!r} after the expression")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else format(value, ".12g")


# --- registry ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class HttpTool:
    """POSTs ``{"tool": name, "arguments": text}``; expects 200 with ``{"result": text}``."""

    name: str
    url: str
    timeout_ms: int = DEFAULT_TIMEOUT_MS


def parse_tools(raw: Any) -> dict[str, HttpTool]:
    """``SparseModel.spec.tools`` as rendered into ``--tools-json``: a list of
    ``{name, url, timeoutMs?}``. Raises ToolSpecError naming the field."""
    if not isinstance(raw, list):
        raise ToolSpecError("tools must be a list of {name, url, timeoutMs}")
    tools: dict[str, HttpTool] = {}
    for i, item in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(item, Mapping):
            raise ToolSpecError(f"{where} must be an object")
        unknown = sorted(set(item) - {"name", "url", "timeoutMs"})
        if unknown:
            raise ToolSpecError(f"{where}: unknown fields {', '.join(unknown)}")
        name, url = item.get("name"), item.get("url")
        timeout = item.get("timeoutMs", DEFAULT_TIMEOUT_MS)
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ToolSpecError(f"{where}.name must be a DNS-1123 label, got {name!r}")
        if name == CALCULATOR:
            raise ToolSpecError(f"{where}.name {CALCULATOR!r} is the built-in tool's")
        if name in tools:
            raise ToolSpecError(f"{where}.name {name!r} is declared twice")
        if not isinstance(url, str) or not re.match(r"^https?://[^\s/]+", url):
            raise ToolSpecError(f"{where}.url must be an http:// or https:// URL, got {url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int) \
                or not MIN_TIMEOUT_MS <= timeout <= MAX_TIMEOUT_MS:
            raise ToolSpecError(f"{where}.timeoutMs must be an integer in "
                                f"[{MIN_TIMEOUT_MS}, {MAX_TIMEOUT_MS}], got {timeout!r}")
        tools[name] = HttpTool(name=name, url=url, timeout_ms=timeout)
    return tools


@dataclasses.dataclass(frozen=True)
class ToolRegistry:
    http: Mapping[str, HttpTool] = dataclasses.field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return (CALCULATOR, *sorted(self.http))

    def select(self, segment: str) -> tuple[str, str] | None:
        """(tool, arguments) for a segment (see the module docstring), or None."""
        m = re.match(r"^\s*([a-z][-a-z0-9]*):(.*)$", segment, re.S)
        if m and m.group(1) in self.http:
            return m.group(1), m.group(2).strip()
        if segment.endswith("="):
            expr = re.search(r"[0-9.+\-*/%() ]*$", segment[:-1])
            assert expr is not None  # the pattern matches the empty string
            if expr.group(0).strip():
                return CALCULATOR, expr.group(0).strip()
        return None


# --- tokens <-> text (built-in model) ---------------------------------------------------------

def segment_text(tokens: list[int]) -> str:
    """The text since the last newline (or id >= 256) of a token sequence, ids read as bytes."""
    text = "".join(chr(t) if t < 256 else "\n" for t in tokens)
    return text.rsplit("\n", 1)[-1]


def _checked_result(ids: list[int], *, vocab_size: int, unit: str) -> list[int]:
    """A result's forced ids, or ValueError: not empty, at most MAX_RESULT_TOKENS, in the vocabulary."""
    if not ids:
        raise ValueError("empty result")
    if len(ids) > MAX_RESULT_TOKENS:
        raise ValueError(f"result longer than {MAX_RESULT_TOKENS} tokens")
    if max(ids) >= vocab_size:
        raise ValueError(f"result {unit} {max(ids)} is outside the vocabulary [0, {vocab_size})")
    return ids


def result_tokens(result: str, *, vocab_size: int) -> list[int]:
    return _checked_result(list(result.encode("utf-8")), vocab_size=vocab_size, unit="byte")


@dataclasses.dataclass(frozen=True)
class TextCodec:
    """How a model's token ids read as text for tools: the segment a call's arguments come
    from (text since the last newline), and a result's forced tokens (raises ValueError)."""

    segment: Callable[[list[int]], str]
    encode: Callable[[str], list[int]]


def byte_codec(vocab_size: int) -> TextCodec:
    """The built-in model's: ids 0-255 are bytes."""
    return TextCodec(segment=segment_text, encode=lambda r: result_tokens(r, vocab_size=vocab_size))


def tokenizer_codec(tokenizer: Any, *, vocab_size: int) -> TextCodec:
    """A checkpoint's: its tokenizer decodes the segment and encodes the result."""
    def segment(tokens: list[int]) -> str:
        return tokenizer.decode(tokens, skip_special_tokens=True).rsplit("\n", 1)[-1]

    def encode(result: str) -> list[int]:
        ids = list(tokenizer(result, add_special_tokens=False)["input_ids"])
        return _checked_result(ids, vocab_size=vocab_size, unit="token")
    return TextCodec(segment=segment, encode=encode)


# --- calls, audit, metrics --------------------------------------------------------------------

class ToolMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.calls = Counter("sparsegate_tool_calls_total", "Tool calls by tool and outcome",
                             ["tool", "outcome"], registry=registry)
        self.duration = Histogram("sparsegate_tool_call_duration_seconds",
                                  "Tool call latency", ["tool"], buckets=DURATION_BUCKETS,
                                  registry=registry)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """The audit record of one call (also what /v1/infer returns per sequence)."""

    request_id: str
    sequence: int
    position: int
    gate_probability: float
    tool: str
    arguments_digest: str       # sha256 of the UTF-8 arguments, hex: the arguments never logged
    latency_ms: float
    outcome: str                # ok | timeout | error | refused (the calculator's parser)
    tokens: list[int]           # the forced continuation; [] unless ok
    detail: str = ""            # why, when not ok

    def to_json(self) -> dict[str, Any]:
        return {"requestId": self.request_id, "sequence": self.sequence,
                "position": self.position, "gateProbability": self.gate_probability,
                "tool": self.tool, "argumentsDigest": self.arguments_digest,
                "latencyMs": self.latency_ms, "outcome": self.outcome, "tokens": self.tokens,
                "detail": self.detail}


def digest(arguments: str) -> str:
    return hashlib.sha256(arguments.encode("utf-8")).hexdigest()


async def _call_http(session: aiohttp.ClientSession, tool: HttpTool, arguments: str) -> str:
    async with session.post(tool.url, json={"tool": tool.name, "arguments": arguments},
                            timeout=aiohttp.ClientTimeout(total=tool.timeout_ms / 1000)) as resp:
        if resp.status != 200:
            raise ValueError(f"HTTP {resp.status}")
        body = await resp.json(content_type=None)
    if not isinstance(body, dict) or not isinstance(body.get("result"), str):
        raise ValueError('response is not {"result": "<text>"}')
    return body["result"]


async def call(registry: ToolRegistry, session: aiohttp.ClientSession, *, tool: str,
               arguments: str, request_id: str, sequence: int, position: int,
               gate_probability: float, vocab_size: int, metrics: ToolMetrics | None,
               codec: TextCodec | None = None) -> ToolCall:
    """Call one tool; never raises for the tool's failures: they become the outcome.
    ``codec``: how the result becomes tokens (default: the built-in model's bytes)."""
    started = time.perf_counter()
    tokens: list[int] = []
    detail = ""
    try:
        if tool == CALCULATOR:
            result = calculate(arguments)
        else:
            result = await _call_http(session, registry.http[tool], arguments)
        tokens = (codec or byte_codec(vocab_size)).encode(result)
        outcome = "ok"
    except CalculatorError as e:
        outcome, detail = "refused", str(e)
    except asyncio.TimeoutError:
        outcome, detail = "timeout", f"no answer within {registry.http[tool].timeout_ms} ms"
    except (aiohttp.ClientError, ValueError) as e:
        outcome, detail = "error", f"{type(e).__name__}: {e}"
    elapsed = time.perf_counter() - started
    record = ToolCall(request_id=request_id, sequence=sequence, position=position,
                      gate_probability=round(gate_probability, 6), tool=tool,
                      arguments_digest=digest(arguments), latency_ms=round(elapsed * 1000, 3),
                      outcome=outcome, tokens=tokens, detail=detail)
    if metrics is not None:
        metrics.calls.labels(tool=tool, outcome=outcome).inc()
        metrics.duration.labels(tool=tool).observe(elapsed)
    audit = {k: v for k, v in record.to_json().items() if k != "tokens"}
    log.info("tool call %s", json.dumps(audit, sort_keys=True))
    return record


async def call_fired(registry: ToolRegistry, tokens: list[list[int]], *,
                     last_prob: list[float], threshold: float, request_id: str,
                     vocab_size: int, metrics: ToolMetrics | None,
                     codec: TextCodec | None = None) -> list[ToolCall | None]:
    """Per sequence: the call made because the gate fired at its last position (None: the gate
    did not fire there, or the segment names no tool). Calls run concurrently. ``codec``: how
    ids read as text (default: the built-in model's bytes)."""
    codec = codec or byte_codec(vocab_size)
    plan: list[tuple[int, str, str]] = []
    for i, (row, prob) in enumerate(zip(tokens, last_prob, strict=True)):
        if prob > threshold:
            chosen = registry.select(codec.segment(row))
            if chosen is not None:
                plan.append((i, *chosen))
    out: list[ToolCall | None] = [None] * len(tokens)
    if not plan:
        return out
    async with aiohttp.ClientSession() as session:
        records = await asyncio.gather(*(
            call(registry, session, tool=tool, arguments=args, request_id=request_id,
                 sequence=i, position=len(tokens[i]) - 1, gate_probability=last_prob[i],
                 vocab_size=vocab_size, metrics=metrics, codec=codec) for i, tool, args in plan))
    for (i, _, _), record in zip(plan, records):
        out[i] = record
    return out
