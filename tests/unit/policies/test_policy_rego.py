"""The Rego unit tests (`policies/**/src_test.rego`), run by the real `opa test`."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from localcluster.binaries import find_binary

REPO = Path(__file__).resolve().parents[3]


def _opa() -> str:
    return str(find_binary("opa"))  # a missing binary errors with the command that builds it


@pytest.mark.opa
def test_opa_test_passes() -> None:
    run = subprocess.run([_opa(), "test", str(REPO / "policies"), "-v"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    passed = re.search(r"PASS: (\d+)/(\d+)", run.stdout)
    assert passed and passed.group(1) == passed.group(2) and int(passed.group(1)) >= 15, run.stdout


@pytest.mark.opa
def test_rego_tests_cover_the_policy() -> None:
    run = subprocess.run([_opa(), "test", str(REPO / "policies"), "--coverage", "--format", "json"],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(run.stdout)
    src = next(v for k, v in report["files"].items() if k.endswith("routing/src.rego"))
    assert src["coverage"] >= 99, src.get("not_covered")


@pytest.mark.opa
def test_rego_is_formatted_and_v1() -> None:
    run = subprocess.run([_opa(), "fmt", "--list", "--fail", str(REPO / "policies")], capture_output=True, text=True)
    assert run.returncode == 0, f"not `opa fmt`-clean: {run.stdout}{run.stderr}"
    check = subprocess.run([_opa(), "check", "--strict", str(REPO / "policies")], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
