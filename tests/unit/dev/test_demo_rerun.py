"""dev/demo.py run again over the cluster a previous run left running."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import demo
from sparsegate_contracts.names import PROMOTE_ANNOTATION


class FakeGate:
    """kubectl for default-gate as a re-run finds it: the re-applied examples (toolGateThreshold 0.85)
    rolling out over the last run's stable (0.9), inconclusive (no load yet)."""

    def __init__(self, *, in_flight: bool) -> None:
        self.calls: list[tuple[str, ...]] = []
        canary = {"version": "g-examples", "params": {"toolGateThreshold": 0.85}}
        self.status = {"observedGeneration": 3, "stable": {"version": "g-last-run", "params": {"toolGateThreshold": 0.9}},
                       "rollout": ({"phase": "Analysing", "step": 0, "canary": canary} if in_flight
                                   else {"phase": "Succeeded"})}

    def __call__(self, *args: str, **kw: object) -> subprocess.CompletedProcess[str]:
        self.calls.append(args)
        out = ""
        if args[0] == "annotate" and f"{PROMOTE_ANNOTATION}=all" in args:
            self.status["stable"] = self.status["rollout"]["canary"]
            self.status["rollout"] = {"phase": "Succeeded"}
        if args[0] == "get":
            out = json.dumps({"metadata": {"generation": 3}, "spec": {"params": {"toolGateThreshold": 0.85}},
                              "status": self.status})
        return subprocess.CompletedProcess(args, 0, out, "")


def test_a_rerun_promotes_the_reset_to_examples_so_its_change_is_a_rollout_not_a_revert(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    d = demo.Demo(tmp_path)
    fake = FakeGate(in_flight=True)
    monkeypatch.setattr(d, "kubectl", fake)
    d.apply_examples()
    assert ("annotate", f"gateconfig/{demo.GATE}", "-n", demo.NS, f"{PROMOTE_ANNOTATION}=all", "--overwrite") \
        in fake.calls
    # The stable version is now the examples' params: the demo's good change (0.85 → 0.9) rolls out.
    assert fake.status["stable"]["params"] == {"toolGateThreshold": 0.85}


def test_a_first_run_promotes_nothing(tmp_path: Path, monkeypatch) -> None:
    d = demo.Demo(tmp_path)
    fake = FakeGate(in_flight=False)
    monkeypatch.setattr(d, "kubectl", fake)
    d.apply_examples()
    assert not [c for c in fake.calls if c[0] == "annotate"]
