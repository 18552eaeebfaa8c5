"""The README stays true: its CRD reference is generated from the chart's CRDs, its commands exist, the
metrics the docs name are defined in code, and its CRD fuzz counts are the generator's."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

from crd_fuzz_loader import crd_fuzz_cases

ROOT = Path(__file__).resolve().parents[3]


def test_crd_reference_is_generated_from_the_crds() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "dev" / "crdref.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_readme_commands_exist_and_ci_runs_the_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    for script in ("./dev/demo.sh", "./dev/test.sh"):
        assert script in readme
        assert os.access(ROOT / script, os.X_OK), f"{script} is not executable"
    assert "./dev/test.sh" in (ROOT / ".ci" / "run").read_text()


# Backticked metric names (`sparsegate_x` or `sparsegate_x{labels}`) in the user-facing docs.
_METRIC_DOCS = ("README.md", "charts/sparsegate/README.md", "charts/sparsegate/values.yaml")
_METRIC = re.compile(r"`(sparsegate_[a-z0-9_]+)(?:\{[^`]*\})?`")
_CODE_DIRS = ("operator", "workloads", "ebpf")


def _code_strings() -> set[str]:
    """Every string literal of the operator's, model server's and agent's Python source."""
    found: set[str] = set()
    for top in _CODE_DIRS:
        for path in (ROOT / top).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str):
                    found.add(node.value)
    return found


def test_every_metric_the_docs_name_is_defined_in_code() -> None:
    packages = {p.name for top in _CODE_DIRS for p in (ROOT / top).iterdir() if p.is_dir()}
    strings = _code_strings()
    missing = []
    for doc in _METRIC_DOCS:
        for name in sorted(set(_METRIC.findall((ROOT / doc).read_text())) - packages):
            # prometheus_client appends _total to a Counter named without it.
            if name not in strings and name.removesuffix("_total") not in strings:
                missing.append(f"{doc}: {name}")
    assert not missing, f"metrics the docs name that no code defines: {missing}"


def _hand_written_crd_cases() -> int:
    """len(INVALID) of tests/e2e/operator/test_crd_validation.py, read without importing it."""
    tree = ast.parse((ROOT / "tests" / "e2e" / "operator" / "test_crd_validation.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INVALID" for t in node.targets):
            return len(node.value.elts)
    raise AssertionError("test_crd_validation.py has no INVALID list")


def test_readme_crd_fuzz_counts_are_the_generator_s() -> None:
    fuzz = crd_fuzz_cases()
    schemas = fuzz.load_schemas(ROOT / "charts" / "sparsegate" / "crds")
    examples = fuzz.load_examples(ROOT / "examples")
    cases = fuzz.invalid_cases(schemas, examples)
    by_kind, by_cat = fuzz.counts(cases)
    readme = " ".join((ROOT / "README.md").read_text().split())  # one line: sentences wrap anywhere
    bad_input = readme[readme.index("Bad input, by interface"):][:1200]  # the "Faults and bad input" paragraph
    stated = {
        "fuzzed invalid objects": re.search(r"(\d+) fuzzed invalid objects", readme),  # the e2e tier's line
        "seeded invalid objects": re.search(r"\*\*(\d+)\*\* seeded invalid objects", bad_input),
        "hand-written cases": re.search(r"plus (\d+) hand-written cases", bad_input),
        "valid edge objects": re.search(r"(\d+) valid edge objects", bad_input),
    }
    for kind in fuzz.KINDS:
        stated[kind] = re.search(rf"{kind} (\d+)\b", bad_input)
    for words, category in (("wrong types", "wrong_type"), ("bad formats", "bad_format"),
                            ("out of range", "out_of_range"), ("over-long strings", "too_long"),
                            ("fieldValidation=Strict`", "unknown_field"), ("CEL cross-field rules", "cross_field"),
                            ("missing required", "missing_required")):
        stated[category] = re.search(rf"{re.escape(words)} (\d+)", bad_input)
    sizes = re.search(r"oversized / undersized arrays and maps (\d+) / (\d+)", bad_input)
    unstated = [k for k, m in stated.items() if m is None] + ([] if sizes else ["oversized / undersized"])
    assert not unstated, f"README no longer states these CRD fuzz counts as this test reads them: {unstated}"
    actual = {"fuzzed invalid objects": len(cases), "seeded invalid objects": len(cases),
              "hand-written cases": _hand_written_crd_cases(),
              "valid edge objects": len(fuzz.valid_edges(schemas, examples)), **by_kind, **by_cat}
    said = {k: int(m.group(1)) for k, m in stated.items()}
    said["oversized"], said["undersized"] = int(sizes.group(1)), int(sizes.group(2))
    assert said == {k: actual[k] for k in said}, "update README's 'Bad input' paragraph and the e2e tier line"
