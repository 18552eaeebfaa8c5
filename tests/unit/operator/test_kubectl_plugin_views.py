"""kubectl sparsegate: its pure views and patches, and each command against a fake client at our own
boundary (``Client``); the real API server round trip is tests/e2e/operator/test_kubectl_plugin.py."""

from __future__ import annotations

import copy
import functools
import json
from datetime import UTC, datetime
from typing import Any

import pytest

from sparsegate.domain.rollout import (
    ABORT_ANNOTATION,
    PROMOTE_ANNOTATION,
    RETRY_ANNOTATION,
    GateVersion,
    annotation_requests,
)
from sparsegate.kubectl_plugin import run, view

V1 = {"toolGateThreshold": 0.85, "entropyBeta": 0.1}
V2 = {"toolGateThreshold": 0.8, "entropyBeta": 0.1}
V3 = {"toolGateThreshold": 0.75, "entropyBeta": 0.1}


def doc(params: dict) -> dict[str, Any]:
    return GateVersion.from_params(params).document()


def revision(n: int, params: dict, at: str = "2027-01-01T00:00:00.000Z") -> dict[str, Any]:
    return {"revision": n, **doc(params), "promotedAt": at, "reason": "Promoted"}


def gateconfig(name: str = "gate", namespace: str = "ns", **rollout: Any) -> dict[str, Any]:
    return {
        "apiVersion": "sparsegate.dev/v1alpha1", "kind": "GateConfig",
        "metadata": {"name": name, "namespace": namespace, "generation": 4},
        "spec": {"params": V3, "rollout": {"steps": [10, 50, 100]}},
        "status": {
            "observedGeneration": 4,
            "stable": doc(V2),
            "history": [revision(1, V1), revision(2, V2)],
            "rollout": {"phase": "Analysing", "reason": "Analysing", "message": "step 2/3: analysing",
                        "step": 2, "steps": 3, "canaryPercent": 50, "canaryVersion": doc(V3)["version"],
                        "canary": doc(V3),
                        "canaryInstances": "5/10", "versionCounts": {doc(V3)["version"]: 5, doc(V2)["version"]: 5},
                        "analysis": {"verdict": "Pass", "canaryRequests": 120.0, "canaryQps": 12.0, "checks": [
                            {"name": "errorRate", "value": 0.01, "threshold": 0.02, "passed": True},
                            {"name": "p99LatencyMs", "value": None, "threshold": 800, "passed": True},
                            {"name": "drift", "value": 0.3, "threshold": 0.1, "passed": False}]},
                        **rollout},
            "conditions": [{"type": "Ready", "status": "False", "reason": "Analysing"},
                           {"type": "Reconciling", "status": "True", "reason": "Analysing"}],
        },
    }


# ---------------------------------------------------------------- views


def test_get_table_columns_and_analysis_values() -> None:
    resting = gateconfig("other")
    resting["status"]["rollout"] = {"phase": "Succeeded", "steps": 3}
    text = view.get_table([gateconfig(), resting])
    lines = text.splitlines()
    assert lines[0].split() == ["NAME", "PHASE", "STEP", "CANARY%", "CANARY", "STABLE", "ANALYSIS"]
    assert lines[1].split() == ["gate", "Analysing", "2/3", "50%", doc(V3)["version"], doc(V2)["version"],
                                "errorRate=0.01/0.02", "p99LatencyMs=n/a/800", "!drift=0.3/0.1"]
    assert lines[2].split() == ["other", "Succeeded", "-", "-", "-", doc(V2)["version"], "-"]
    assert all(line == line.rstrip() for line in lines)


def test_get_table_all_namespaces_sorted() -> None:
    text = view.get_table([gateconfig("b", "ns2"), gateconfig("a", "ns2"), gateconfig("z", "ns1")],
                          with_namespace=True)
    assert [line.split()[:2] for line in text.splitlines()] == [
        ["NAMESPACE", "NAME"], ["ns1", "z"], ["ns2", "a"], ["ns2", "b"]]


