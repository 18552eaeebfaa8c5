"""tests/bench/operator_profile.py: py-spy's collapsed stacks summed by package and function, and
a real py-spy recording of a real Python process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import operator_profile  # noqa: E402


@pytest.mark.parametrize("frame, package", [
    ("_run_once (asyncio/base_events.py:1922)", "asyncio"),
    ("raw_decode (json/decoder.py:353)", "json"),
    ("select (selectors.py:468)", "selectors"),
    ("process_resource_event (kopf/_core/reactor/processing.py:77)", "kopf"),
    ("reconcile (/work/main/operator/sparsegate/handlers/modelsync.py:120)", "sparsegate.handlers"),
    ("after_reconcile (sparsegate/domain/model_status.py:40)", "sparsegate.domain"),
    ("run (/usr/lib/python3.11/threading.py:975)", "threading"),
    ("_run_once (/usr/lib/python3.11/asyncio/base_events.py:1922)", "asyncio"),
    ("request (/venv/lib/python3.11/site-packages/urllib3/_request_methods.py:118)", "urllib3"),
    ("<module>", "<builtin>"),
])
def test_package_of_a_frame(frame: str, package: str) -> None:
    assert operator_profile.package(frame) == package


def test_breakdown_sums_inclusive_and_self_shares() -> None:
    raw = textwrap.dedent("""\
        run (threading.py:975);reconcile (sparsegate/handlers/modelsync.py:120);apply (kubernetes/client/api_client.py:40) 6
        run (threading.py:975);reconcile (sparsegate/handlers/modelsync.py:121) 2
        _run_once (asyncio/base_events.py:1922);raw_decode (json/decoder.py:353) 2
        """)
    out = operator_profile.breakdown(raw)
    assert out["samples"] == 10 and out["seconds"] == 0.1
    assert out["packageInclusive"] == {"threading": 0.8, "sparsegate.handlers": 0.8, "kubernetes": 0.6,
                                       "asyncio": 0.2, "json": 0.2}
    assert out["packageSelf"] == {"kubernetes": 0.6, "sparsegate.handlers": 0.2, "json": 0.2}
    # Line numbers dropped: both reconcile lines are one function.
    assert out["topSparsegateFunctions"] == {"reconcile (sparsegate/handlers/modelsync.py)": 0.8}
    assert next(iter(out["topLeafFunctions"])) == "apply (kubernetes/client/api_client.py)"


def test_records_a_real_process_and_finds_its_busy_function(tmp_path: Path) -> None:
    busy = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""\
        import time
        def spin_in_python():
            end = time.monotonic() + 30
            while time.monotonic() < end:
                sum(i * i for i in range(1000))
        spin_in_python()
        """)])
    try:
        output = tmp_path / "profile.txt"
        out = operator_profile.result(operator_profile.start(busy.pid, seconds=2, output=output), output)
    finally:
        busy.kill()
        busy.wait()
    assert out["samples"] > 50  # ~100 a second while it holds the GIL
    assert any(name.startswith("spin_in_python") or name.startswith("<genexpr>")
               for name in out["topLeafFunctions"])
