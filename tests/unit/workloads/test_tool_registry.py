"""The tool registry without a server: the calculator's parser (and what it refuses), tool
declarations (errors name the field), argument extraction, and the audit record's shape."""

import asyncio
import json
import logging

import pytest

from sparsegate_workload import tools
from sparsegate_workload.tools import CalculatorError, ToolRegistry, ToolSpecError


@pytest.mark.parametrize("expr, value", [
    ("2+3*4", "14"), ("(2+3)*4", "20"), ("2**10", "1024"), ("-2**2", "-4"), ("7//2", "3"),
    ("7 % 3", "1"), ("1/4", "0.25"), ("10/4*2", "5"), ("0.1+0.2", "0.3"), ("--3", "3"),
    (" 12 ", "12"), ("2**-1", "0.5"), ("(" * 60 + "7" + ")" * 60, "7"), ("-" * 60 + "5", "5"),
])
def test_calculator_evaluates_arithmetic(expr, value):
    assert tools.calculate(expr) == value


@pytest.mark.parametrize("expr, reason", [
    ("__import__('os')", "unexpected character '_'"),
    ("2+", "ends too early"),
    ("1/0", "division by zero"),
    ("9**99", "exponent 99 exceeds 64"),
    ("(((2)", "expected '\\)'|ends too early"),
    ("2 3", "unexpected '3' after the expression"),
    ("", "empty expression"),
    ("1" + "0" * 120, "exceeds 1e\\+100"),
    ("1+" * 200 + "1", "longer than 256"),
    ("(-8)**0.5", "not a real number"),
    ("1" + "0" * 99 + ".0**4", "exceeds 1e\\+100"),  # a float power past float range (OverflowError: a 500)
    ("(" * 200 + "1", "nested deeper than 64"),  # RecursionError past Python's limit: a 500
    ("(-" * 100 + "1", "nested deeper than 64"),
    ("2**" * 70 + "1", "nested deeper than 64"),
])
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr, reason):
    with pytest.raises(CalculatorError, match=reason):
        tools.calculate(expr)


@pytest.mark.parametrize("raw, message", [
    ({"name": "x"}, "tools must be a list"),
    ([{"name": "Bad_Name", "url": "http://a"}], r"tools\[0\].name must be a DNS-1123 label"),
    ([{"name": "calculator", "url": "http://a"}], "built-in tool's"),
    ([{"name": "a", "url": "http://a"}, {"name": "a", "url": "http://b"}],
     r"tools\[1\].name 'a' is declared twice"),
    ([{"name": "a", "url": "ftp://a"}], r"tools\[0\].url must be an http:// or https:// URL"),
    ([{"name": "a", "url": "http://a", "timeoutMs": 0}], r"tools\[0\].timeoutMs must be"),
    ([{"name": "a", "url": "http://a", "timeoutMs": 20000}], r"tools\[0\].timeoutMs must be"),
    ([{"name": "a", "url": "http://a", "extra": 1}], "unknown fields extra"),
])
def test_tool_declarations_are_checked_naming_the_field(raw, message):
    with pytest.raises(ToolSpecError, match=message):
        tools.parse_tools(raw)


def test_registry_selects_by_segment():
    reg = ToolRegistry(http=tools.parse_tools([{"name": "echo", "url": "http://127.0.0.1:1"}]))
    assert reg.names == ("calculator", "echo")
    assert reg.select(tools.segment_text(list(b"old\nwhat is 2+3="))) == ("calculator", "2+3")
    assert reg.select("echo: hello") == ("echo", "hello")
    assert reg.select("other: hello") is None   # undeclared names call nothing
    assert reg.select("no trigger") is None
    assert reg.select("abc=") is None   # nothing arithmetic before '=': no call
    assert reg.select("x 1+=") == ("calculator", "1+")   # called, then refused by the parser
    assert tools.segment_text([ord("a"), 300, ord("b")]) == "b"  # ids >= 256 end a segment
    assert tools.result_tokens("14", vocab_size=512) == [49, 52]
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tools.result_tokens("14", vocab_size=50)


def test_audit_record_has_every_field_and_never_the_arguments(caplog):
    caplog.set_level(logging.INFO, logger="sparsegate.tools")

    async def go():
        import aiohttp
        async with aiohttp.ClientSession() as session:
            return await tools.call(ToolRegistry(), session, tool="calculator",
                                    arguments="6*7", request_id="r1", sequence=0, position=4,
                                    gate_probability=0.9, vocab_size=512, metrics=None)
    record = asyncio.run(go())
    assert record.outcome == "ok" and record.tokens == list(b"42")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "sparsegate.tools"]
    audit = json.loads(line.split(" ", 2)[2])
    assert set(audit) == {"requestId", "sequence", "position", "gateProbability", "tool",
                          "argumentsDigest", "latencyMs", "outcome", "detail"}
    assert audit["argumentsDigest"] == tools.digest("6*7") and "6*7" not in line
    assert (audit["requestId"], audit["position"], audit["tool"]) == ("r1", 4, "calculator")