def test_status_view_steps_analysis_conditions_history() -> None:
    text = view.status_view(gateconfig(), now=datetime(2027, 1, 1, 2, 0, tzinfo=UTC))
    assert "Phase:      Analysing (Analysing)" in text
    assert f"Canary:     {doc(V3)['version']}  50% target, 5/10 instances" in text
    steps = [line.split() for line in text.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])
             and "%" in line]
    assert steps == [["1", "10%", "done"], ["2", "50%", "<-", "Analysing"], ["3", "100%", "pending"]]
    assert any(line.split() == ["drift", "0.3", "0.1", "FAIL"] for line in text.splitlines())
    assert any(line.split() == ["Reconciling", "True", "Analysing"] for line in text.splitlines())
    history = [line.split() for line in text.splitlines() if line.startswith(("1 ", "2 ")) and "g-" in line]
    assert history == [["2", doc(V2)["version"], "Promoted", "2h", "stable"], ["1", doc(V1)["version"], "Promoted", "2h"]]


def test_checks_not_evaluated_or_undecided_are_not_shown_as_failures() -> None:
    obj = gateconfig()
    obj["status"]["rollout"]["analysis"]["checks"] = [
        {"name": "errorRate", "value": 0.0, "threshold": 0.02, "passed": True},
        {"name": "drift", "value": 0.11, "threshold": 0.1, "passed": None, "undecided": True},
        {"name": "qualityDrop", "value": None, "threshold": 0.02, "passed": None}]
    lines = view.status_view(obj, now=datetime(2027, 1, 1, 2, 0, tzinfo=UTC)).splitlines()
    assert any(line.split() == ["drift", "0.11", "0.1", "undecided"] for line in lines)
    assert any(line.split() == ["qualityDrop", "n/a", "0.02", "n/a"] for line in lines)
    assert not any("FAIL" in line for line in lines)
    assert view.analysis_summary(obj["status"]["rollout"]["analysis"]) == (
        "errorRate=0/0.02 ?drift=0.11/0.1 qualityDrop=n/a/0.02")


def test_status_view_of_a_fresh_object() -> None:
    obj = {"metadata": {"name": "g", "namespace": "ns"}, "spec": {"params": V1}}
    text = view.status_view(obj)
    assert "Phase:      Pending" in text and "100%" in text  # the default steps, none current


def test_patches_are_what_the_operator_reads() -> None:
    assert view.pause_patch(True) == {"spec": {"rollout": {"paused": True}}}
    # The operator's own parser turns each annotation into the intended request.
    analysing = gateconfig()  # a canary in flight: promote and abort apply
    full = view.promote_patch(analysing, full=True)["metadata"]["annotations"]
    step = view.promote_patch(analysing, full=False)["metadata"]["annotations"]
    assert annotation_requests(full)["promote"] and not annotation_requests(full)["promote_step"]
    assert annotation_requests(step)["promote_step"] and not annotation_requests(step)["promote"]
    assert annotation_requests(view.abort_patch(analysing)["metadata"]["annotations"])["abort"]
    rolled_back = gateconfig(phase="RolledBack", rejectedVersion=doc(V3)["version"])  # the spec still names it
    assert annotation_requests(view.retry_patch(rolled_back)["metadata"]["annotations"])["retry"]
    assert {PROMOTE_ANNOTATION, ABORT_ANNOTATION, RETRY_ANNOTATION} == {
        *full, *view.abort_patch(analysing)["metadata"]["annotations"], *view.retry_patch(rolled_back)["metadata"]["annotations"]}


def test_promote_and_abort_refused_without_a_canary_in_flight() -> None:
    """The operator clears promote and abort unused when no canary is out: the plugin refuses
    them with the phase instead of printing "requested"."""
    analysing = gateconfig()
    assert view.promote_patch(analysing, full=False) and view.abort_patch(analysing)
    for phase in ("Succeeded", "RolledBack", "Aborted"):
        resting = gateconfig(phase=phase, canary=None)
        with pytest.raises(view.PluginError, match=f"nothing to promote: no canary version is in flight \\(phase {phase}\\)"):
            view.promote_patch(resting, full=True)
        with pytest.raises(view.PluginError, match="nothing to abort"):
            view.abort_patch(resting)


