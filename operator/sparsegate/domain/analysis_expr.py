"""The two small languages of declared analysis checks: conditions and JSON field selection.

Conditions (``successCondition`` / ``failureCondition``) are boolean expressions over one
number, ``result`` (the measurement). The grammar is parsed here by a recursive-descent
parser into a tree of tuples and evaluated by walking it; nothing is ever handed to Python's
``eval``, and no name but ``result``, ``true``, ``false`` and the functions below exists::

    expr    := or
    or      := and (('||' | 'or') and)*
    and     := not (('&&' | 'and') not)*
    not     := ('!' | 'not') not | compare
    compare := sum (('<' | '<=' | '>' | '>=' | '==' | '!=') sum)?
    sum     := product (('+' | '-') product)*
    product := unary (('*' | '/') unary)*
    unary   := '-' unary | atom
    atom    := NUMBER | 'result' | 'true' | 'false' | '(' expr ')'
             | ('abs' | 'min' | 'max') '(' expr (',' expr)* ')'

Examples: ``result < 0.05``, ``result >= 0.9 && result <= 1``, ``abs(result - 1) < 0.1``.
An expression must yield a boolean; type errors (``result + true``, ``!result``) are found when the
condition is parsed (:func:`parse_condition` raises :class:`ExprError`, so the spec is refused as
invalid), while division by zero raises it at evaluation, which the caller records as a
measurement error.

JSON selection (``web`` checks' ``jsonPath``) is a path of field names and list indexes:
``$.data.score``, ``data.items[0].value``, ``{$.data['p99']}`` (the braces of kubectl's JSONPath
are accepted and ignored). No filters, wildcards or recursion.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ExprError", "Condition", "parse_condition", "JsonPath", "parse_json_path", "MAX_EXPRESSION_LENGTH"]

MAX_EXPRESSION_LENGTH = 256
# Parentheses, calls and unary operators nest at most this deep: the parser, the type check and
# the evaluation recurse once per level, and a 256-character text could otherwise nest ~128 deep,
# past Python's recursion limit inside the operator's own call stack.
MAX_NESTING = 32

_TOKEN = re.compile(r"""
    \s*(?:
      (?P<number>(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)
    | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
    | (?P<op><=|>=|==|!=|&&|\|\||[-+*/<>!(),])
    )""", re.VERBOSE)
_FUNCTIONS = {"abs": (1, 1), "min": (2, 8), "max": (2, 8)}
_KEYWORDS = {"result", "true", "false", "and", "or", "not", *_FUNCTIONS}


class ExprError(ValueError):
    """An expression that cannot be parsed or evaluated; the message says where and why."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise ExprError(f"unexpected character {text[pos:].lstrip()[:1]!r} at {pos + 1}")
        kind = m.lastgroup or ""
        value = m.group(kind)
        if kind == "name" and value not in _KEYWORDS:
            raise ExprError(f"unknown name {value!r} (only result, true, false, and, or, not, abs, min, max)")
        out.append((kind, value))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.depth = 0

    @contextlib.contextmanager
    def nested(self) -> Iterator[None]:
        """One level deeper for what is parsed inside (refused past MAX_NESTING)."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise ExprError(f"nested more than {MAX_NESTING} levels deep (parentheses, calls, ! and unary -)")
        yield
        self.depth -= 1

    def peek(self) -> str | None:
        return self.toks[self.i][1] if self.i < len(self.toks) else None

    def take(self, *values: str) -> str | None:
        if self.peek() in values:
            self.i += 1
            return self.toks[self.i - 1][1]
        return None

    def expect(self, value: str) -> None:
        if self.take(value) is None:
            raise ExprError(f"expected {value!r}, got {self.peek() or 'end of expression'!r}")

    def expr(self) -> tuple[Any, ...]:
        left = self.conj()
        while self.take("||", "or"):
            left = ("or", left, self.conj())
        return left

    def conj(self) -> tuple[Any, ...]:
        left = self.neg()
        while self.take("&&", "and"):
            left = ("and", left, self.neg())
        return left

    def neg(self) -> tuple[Any, ...]:
        if self.take("!", "not"):
            with self.nested():
                return ("not", self.neg())
        return self.compare()

    def compare(self) -> tuple[Any, ...]:
        left = self.sum()
        op = self.take("<", "<=", ">", ">=", "==", "!=")
        if op is None:
            return left
        node = ("cmp", op, left, self.sum())
        if self.peek() in ("<", "<=", ">", ">=", "==", "!="):
            raise ExprError("chained comparisons are not allowed: join them with &&")
        return node

    def sum(self) -> tuple[Any, ...]:
        left = self.product()
        while (op := self.take("+", "-")) is not None:
            left = ("arith", op, left, self.product())
        return left

    def product(self) -> tuple[Any, ...]:
        left = self.unary()
        while (op := self.take("*", "/")) is not None:
            left = ("arith", op, left, self.unary())
        return left

    def unary(self) -> tuple[Any, ...]:
        if self.take("-"):
            with self.nested():
                return ("neg", self.unary())
        return self.atom()

    def atom(self) -> tuple[Any, ...]:
        if self.i >= len(self.toks):
            raise ExprError("unexpected end of expression")
        kind, value = self.toks[self.i]
        self.i += 1
        if kind == "number":
            number = float(value)
            if not math.isfinite(number):
                raise ExprError(f"number {value} out of range")
            return ("num", number)
        if value == "result":
            return ("result",)
        if value in ("true", "false"):
            return ("bool", value == "true")
        if value == "(":
            with self.nested():
                inner = self.expr()
                self.expect(")")
            return inner
        if value in _FUNCTIONS:
            self.expect("(")
            with self.nested():
                args = [self.expr()]
                while self.take(","):
                    args.append(self.expr())
                self.expect(")")
            lo, hi = _FUNCTIONS[value]
            if not lo <= len(args) <= hi:
                raise ExprError(f"{value}() takes {lo}" + (f" to {hi}" if hi != lo else "") + " arguments")
            return ("call", value, tuple(args))
        raise ExprError(f"unexpected {value!r}")


def _number(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, float):
        raise ExprError(f"{what} needs a number, got {str(v).lower()}")
    return v


def _eval(node: tuple[Any, ...], result: float) -> Any:
    tag = node[0]
    if tag == "num":
        return node[1]
    if tag == "bool":
        return node[1]
    if tag == "result":
        return float(result)
    if tag == "neg":
        return -_number(_eval(node[1], result), "-")
    if tag == "not":
        v = _eval(node[1], result)
        if not isinstance(v, bool):
            raise ExprError("! needs a boolean")
        return not v
    if tag in ("and", "or"):
        left = _eval(node[1], result)
        if not isinstance(left, bool):
            raise ExprError(f"{tag} needs booleans")
        if (tag == "and" and not left) or (tag == "or" and left):
            return left
        right = _eval(node[2], result)
        if not isinstance(right, bool):
            raise ExprError(f"{tag} needs booleans")
        return right
    if tag == "cmp":
        op, a, b = node[1], _eval(node[2], result), _eval(node[3], result)
        if op in ("==", "!=") and isinstance(a, bool) and isinstance(b, bool):
            return (a == b) if op == "==" else (a != b)
        a, b = _number(a, op), _number(b, op)
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b, "==": a == b, "!=": a != b}[op]
    if tag == "arith":
        op, a, b = node[1], _number(_eval(node[2], result), node[1]), _number(_eval(node[3], result), node[1])
        if op == "/" and b == 0:
            raise ExprError("division by zero")
        return {"+": a + b, "-": a - b, "*": a * b, "/": a / b if b else 0.0}[op]
    if tag == "call":
        args = [_number(_eval(a, result), f"{node[1]}()") for a in node[2]]
        return abs(args[0]) if node[1] == "abs" else (min(args) if node[1] == "min" else max(args))
    raise ExprError(f"bad node {tag}")  # unreachable: the parser builds only the tags above


@dataclass(frozen=True)
class Condition:
    """A parsed condition; ``evaluate(result)`` → bool (raises :class:`ExprError`)."""

    text: str
    tree: tuple[Any, ...]

    def evaluate(self, result: float) -> bool:
        try:
            value = _eval(self.tree, result)
        except RecursionError:  # a long chain evaluated deep in the caller's stack
            raise ExprError(f"{self.text!r} is too deeply nested to evaluate") from None
        if not isinstance(value, bool):
            raise ExprError(f"{self.text!r} is a number, not a condition (compare it, e.g. result < 0.05)")
        return value


def parse_condition(text: str) -> Condition:
    """Parse a condition; raises :class:`ExprError` naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ExprError("empty expression")
    if len(text) > MAX_EXPRESSION_LENGTH:
        raise ExprError(f"longer than {MAX_EXPRESSION_LENGTH} characters")
    try:
        p = _Parser(text)
        tree = p.expr()
        if p.peek() is not None:
            raise ExprError(f"unexpected {p.peek()!r} after a complete expression")
        if not _mentions_result(tree):
            raise ExprError("the condition never reads result")
        kind = _type(tree)
    except RecursionError:  # a long operator chain parsed deep in the caller's stack
        raise ExprError("too deeply nested") from None
    if kind != "bool":
        raise ExprError("the expression is a number, not a condition (compare it, e.g. result < 0.05)")
    return Condition(text=text, tree=tree)


def _mentions_result(node: tuple[Any, ...]) -> bool:
    if node[0] == "result":
        return True
    if node[0] == "call":
        return any(_mentions_result(arg) for arg in node[2])
    return any(_mentions_result(c) for c in node[1:] if isinstance(c, tuple))


def _type(node: tuple[Any, ...]) -> str:
    """Static type of a subtree ("num" or "bool"); a mismatch is a parse error, not a late surprise."""
    tag = node[0]
    if tag in ("num", "result"):
        return "num"
    if tag == "bool":
        return "bool"

    def want(sub: tuple[Any, ...], kind: str, what: str) -> None:
        if _type(sub) != kind:
            raise ExprError(f"{what} needs {'a number' if kind == 'num' else 'a boolean'}")

    if tag == "neg":
        want(node[1], "num", "-")
        return "num"
    if tag == "not":
        want(node[1], "bool", "!")
        return "bool"
    if tag in ("and", "or"):
        want(node[1], "bool", "&&" if tag == "and" else "||")
        want(node[2], "bool", "&&" if tag == "and" else "||")
        return "bool"
    if tag == "cmp":
        left, right = _type(node[2]), _type(node[3])
        if node[1] in ("==", "!=") and left == right:
            return "bool"
        if left != "num" or right != "num":
            raise ExprError(f"{node[1]} needs numbers on both sides")
        return "bool"
    if tag == "arith":
        want(node[2], "num", node[1])
        want(node[3], "num", node[1])
        return "num"
    for arg in node[2]:  # call
        want(arg, "num", f"{node[1]}()")
    return "num"


# ---------------------------------------------------------------- JSON selection

# The CRD's jsonPath pattern (gateconfigs.yaml) admits exactly these segments: a quoted key may hold
# any character but its own quote (`]` and the other quote included).
_SEGMENT = re.compile(r"""\.(?P<name>[A-Za-z_][A-Za-z0-9_-]*)|\[(?P<index>[0-9]+)\]|\['(?P<key>[^']+)'\]|\["(?P<dkey>[^"]+)"\]""")


@dataclass(frozen=True)
class JsonPath:
    text: str
    steps: tuple[str | int, ...]

    def select(self, doc: Any) -> Any:
        """The value at the path; raises :class:`ExprError` saying which step is missing."""
        cur = doc
        walked = "$"
        for step in self.steps:
            if isinstance(step, int):
                if not isinstance(cur, Sequence) or isinstance(cur, str) or step >= len(cur):
                    raise ExprError(f"{walked} has no item [{step}]")
                cur = cur[step]
                walked += f"[{step}]"
            else:
                if not isinstance(cur, Mapping) or step not in cur:
                    raise ExprError(f"{walked} has no field {step!r}")
                cur = cur[step]
                walked += f".{step}"
        return cur


def parse_json_path(text: str) -> JsonPath:
    """``$.a.b[0]``, ``a.b``, ``{$.a['b']}`` → :class:`JsonPath`; raises :class:`ExprError`."""
    raw = text.strip()
    if raw.startswith("{") and raw.endswith("}"):
        raw = raw[1:-1].strip()
    if raw.startswith("$"):
        raw = raw[1:]
    if raw and not raw.startswith((".", "[")):
        raw = "." + raw
    steps: list[str | int] = []
    pos = 0
    while pos < len(raw):
        m = _SEGMENT.match(raw, pos)
        if m is None:
            raise ExprError(f"cannot parse jsonPath {text!r} at {raw[pos:]!r} (e.g. $.data.score or $.items[0].value)")
        steps.append(int(m.group("index")) if m.group("index") is not None
                     else (m.group("name") or m.group("key") or m.group("dkey")))
        pos = m.end()
    return JsonPath(text=text, steps=tuple(steps))
