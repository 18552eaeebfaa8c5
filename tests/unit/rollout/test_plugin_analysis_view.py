"""kubectl sparsegate's view of status.analysisRuns, and resume/retry around an inconclusive pause."""

from __future__ import annotations

import pytest

from sparsegate.domain.analysis_run import Measured, RunPhase, finish, judge, new_run, parse_checks, record
from sparsegate.domain.rollout import annotation_requests
from sparsegate.kubectl_plugin import view


def paused_gateconfig() -> dict:
    errors, quality, builtin = parse_checks({"checks": [
        {"name": "errors", "provider": {"prometheus": {"query": "q"}}, "successCondition": "result < 0.05",
         "count": 2},
        {"name": "quality", "provider": {"web": {"url": "http://j/s"}}, "successCondition": "result >= 0.9",
         "failureCondition": "result < 0.5", "dryRun": True},
        {"name": "builtin", "provider": {"builtin": {}}},
    ]})
    run = new_run((errors, quality, builtin), step=1, percent=5, canary_version="g-new", now=100.0)
    run = record(run, errors, judge(errors, Measured(value=0.01), now=110))
    run = record(run, errors, judge(errors, Measured(error="HTTP 503"), now=120))
    run = record(run, quality, judge(quality, Measured(value=0.7), now=110))
    run = finish(run, RunPhase.INCONCLUSIVE, "check quality inconclusive", now=121)
    return {"metadata": {"name": "gate", "namespace": "ns"}, "spec": {"rollout": {"steps": [5, 100]}},
            "status": {"stable": {"version": "g-old"}, "analysisRuns": [run.to_status()],
                       "rollout": {"phase": "Paused", "reason": "AnalysisInconclusive", "analysisPaused": True,
                                   "step": 1, "steps": 2, "canaryPercent": 5, "canaryVersion": "g-new",
                                   "canaryInstances": "1/20", "message": "step 1 (5%) analysis inconclusive"}}}


def test_get_shows_declared_check_values() -> None:
    text = view.get_table([paused_gateconfig()])
    header, line = text.splitlines()
    assert header.split()[-1] == "ANALYSIS"
    # Latest value per declared check: errors' latest was an error; quality is a dry-run check ("~")
    # that is inconclusive ("?").
    assert line.split()[-2:] == ["errors=error", "?quality=0.7~"]


def test_status_shows_the_latest_analysis_run() -> None:
    text = view.status_view(paused_gateconfig())
    assert "AnalysisRun: step 1 (5%) of g-new: Inconclusive (check quality inconclusive)" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith(("errors", "quality",
                                                                                            "builtin"))}
    assert rows["errors"][:4] == ["errors", "prometheus", "Terminated", "1/0/0/1"]
    assert "0.01 Successful, error Error" in text
    assert rows["quality"][:5] == ["quality", "web", "Inconclusive", "0/0/1/0", "yes"]
    assert rows["builtin"][:4] == ["builtin", "builtin", "Terminated", "0/0/0/0"]


def test_resume_refused_and_retry_allowed_after_an_inconclusive_pause() -> None:
    obj = paused_gateconfig()
    with pytest.raises(view.PluginError, match="inconclusive.*promote.*retry.*abort"):
        view.resume_patch(obj)
    assert annotation_requests(view.retry_patch(obj)["metadata"]["annotations"])["retry"]
    obj["status"]["rollout"]["analysisPaused"] = False  # paused by spec: resume flips the switch
    assert view.resume_patch(obj) == {"spec": {"rollout": {"paused": False}}}
    with pytest.raises(view.PluginError, match="nothing to retry"):
        view.retry_patch(obj)
