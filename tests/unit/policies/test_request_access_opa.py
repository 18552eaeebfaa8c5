"""The per-request access table (sparsegate.domain.request_access + sparsegate_contracts.request_access)
decides as the real OPA does with the shipped Rego, on many generated RoutingPolicy sets.

The table cannot see caller labels (a token carries none), so its answer must be OPA's answer for the
caller with no labels AND with every label the rules name (see sparsegate_contracts.request_access);
its deciding rule must be the one OPA reports for the side that decides. A request naming no group
is asked of OPA as it is (a route and no group: the whole model).
"""

from __future__ import annotations

import itertools
import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from localcluster.binaries import find_binary

from sparsegate.domain.policy import PolicySource, build_opa_data
from sparsegate.domain.request_access import access_document
from sparsegate_contracts.rego import routing_policy
from sparsegate_contracts.request_access import parse_access_document

TD = "cluster.local"
NS = "ml"
MODEL = "m1"
PORT = 8080
GROUPS = ("g1", "g2", "g3")
ROUTES = ("/v1/infer", "/v1/chat/completions")
ALL_LABELS = {"app": "x", "tier": "y"}  # one value per key: a caller with all of them meets every rule
SOURCES: list[dict[str, Any]] = [
    {"namespace": "web"}, {"serviceAccount": "a"}, {"namespace": "*", "serviceAccount": "b"}, {"namespace": "*"},
    {"spiffeID": "spiffe://cluster.local/ns/web/sa/c"}, {"spiffeID": "spiffe://other.td/ns/web/sa/c"},
    {"matchLabels": {"app": "x"}}, {"namespace": "web", "matchLabels": {"tier": "y"}},
    {"namespace": "web", "serviceAccount": "a"},
]
PORTS: list[list[dict[str, Any]]] = [[], [], [{"port": PORT}], [{"port": 9090}], [{"port": PORT, "protocol": "UDP"}]]
CALLERS = list(itertools.product(("ml", "web", "other"), ("a", "b", "c", "d")))


def _subset(rng: random.Random, items: tuple[str, ...]) -> list[str]:
    return [] if rng.random() < 0.5 else rng.sample(items, rng.randint(1, len(items)))


def _policies(rng: random.Random) -> list[PolicySource]:
    out = []
    for i in range(rng.randint(1, 5)):
        spec = {
            "action": rng.choice(["Allow", "Allow", "Deny"]),
            "priority": rng.randint(-2, 2),
            "sources": rng.sample(SOURCES, rng.randint(1, 3)),
            "targets": [{"sparseModel": rng.choice([MODEL, MODEL, "*", "m2"]),
                         "expertGroups": _subset(rng, GROUPS), "routes": _subset(rng, ROUTES)}
                        for _ in range(rng.randint(1, 2))],
            "ports": rng.choice(PORTS),
        }
        out.append(PolicySource(namespace=NS, name=f"p{i}", generation=1, spec=spec))
    return out


def _question(ns: str, sa: str, route: str, group: str | None, labels: dict[str, str]) -> dict[str, Any]:
    target = {"namespace": NS, "sparseModel": MODEL, "port": PORT, "protocol": "TCP", "route": route}
    if group is not None:  # no group: the whole model, as the server asks the table
        target["expertGroup"] = group
    return {"source": {"namespace": ns, "serviceAccount": sa, "labels": labels}, "target": target}


def _opa_batch(tmp: Path, rego: str, data: dict[str, Any], questions: list[dict[str, Any]]) -> list[dict[str, Any]]:
    (tmp / "routing.rego").write_text(rego)
    (tmp / "data.json").write_text(json.dumps({"sparsegate": {"policies": data}}))
    (tmp / "input.json").write_text(json.dumps({"batch": questions}))
    run = subprocess.run([str(find_binary("opa")), "eval", "-f", "json", "-d", str(tmp / "routing.rego"),
                          "-d", str(tmp / "data.json"), "-i", str(tmp / "input.json"),
                          "data.sparsegate.routing.batch_decisions"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    out = json.loads(run.stdout)["result"][0]["expressions"][0]["value"]
    assert len(out) == len(questions)
    return out


@pytest.mark.opa
def test_table_decides_as_opa_on_generated_policies(tmp_path: Path) -> None:
    rng = random.Random(12)
    rego = routing_policy()
    compared = enforced_sets = allowed = by_deny = label_split = 0
    for scenario in range(30):
        sources = _policies(rng)
        data, rules = build_opa_data(sources=sources, trust_domain=TD, rego=rego)
        table = parse_access_document(access_document(rules, namespace=NS, model=MODEL, serving_port=PORT,
                                                      trust_domain=TD))
        # Enforcement starts once any RoutingPolicy names the model (or every model of its namespace).
        assert table.enforced == bool(set(data["targets"]) & {f"{NS}/{MODEL}", f"{NS}/*"}), scenario
        if not table.enforced:
            continue
        enforced_sets += 1
        asked = [(ns, sa, route, group) for ns, sa in CALLERS for route in (*ROUTES, "/other")
                 for group in (*GROUPS, None)]
        questions = [_question(ns, sa, route, group, labels)
                     for ns, sa, route, group in asked for labels in ({}, ALL_LABELS)]
        answers = _opa_batch(tmp_path, rego, data, questions)
        for k, (ns, sa, route, group) in enumerate(asked):
            bare, labelled = answers[2 * k], answers[2 * k + 1]
            mine = table.decide(namespace=ns, service_account=sa, route=route, group=group)
            case = (scenario, ns, sa, route, group, bare, labelled, mine)
            assert mine.allow == (bare["allow"] and labelled["allow"]), case
            if mine.allow:
                assert mine.rule == bare["rule"], case
            elif labelled["matched"]["deny"]:
                assert mine.rule == labelled["rule"] and "Deny" in mine.reason, case
            else:
                assert mine.rule == "" and "default deny" in mine.reason, case
            compared += 1
            allowed += mine.allow
            by_deny += bool(labelled["matched"]["deny"])
            label_split += bare["allow"] != labelled["allow"]
    # The generator must reach every kind of answer, or the comparison proves little.
    assert enforced_sets >= 15 and compared >= 15 * len(CALLERS) * 12
    assert 0.05 * compared < allowed < 0.95 * compared, (allowed, compared)
    assert by_deny > 0.05 * compared and label_split > 0.01 * compared, (by_deny, label_split, compared)