@pytest.mark.parametrize("how", ["last-applied", "server-side-apply"])
@pytest.mark.parametrize(("argv", "annotation", "rollout"), [
    (["promote", "gate"], PROMOTE_ANNOTATION, {}),
    (["promote", "gate", "--full"], PROMOTE_ANNOTATION, {}),
    (["abort", "gate"], ABORT_ANNOTATION, {}),
    (["retry", "gate"], RETRY_ANNOTATION, {"phase": "Paused", "analysisPaused": True}),
])
def test_requests_whose_annotation_git_declares_are_refused_and_nothing_is_written(
        monkeypatch, capsys, how: str, argv: list[str], annotation: str, rollout: dict[str, Any]) -> None:
    """An annotation an applier declares acts once per value and stays (status.rollout.handledRequests):
    the plugin's constant value ("step", "full", "kubectl-sparsegate") was ignored, exit 0 and
    "requested", once already handled; else it acted and Git's value, put back by the next sync or
    apply, acted again (a step promote went on as a full one). Refused, exit 1, nothing written."""
    import sparsegate.kubectl_plugin as plugin

    obj = gateconfig(**rollout)
    obj["metadata"]["annotations"] = {annotation: "now"}
    if how == "last-applied":
        obj["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"] = json.dumps(
            {"metadata": {"annotations": {annotation: "now"}}})
    else:
        obj["metadata"]["managedFields"] = [{"manager": "kustomize-controller", "operation": "Apply", "fieldsV1": {
            "f:metadata": {"f:annotations": {f"f:{annotation}": {}}}}}]
    client = FakeClient([obj])
    monkeypatch.setattr(plugin, "run", functools.partial(run, client_factory=lambda **_: client))
    assert plugin.main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {annotation} is declared by the applied manifest (Git) as 'now'")
    assert err.count("\n") == 1 and client.patches == []
    # Not declared (kubectl annotate's): written as before.
    obj = gateconfig(**rollout)
    obj["metadata"]["annotations"] = {annotation: "now"}
    client, _ = cli(argv, [obj])
    assert [body["metadata"]["annotations"].keys() for _, _, body in client.patches] == [{annotation}]


def test_a_second_step_promote_before_the_operator_took_the_first_is_refused() -> None:
    """`promote NAME` twice (a script skipping two steps; the operator slow or down): the second
    merge patch wrote the same "step" again, a no-op, yet said "promote requested"; one step moved."""
    pending = gateconfig()
    pending["metadata"]["annotations"] = {PROMOTE_ANNOTATION: "step"}
    with pytest.raises(view.PluginError, match="a step promote is already pending"):
        view.promote_patch(pending, full=False)
    assert view.promote_patch(pending, full=True) == {"metadata": {"annotations": {PROMOTE_ANNOTATION: "full"}}}
    pending["metadata"]["annotations"] = {PROMOTE_ANNOTATION: "now"}  # a full promote pending: step is a change
    assert view.promote_patch(pending, full=False) == {"metadata": {"annotations": {PROMOTE_ANNOTATION: "step"}}}


def test_status_watch_of_a_missing_gateconfig_says_not_found() -> None:
    from kubernetes.client.exceptions import ApiException

    class Missing:
        default_namespace = "ns"

        def get(self, namespace: str, name: str) -> dict:
            raise ApiException(status=404, reason="Not Found")

        def watch(self, namespace: str, name: str):  # pragma: no cover - must not be reached
            raise AssertionError("watched a GateConfig that does not exist")

    with pytest.raises(ApiException):
        run(["status", "nope", "--watch"], client_factory=lambda **_: Missing(), out=lambda _: None)


def test_retry_refused_when_nothing_was_rejected() -> None:
    with pytest.raises(view.PluginError, match="nothing to retry: phase is Analysing"):
        view.retry_patch(gateconfig())


def test_retry_refused_where_the_operator_would_discard_it() -> None:
    """Rolled back, then the spec moved back to the stable version: nothing rejected is asked for.
    Failed with no canary (an invalid spec at rest): nothing to analyse again."""
    rolled_back = gateconfig(phase="RolledBack", reason="AnalysisFailed", canary=None, canaryVersion=None,
                             step=None, rejectedVersion=doc(V3)["version"])
    assert view.retry_patch(rolled_back)  # the spec names V3, the rejected version
    rolled_back["spec"]["params"] = V2
    with pytest.raises(view.PluginError, match=f"the spec no longer names the rolledback version {doc(V3)['version']}"):
        view.retry_patch(rolled_back)
    invalid = gateconfig(phase="Failed", reason="InvalidSpec", message="steps must end at 100", canary=None,
                         canaryVersion=None, step=None)
    with pytest.raises(view.PluginError, match="no canary version is in flight"):
        view.retry_patch(invalid)
    assert view.retry_patch(gateconfig(phase="Failed", reason="AnalysisFailed"))  # canary kept: re-analysed


