"""Numbers from the operator's environment: a clear error naming the variable, not a bare float()
error or a loop that never waits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sparsegate import envvars


@pytest.mark.parametrize("raw, value", [(None, 5.0), ("", 5.0), (" ", 5.0), ("0.5", 0.5), ("10", 10.0)])
def test_seconds_reads_a_positive_number_or_the_default(raw, value) -> None:
    env = {} if raw is None else {"X_S": raw}
    assert envvars.seconds("X_S", 5.0, env=env) == value


@pytest.mark.parametrize("raw", ["10s", "0", "-5", "nan", "inf", "five"])
def test_seconds_refuses_what_would_crash_or_spin_naming_the_variable(raw) -> None:
    with pytest.raises(ValueError, match=f"X_S: must be a positive number of seconds .* got '{raw}'"):
        envvars.seconds("X_S", 5.0, env={"X_S": raw})


def test_the_operator_stops_at_import_naming_a_bad_variable() -> None:
    proc = subprocess.run([sys.executable, "-c", "import sparsegate.handlers.routingpolicy"],
                          env={**os.environ, "SPARSEGATE_POLICY_RESYNC_SECONDS": "10s"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "ValueError: SPARSEGATE_POLICY_RESYNC_SECONDS: must be a positive number of seconds (e.g. 5 or 0.5), "
        "got '10s'")
