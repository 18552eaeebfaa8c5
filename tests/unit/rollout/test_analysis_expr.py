"""The condition language and JSON selection of declared analysis checks (domain.analysis_expr)."""

from __future__ import annotations

import re

import pytest

from sparsegate.domain.analysis_expr import MAX_EXPRESSION_LENGTH, ExprError, parse_condition, parse_json_path


@pytest.mark.parametrize(("text", "result", "expected"), [
    ("result < 0.05", 0.01, True),
    ("result < 0.05", 0.05, False),
    ("result <= 0.05", 0.05, True),
    ("result >= 0.9 && result <= 1", 0.95, True),
    ("result >= 0.9 && result <= 1", 1.5, False),
    ("result >= 0.9 and result <= 1", 0.5, False),
    ("result < 1 || result > 9", 10, True),
    ("result < 1 or result > 9", 5, False),
    ("!(result > 2)", 1, True),
    ("not result > 2", 3, False),
    ("abs(result - 1) < 0.1", 1.05, True),
    ("abs(result - 1) < 0.1", 0.8, False),
    ("min(result, 10) == 10", 12, True),
    ("max(result, 0, -1) > 0", -3, False),
    ("result * 100 / 4 == 25", 1, True),
    ("-result > -1", 0.5, True),
    ("result != 0", 0, False),
    ("1e-3 > result", 0.0001, True),
    ("(result > 1) == true", 2, True),
    ("result > .5", 0.6, True),
])
def test_conditions_evaluate(text: str, result: float, expected: bool) -> None:
    assert parse_condition(text).evaluate(float(result)) is expected


@pytest.mark.parametrize(("text", "why"), [
    ("", "empty"),
    ("   ", "empty"),
    ("result", "not a condition"),
    ("result + 1", "not a condition"),
    ("1 < 2", "never reads result"),
    ("true", "never reads result"),
    ("result <", "end of expression"),
    ("result < 1 < 2", "chained"),
    ("(result < 1", "expected ')'"),
    ("result < 1)", "after a complete expression"),
    ("x > 1", "unknown name 'x'"),
    ("__import__('os').system('id') == 0", "unknown name '__import__'"),
    ("result.__class__ == 1", "unexpected character '.'"),
    ("result[0] > 1", "unexpected character '['"),
    ("result < 1; result > 2", "unexpected character ';'"),
    ("result = 1", "unexpected character '='"),
    ("'a' == result", "unexpected character"),
    ("result + true > 1", "+ needs a number"),
    ("!result", "! needs a boolean"),
    ("result && true", "&& needs a boolean"),
    ("result < true", "< needs numbers"),
    ("abs(result, 1) > 0", "abs() takes 1"),
    ("min(result) > 0", "min() takes 2"),
    ("abs(result > 1) > 0", "abs() needs a number"),
    ("result > 1e999", "out of range"),
    ("result > " + "1" * MAX_EXPRESSION_LENGTH, "longer than"),
    # Within the schema's 256 characters: deep nesting is refused by name, never a RecursionError.
    ("(" * 123 + "result<1" + ")" * 123, "nested more than 32 levels"),
    ("!" * 200 + "(result < 1)", "nested more than 32 levels"),
    ("-" * 200 + "result < 1", "nested more than 32 levels"),
])
def test_rejected_conditions_say_why(text: str, why: str) -> None:
    with pytest.raises(ExprError, match=re.escape(why)):
        parse_condition(text)


def test_division_by_zero_is_an_evaluation_error() -> None:
    cond = parse_condition("1 / result > 2")
    assert cond.evaluate(0.25) is True
    with pytest.raises(ExprError, match="division by zero"):
        cond.evaluate(0.0)


def test_and_or_short_circuit() -> None:
    # The right side is not evaluated when the left decides (no division by zero here).
    assert parse_condition("result == 0 || 1 / result > 2").evaluate(0.0) is True
    assert parse_condition("result != 0 && 1 / result > 2").evaluate(0.0) is False


@pytest.mark.parametrize(("path", "doc", "value"), [
    ("$.data.score", {"data": {"score": 0.93}}, 0.93),
    ("data.score", {"data": {"score": 1}}, 1),
    ("{$.data.items[1].p99}", {"data": {"items": [{}, {"p99": 120}]}}, 120),
    ("$['weird key'][0]", {"weird key": [7]}, 7),
    ("$", {"a": 1}, {"a": 1}),
    ("$[0]", [3, 4], 3),
])
def test_json_paths_select(path: str, doc: object, value: object) -> None:
    assert parse_json_path(path).select(doc) == value


def test_json_path_errors_name_the_missing_step() -> None:
    p = parse_json_path("$.data.items[2].v")
    with pytest.raises(ExprError, match=r"\$\.data has no field 'items'"):
        p.select({"data": {}})
    with pytest.raises(ExprError, match=r"\$\.data\.items has no item \[2\]"):
        p.select({"data": {"items": [1]}})
    for bad in ("$.a[*]", "$..a", "$.a[?(@.b)]", "a b"):
        with pytest.raises(ExprError, match="cannot parse jsonPath"):
            parse_json_path(bad)


def test_the_longest_operator_chain_parses_and_evaluates_deep_in_a_call_stack() -> None:
    """A left-deep chain as long as the schema allows, parsed where the operator's tick runs (a few
    hundred frames deep): an answer or an ExprError, never a RecursionError out of the tick."""
    text = "1+" * 124 + "result<1"
    assert len(text) == MAX_EXPRESSION_LENGTH

    def deep(n: int) -> bool:
        return deep(n - 1) if n else parse_condition(text).evaluate(-200.0)

    for frames in (100, 400):
        assert deep(frames) is True
    try:
        answer = deep(900)
    except ExprError as e:
        assert "too deeply nested" in str(e)
    else:
        assert answer is True  # an answer, when there is one, is the right one


def test_json_paths_the_crd_accepts_are_the_ones_the_operator_parses() -> None:
    """What the schema accepts, the operator accepts: the CRD's jsonPath pattern and
    parse_json_path agree on paths at and around the grammar's edges."""
    from pathlib import Path

    import yaml

    from sparsegate.domain.analysis_expr import parse_json_path

    crd = yaml.safe_load((Path(__file__).resolve().parents[3] / "charts" / "sparsegate" / "crds" /
                          "gateconfigs.yaml").read_text())
    pattern = re.compile(_jsonpath_pattern(crd))
    paths = ["$.data.score", "data.items[0].value", "{$.data['p99']}", "$['p99]']", "$['say\"hi']", '$["it\'s"]',
             "{$.score", "$.score}", "{$.score}", "$", "", "$.a-b", "$.1a", "$[01]", "$['']", "$..a", "$.a b",
             "$['a'].b[2][\"c d\"]", "{data}"]
    for path in paths:
        try:
            parse_json_path(path)
            parsed = True
        except ExprError:
            parsed = False
        assert bool(pattern.fullmatch(path)) == parsed, (path, parsed)


def _jsonpath_pattern(crd: dict) -> str:
    props = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    checks = props["rollout"]["properties"]["analysis"]["properties"]["checks"]["items"]["properties"]
    return checks["provider"]["properties"]["web"]["properties"]["jsonPath"]["pattern"]