def test_undo_targets() -> None:
    obj = gateconfig()
    assert view.undo_target(obj)["revision"] == 1  # the one before the stable version
    assert view.undo_patch(obj) == [{"op": "replace", "path": "/spec/params", "value": V1}]
    assert view.undo_patch(obj, to_revision=2)[0]["value"] == V2
    with pytest.raises(view.PluginError, match=r"no revision 7 in status.history \(known: 1, 2\)"):
        view.undo_target(obj, to_revision=7)
    only_stable = copy.deepcopy(obj)
    only_stable["status"]["history"] = [revision(1, V2)]
    with pytest.raises(view.PluginError, match="no earlier revision"):
        view.undo_target(only_stable)
    # The params written back hash to the recorded version: the rollout that follows targets it.
    assert GateVersion.from_params(view.undo_patch(obj)[0]["value"]).version == doc(V1)["version"]


@pytest.mark.parametrize(("params", "problem"), [
    ({**V1, "toolGateThreshold": 1.5}, "toolGateThreshold must be in [0.0, 1.0], got 1.5"),
    ({**V1, "bogus\nkey": 1}, "unknown gate params: bogus key"),
    ({**V1, "minExpertsPerToken": 3, "maxExpertsPerToken": 2},
     "minExpertsPerToken (3) must not exceed maxExpertsPerToken (2)"),
])
def test_undo_to_invalid_params_is_refused_in_one_line_and_writes_nothing(monkeypatch, capsys, params: dict,
                                                                          problem: str) -> None:
    """A revision whose params the operator would report as InvalidSpec (e.g. a hand-edited history,
    or one recorded under an older contract) is refused before the write, as the operator's check
    (the shared sparsegate_contracts.gate contract) would refuse it."""
    import sparsegate.kubectl_plugin as plugin

    obj = gateconfig()
    obj["status"]["history"][0]["params"] = params
    client = FakeClient([obj])
    monkeypatch.setattr(plugin, "run", functools.partial(run, client_factory=lambda **_: client))
    assert plugin.main(["undo", "gate", "--to-revision", "1"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: revision 1 ({doc(V1)['version']}) has invalid params: ")
    assert problem in err and client.patches == []


# ---------------------------------------------------------------- commands


class FakeClient:
    def __init__(self, objs: list[dict[str, Any]], *, kubeconfig: str | None = None,
                 context: str | None = None) -> None:
        self.objs = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in objs}
        self.default_namespace = "ns"
        self.patches: list[tuple[str, str, Any]] = []
        self.seen = {"kubeconfig": kubeconfig, "context": context}

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        return self.objs[(namespace, name)]

    def list(self, namespace: str | None) -> list[dict[str, Any]]:
        return [o for (ns, _), o in self.objs.items() if namespace in (None, ns)]

    def patch(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        self.patches.append((namespace, name, body))
        return self.objs[(namespace, name)]

    def watch(self, namespace: str, name: str) -> Any:
        obj = self.objs[(namespace, name)]
        later = copy.deepcopy(obj)
        later["status"]["rollout"]["phase"] = "Succeeded"
        yield {"type": "MODIFIED", "object": obj}
        yield {"type": "MODIFIED", "object": later}
        yield {"type": "DELETED", "object": later}


def cli(argv: list[str], objs: list[dict[str, Any]]) -> tuple[FakeClient, str]:
    made: list[FakeClient] = []
    printed: list[str] = []

    def factory(**kw: Any) -> FakeClient:
        made.append(FakeClient(objs, **kw))
        return made[0]

    assert run(argv, client_factory=factory, out=printed.append) == 0
    return made[0], "".join(printed)


@pytest.mark.parametrize(("argv", "body"), [
    (["pause", "gate"], {"spec": {"rollout": {"paused": True}}}),
    (["resume", "gate"], {"spec": {"rollout": {"paused": False}}}),
    (["promote", "gate"], {"metadata": {"annotations": {PROMOTE_ANNOTATION: "step"}}}),
    (["promote", "gate", "--full"], {"metadata": {"annotations": {PROMOTE_ANNOTATION: "full"}}}),
    (["abort", "gate"], {"metadata": {"annotations": {ABORT_ANNOTATION: "kubectl-sparsegate"}}}),
    (["undo", "gate"], [{"op": "replace", "path": "/spec/params", "value": V1}]),
    (["-n", "other", "undo", "gate", "--to-revision", "2"], [{"op": "replace", "path": "/spec/params", "value": V2}]),
    (["pause", "gate", "-n", "other"], {"spec": {"rollout": {"paused": True}}}),  # flags after the command too
])
def test_commands_send_one_patch(argv: list[str], body: Any) -> None:
    namespace = "other" if "other" in argv else "ns"
    client, printed = cli(argv, [gateconfig(), gateconfig(namespace="other")])
    assert client.patches == [(namespace, "gate", body)]
    assert printed.startswith("gateconfig.sparsegate.dev/gate ")


def test_get_and_status_print_without_writing() -> None:
    client, printed = cli(["--context", "c1", "get", "-A"], [gateconfig(), gateconfig(namespace="other")])
    assert client.patches == [] and client.seen == {"kubeconfig": None, "context": "c1"}
    assert printed.splitlines()[0].split()[0] == "NAMESPACE" and len(printed.splitlines()) == 3
    _, printed = cli(["status", "gate"], [gateconfig()])
    assert "Analysing" in printed and "REVISION" in printed


def test_get_by_name_across_all_namespaces_is_refused_as_kubectl_does() -> None:
    """`get NAME -A` looked in the default namespace only, as if -A were not there (main prints a
    PluginError as one `error:` line, exit 1)."""
    with pytest.raises(view.PluginError, match="cannot be retrieved by name across all namespaces"):
        run(["get", "gate", "-A"], client_factory=lambda **_: FakeClient([gateconfig()]))


def test_status_watch_prints_every_change_until_deleted() -> None:
    """(The Succeeded page still has the canary in flight: not at rest. Deleted: exit 1, not success.)"""
    out: list[str] = []
    assert run(["status", "gate", "--watch"], client_factory=lambda **_: FakeClient([gateconfig()]),
               out=out.append) == 1
    printed = "".join(out)
    assert printed.count("Name:       ns/gate") == 2
    assert "Phase:      Succeeded" in printed and printed.endswith("GateConfig ns/gate deleted\n")


def test_kubeconfig_and_connection_errors_are_one_line_not_a_traceback(tmp_path, capsys) -> None:
    """A missing kubeconfig, an unknown context, an unreachable API server: `error: ...` on stderr
    and exit 1, as the plugin's other refusals."""
    from sparsegate.kubectl_plugin import main

    assert main(["--kubeconfig", str(tmp_path / "missing"), "get"]) == 1
    assert capsys.readouterr().err.startswith("error: kubeconfig: ")
    config = tmp_path / "config"
    config.write_text("apiVersion: v1\nkind: Config\ncurrent-context: c\n"
                      "clusters: [{name: x, cluster: {server: 'http://127.0.0.1:1'}}]\n"
                      "contexts: [{name: c, context: {cluster: x, user: u}}]\nusers: [{name: u, user: {}}]\n")
    assert main(["--kubeconfig", str(config), "--context", "nope", "get"]) == 1
    assert capsys.readouterr().err.startswith("error: kubeconfig: ")
    assert main(["--kubeconfig", str(config), "get"]) == 1  # port 1: connection refused
    assert capsys.readouterr().err.startswith("error: cannot reach the API server: ")


class ExpiringWatchClient(FakeClient):
    """Each watch call plays the next script: events, then 410 Gone (the resourceVersion it
    resumes from was compacted, as the kubernetes client raises after its one retry)."""

    def __init__(self, objs: list[dict[str, Any]], scripts: list[list[Any]], **kw: Any) -> None:
        super().__init__(objs, **kw)
        self.scripts = scripts

    def watch(self, namespace: str, name: str) -> Any:
        from kubernetes.client.exceptions import ApiException

        for item in self.scripts.pop(0):
            if item == "gone":
                raise ApiException(status=410, reason="Expired: too old resource version")
            yield item


def at_version(obj: dict[str, Any], resource_version: str, phase: str) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = resource_version
    out["status"]["rollout"]["phase"] = phase
    return out


def test_status_watch_restarts_after_410_gone_without_printing_the_same_object_twice() -> None:
    """An expired watch (410) is watched again, not reported as an error; the new watch opens with
    the object already shown, which is not printed again."""
    first, later = at_version(gateconfig(), "7", "Analysing"), at_version(gateconfig(), "9", "Succeeded")
    client = ExpiringWatchClient([first], [
        [{"type": "ADDED", "object": first}, "gone"],
        [{"type": "ADDED", "object": first}, {"type": "MODIFIED", "object": later},
         {"type": "DELETED", "object": later}]])
    printed: list[str] = []
    assert run(["status", "gate", "--watch"], client_factory=lambda **_: client, out=printed.append) == 1
    text = "".join(printed)
    assert text.count("Name:       ns/gate") == 2 and text.count("Phase:      Analysing") == 1
    assert "Phase:      Succeeded" in text and text.endswith("GateConfig ns/gate deleted\n")


def test_status_watch_reports_a_deletion_that_happened_while_the_watch_was_expired() -> None:
    first = at_version(gateconfig(), "7", "Analysing")
    client = ExpiringWatchClient([first], [[{"type": "ADDED", "object": first}, "gone"]])
    printed: list[str] = []

    def delete_then_get(namespace: str, name: str) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        raise ApiException(status=404, reason="Not Found")

    calls = iter([lambda ns, n: first, delete_then_get])  # found before the watch, gone after it expired
    client.get = lambda namespace, name: next(calls)(namespace, name)  # type: ignore[method-assign]
    assert run(["status", "gate", "--watch"], client_factory=lambda **_: client, out=printed.append) == 1
    assert "".join(printed).endswith("GateConfig ns/gate deleted\n")


def test_status_watch_flushes_each_page_when_piped(monkeypatch) -> None:
    """Piped (`status --watch | tee`), stdout is block-buffered: each page is flushed, not held
    until several more arrive."""
    import sys

    class Pipe:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append("write")
            return len(text)

        def flush(self) -> None:
            self.calls.append("flush")

        def isatty(self) -> bool:
            return False

    pipe = Pipe()
    monkeypatch.setattr(sys, "stdout", pipe)
    assert run(["status", "gate", "--watch"], client_factory=lambda **_: FakeClient([gateconfig()])) == 1
    assert pipe.calls == ["write", "flush"] * 3  # two pages and "deleted", each flushed


def test_views_of_a_hand_edited_status_do_not_crash() -> None:
    """status.rollout keeps unknown fields and history[].promotedAt is any string: null or
    non-numeric analysis values and an unparseable or offset-less time print as is, not a traceback."""
    obj = gateconfig()
    analysis = obj["status"]["rollout"]["analysis"]
    analysis["canaryRequests"], analysis["canaryQps"] = None, "12"
    analysis["checks"][0]["threshold"], analysis["checks"][2]["value"] = None, "high"
    obj["status"]["history"][0]["promotedAt"] = "yesterday"
    obj["status"]["history"][1]["promotedAt"] = "2027-01-01"
    obj["status"]["analysisRuns"] = [{"step": 2, "canaryPercent": 50, "canaryVersion": doc(V3)["version"],
                                      "phase": "Running", "checks": [
                                          {"name": "q", "provider": "prometheus", "phase": "Running",
                                           "measurements": [{"phase": "Successful", "value": "0.5"}]}]}]
    text = view.status_view(obj, now=datetime(2027, 1, 1, 2, 0, tzinfo=UTC))
    assert "Analysis:   Pass, n/a canary requests at 12 qps" in text
    assert any(line.split() == ["errorRate", "0.01", "n/a", "pass"] for line in text.splitlines())
    assert any(line.split() == ["drift", "high", "0.1", "FAIL"] for line in text.splitlines())
    assert any(line.split()[:4] == ["1", doc(V1)["version"], "Promoted", "?"] for line in text.splitlines())
    assert any(line.split()[:4] == ["2", doc(V2)["version"], "Promoted", "2h"] for line in text.splitlines())
    row = view.get_table([obj]).splitlines()[1].split()
    assert row[-4:] == ["errorRate=0.01/n/a", "p99LatencyMs=n/a/800", "!drift=high/0.1", "q=0.5"]


@pytest.mark.parametrize(("field", "value"), [
    ("analysis", "Pass"), ("analysis", [1]), ("analysis", {"verdict": "Pass", "checks": "errorRate"}),
    ("analysis", {"verdict": "Pass", "checks": [None, "drift", {"name": "errorRate", "value": 0.01}]}),
    ("versionCounts", ["g-1"]), ("versionCounts", "g-1: 5"),
])
def test_views_of_an_untyped_rollout_field_do_not_crash(field: str, value: Any) -> None:
    """status.rollout keeps unknown fields, so the API server takes any JSON for `analysis` and
    `versionCounts` (a hand edit, another writer): `get` and `status` printed a traceback
    (AttributeError: no .get / .items) instead of the rest of the object."""
    obj = gateconfig()
    obj["status"]["rollout"][field] = value
    text = view.status_view(obj)
    assert "Phase:      Analysing" in text and "REVISION" in text
    assert view.get_table([obj]).splitlines()[1].split()[:2] == ["gate", "Analysing"]


def test_a_closed_pipe_is_not_reported_as_an_unreachable_api_server(monkeypatch, capsys) -> None:
    """`kubectl sparsegate status NAME --watch | head`: when the reader exits, the next write fails
    with EPIPE, an OSError; it ends quietly (141, as a SIGPIPE'd kubectl) instead of
    "error: cannot reach the API server"."""
    import sparsegate.kubectl_plugin as plugin

    def closed_pipe(argv: list[str]) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(plugin, "run", closed_pipe)
    assert plugin.main(["get"]) == 141
    assert capsys.readouterr().err == ""


# ---------------------------------------------------------------- status --watch: exit codes, --timeout


def rested(phase: str, *, params: dict = V3, reason: str = "", message: str = "", **changes: Any) -> dict[str, Any]:
    """``gateconfig()`` (spec V3, stable V2) come to rest in ``phase``: no canary in flight."""
    obj = gateconfig()
    ro = obj["status"]["rollout"]
    for key in ("step", "canaryPercent", "canaryVersion", "canary", "canaryInstances", "analysis"):
        ro.pop(key)
    ro.update(phase=phase, reason=reason, message=message, **changes)
    obj["spec"]["params"] = params
    if phase == "Succeeded":
        obj["status"]["stable"] = doc(params)
    return obj


def _stale(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["generation"] = 5  # `kubectl apply` of a new spec the operator has not observed yet
    return obj


def _respec(obj: dict[str, Any], params: dict) -> dict[str, Any]:
    obj["spec"]["params"] = params
    return obj


def _pending_retry(obj: dict[str, Any]) -> dict[str, Any]:
    obj["metadata"]["annotations"] = {RETRY_ANNOTATION: "kubectl-sparsegate"}
    return obj


@pytest.mark.parametrize(("obj", "code"), [
    (gateconfig(), None),  # Analysing: in flight
    (gateconfig(phase="Paused", reason="Paused"), None),  # a human promotes or aborts: --timeout bounds it
    (gateconfig(phase="Progressing"), None),
    (rested("RollingBack"), None),
    (rested("Succeeded", reason="Promoted"), 0),
    (_stale(rested("Succeeded", reason="Promoted")), None),  # the operator has not seen the new spec
    (_respec(rested("Succeeded"), V1), None),  # spec names another version: the rollout is about to start
    (rested("Failed", reason="InvalidSpec", message="spec.params.x: unknown"), 1),
    (gateconfig(phase="Failed", reason="AnalysisFailed", message="drift 0.3 > 0.1"), 1),  # autoRollback off
    (rested("RolledBack", reason="AnalysisFailed", rejectedVersion=doc(V3)["version"]), 1),
    (rested("Aborted", reason="Aborted", rejectedVersion=doc(V3)["version"]), 1),
    (_pending_retry(rested("RolledBack", rejectedVersion=doc(V3)["version"])), None),  # retry not acted on yet
    (rested("RolledBack", params=V1, rejectedVersion=doc(V3)["version"]), None),  # a new version to roll out
    (rested("Pending"), None),
    # Just applied, as the API server returns it before the operator writes status (the CRD default).
    ({"kind": "GateConfig", "metadata": {"name": "g", "namespace": "ns", "generation": 1},
      "spec": {"params": V3}, "status": {"observedGeneration": 0}}, None),
])
def test_watch_outcome_ends_only_at_rest(obj: dict[str, Any], code: int | None) -> None:
    outcome = view.watch_outcome(obj)
    assert (outcome[0] if outcome else None) == code
    if outcome:
        phase = obj["status"]["rollout"]["phase"]
        assert outcome[1].startswith(f"rollout {phase}") and "\n" not in outcome[1]


def test_watch_outcome_line_says_why() -> None:
    assert view.watch_outcome(rested("Failed", reason="InvalidSpec", message="bad params")) == (
        1, "rollout Failed (InvalidSpec): bad params")
    assert view.watch_outcome(rested("Succeeded")) == (
        0, f"rollout Succeeded: every instance runs the stable version {doc(V3)['version']}")


@pytest.mark.parametrize(("text", "seconds"), [("5m", 300), ("90s", 90), ("1h30m", 5400), ("0", 0), ("2.5", 2.5),
                                               ("1.5m", 90), ("300ms", 0.3)])
def test_parse_duration(text: str, seconds: float) -> None:
    assert view.parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "5x", "m", "-1", "nan", "inf", "5m-3s"])
def test_parse_duration_refuses(text: str) -> None:
    with pytest.raises(ValueError):
        view.parse_duration(text)


class ScriptedWatchClient(FakeClient):
    """Each watch call plays the next script of objects (a stream the server then ends), recording
    the timeout_seconds asked for; reading past the last script fails the test."""

    def __init__(self, obj: dict[str, Any], scripts: list[list[dict[str, Any]]], *,
                 clock: list[float] | None = None, step_s: float = 0.0) -> None:
        super().__init__([obj])
        self.scripts, self.clock, self.step_s = scripts, clock, step_s
        self.timeouts: list[int | None] = []

    def watch(self, namespace: str, name: str, *, timeout_seconds: int | None = None) -> Any:
        self.timeouts.append(timeout_seconds)
        assert self.scripts, "watched again after the rollout came to rest"
        for obj in self.scripts.pop(0):
            if self.clock is not None:
                self.clock[0] += self.step_s
            yield {"type": "MODIFIED", "object": obj}


def test_status_watch_exits_0_once_the_rollout_succeeds() -> None:
    """`status --watch` in a pipeline: it used to watch for ever (Ctrl-C); now it ends at rest."""
    client = ScriptedWatchClient(gateconfig(), [[at_version(gateconfig(), "7", "Analysing"),
                                                 at_version(rested("Succeeded"), "8", "Succeeded")]])
    printed: list[str] = []
    assert run(["status", "gate", "--watch"], client_factory=lambda **_: client, out=printed.append) == 0
    text = "".join(printed)
    assert text.count("Name:       ns/gate") == 2
    assert text.endswith(f"rollout Succeeded: every instance runs the stable version {doc(V3)['version']}\n")
    assert client.timeouts == [None]  # no --timeout: the stream is not bounded


def test_status_watch_exits_1_when_the_rollout_is_rolled_back(capsys) -> None:
    rolled = at_version(rested("RolledBack", reason="AnalysisFailed", message="drift 0.3 > 0.1",
                               rejectedVersion=doc(V3)["version"]), "8", "RolledBack")
    client = ScriptedWatchClient(gateconfig(), [[at_version(gateconfig(), "7", "Analysing"), rolled]])
    printed: list[str] = []
    assert run(["status", "gate", "--watch"], client_factory=lambda **_: client, out=printed.append) == 1
    assert "".join(printed).endswith("rollout RolledBack (AnalysisFailed): drift 0.3 > 0.1\n")


def test_status_watch_times_out_with_exit_1(monkeypatch, capsys) -> None:
    """--timeout 5m: the API server is asked to end each stream by the deadline (timeout_seconds: what
    is left), and once it has passed with the rollout still in flight: `error: timed out`, exit 1."""
    import sparsegate.kubectl_plugin as plugin

    clock = [1000.0]
    analysing = at_version(gateconfig(), "7", "Analysing")
    # The first stream: two events 100 s apart, then the server ends it; the second runs to the deadline.
    client = ScriptedWatchClient(gateconfig(), [[analysing, analysing], [analysing, analysing, analysing]],
                                 clock=clock, step_s=100.0)
    with pytest.raises(view.PluginError, match=r"timed out after 300s .* ns/gate .*\(phase Analysing\)"):
        run(["status", "gate", "--watch", "--timeout", "5m"], client_factory=lambda **_: client,
            out=lambda _: None, clock=lambda: clock[0])
    assert client.timeouts == [300, 100]

    real_run = plugin.run
    monkeypatch.setattr(plugin, "run", lambda argv: real_run(
        argv, client_factory=lambda **_: ScriptedWatchClient(gateconfig(), [[analysing] * 4], clock=clock,
                                                             step_s=100.0),
        out=lambda _: None, clock=lambda: clock[0]))
    assert plugin.main(["status", "gate", "-w", "--timeout", "150s"]) == 1
    assert capsys.readouterr().err.startswith("error: timed out after 150s waiting for GateConfig ns/gate")


def test_status_timeout_without_watch_or_unparsable_is_refused(capsys) -> None:
    with pytest.raises(view.PluginError, match="--timeout applies to status --watch"):
        run(["status", "gate", "--timeout", "5m"], client_factory=lambda **_: FakeClient([gateconfig()]))
    with pytest.raises(SystemExit) as exited:
        run(["status", "gate", "--watch", "--timeout", "5 minutes"], client_factory=lambda **_: None)
    assert exited.value.code == 2 and "cannot parse duration" in capsys.readouterr().err
