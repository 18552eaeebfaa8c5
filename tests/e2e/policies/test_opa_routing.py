"""The routing policy against the real OPA server: push, read back, decide, restart, fail closed.

Given an `opa run --server` on loopback; no Kubernetes here (the cluster test is
test_routingpolicy_cluster.py). The flow allow-list store is an in-memory stand-in at our own
wrapper layer (FlowPolicyConfigMap's read/publish).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from sparsegate.clients.opa import OpaRejected, OpaUnavailable, RoutingOpa
from sparsegate.domain.policy import PolicySource, build_opa_data
from sparsegate.domain.policy_compile import (
    FlowTable,
    PodInfo,
    Port,
    candidate_queries,
    flow_document,
    flow_question,
)
from sparsegate.handlers.routingpolicy import PolicySync, Settings
from sparsegate_contracts.flowpolicy import ip_entries
from sparsegate_ebpf.policy import parse_policy

pytestmark = pytest.mark.opa
TD = "cluster.local"
REGO = Path(__file__).resolve().parents[3] / "policies" / "routing" / "src.rego"


def _pod(name: str, ns: str, ip: str, sa: str, model: str | None = None, **labels: str) -> PodInfo:
    if model:
        labels["sparsegate.dev/model"] = model
    return PodInfo(namespace=ns, name=name, ip=ip, service_account=sa, labels=tuple(sorted(labels.items())),
                   ports=(Port(8080),) if model else ())


ALLOW_WEB = PolicySource(namespace="models", name="allow-web", generation=1, spec={
    "action": "Allow", "priority": 10, "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
    "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]})
DENY_BATCH = PolicySource(namespace="models", name="deny-batch", generation=2, spec={
    "action": "Deny", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "*"}]})
ALLOW_ALL_NS = PolicySource(namespace="models", name="batch-all", generation=1, spec={
    "action": "Allow", "priority": 100, "sources": [{"namespace": "*", "matchLabels": {"tier": "trusted"}}],
    "targets": [{"sparseModel": "*"}]})

PODS = [
    _pod("mixtral-0", "models", "127.20.0.10", "default", model="mixtral"),
    _pod("mixtral-1", "models", "127.20.0.11", "default", model="mixtral"),
    _pod("llama-0", "models", "127.20.0.12", "default", model="llama"),
    _pod("fe-0", "web", "127.20.1.1", "frontend"),
    _pod("fe-1", "web", "127.20.1.2", "frontend", tier="trusted"),
    _pod("other-0", "web", "127.20.1.3", "other"),
    _pod("job-0", "batch", "127.20.2.1", "job", tier="trusted"),
    _pod("ops-0", "ops", "127.20.3.1", "bot", tier="trusted"),
]


class MemoryStore:
    half_published = False  # FlowPolicyConfigMap's: a read never finds a half-published set here

    def __init__(self) -> None:
        self.document: dict[str, Any] | None = None
        self.basis: dict[str, Any] | None = None
        self.writes = 0

    async def read(self) -> dict[str, Any] | None:
        return self.document

    async def read_published(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return self.document, self.basis

    async def publish(self, document: dict[str, Any], *, basis: dict[str, Any] | None = None) -> None:
        self.document, self.basis = document, basis
        self.writes += 1


def _sync(url: str) -> tuple[PolicySync, MemoryStore]:
    store = MemoryStore()
    settings = Settings(opa_url=url, namespace="sparsegate-system", trust_domain=TD, resync_seconds=1, rego_path=REGO)
    return PolicySync(settings=settings, opa=RoutingOpa(url=url, timeout=1.0, retries=0), store=store), store


async def test_push_read_back_and_decide(opa_server, routing_rego: str) -> None:
    opa = RoutingOpa(url=opa_server.url)
    try:
        assert await opa.revision() is None  # fresh OPA: nothing loaded
        data, _ = build_opa_data(sources=[ALLOW_WEB, DENY_BATCH, ALLOW_ALL_NS], trust_domain=TD, rego=routing_rego)
        await opa.push(rego=routing_rego, data=data)
        await opa.push(rego=routing_rego, data=data)  # idempotent
        assert await opa.revision() == data["revision"]
        assert await opa.loaded_policies() == {
            "models/allow-web": {"generation": 1, "rules": 1},
            "models/deny-batch": {"generation": 2, "rules": 1},
            "models/batch-all": {"generation": 1, "rules": 1},
        }
        web = await opa.decide({"source": {"spiffeID": "spiffe://cluster.local/ns/web/sa/frontend"},
                                "target": {"namespace": "models", "sparseModel": "mixtral", "port": 8080}})
        assert web["allow"] is True and web["rule"] == "models/allow-web#s0t0"
        batch = await opa.decide({"source": {"namespace": "batch", "serviceAccount": "job", "labels": {"tier": "trusted"}},
                                  "target": {"namespace": "models", "sparseModel": "llama", "port": 8080}})
        assert batch["allow"] is False and batch["rule"] == "models/deny-batch#s0t0"
        assert batch["matched"]["allow"] == ["models/batch-all#s0t0"]  # explained: deny won over this allow
    finally:
        opa.close()


async def test_broken_rego_is_rejected_not_retried(opa_server) -> None:
    opa = RoutingOpa(url=opa_server.url)
    try:
        with pytest.raises(OpaRejected):
            await opa.push(rego="package sparsegate.routing\n\nallow if {", data={})
    finally:
        opa.close()


async def test_allow_list_agrees_with_opa_for_every_pair(opa_server, routing_rego: str) -> None:
    """The grouped questions (identity classes × models × ports) lose nothing: for every pod pair and
    port, the published allow-list says what OPA says when asked about that pair alone."""
    rng = random.Random(5)
    namespaces, sas, models = ["web", "batch", "ops"], ["a", "b", "c"], ["m0", "m1", "m2"]
    pods = [_pod(f"m{i}", "models", f"127.20.0.{i + 1}", "srv", model=models[i % 3]) for i in range(6)]
    pods += [_pod(f"p{i}", rng.choice(namespaces), f"127.20.1.{i + 1}", rng.choice(sas),
                  **({"tier": "trusted"} if rng.random() < 0.4 else {})) for i in range(18)]
    sources = []
    for i in range(25):
        selector = rng.choice([
            {"namespace": rng.choice(namespaces)},
            {"namespace": rng.choice(namespaces), "serviceAccount": rng.choice(sas)},
            {"namespace": "*", "matchLabels": {"tier": "trusted"}},
            {"namespace": "*", "serviceAccount": rng.choice(sas)},
            {"spiffeID": f"spiffe://cluster.local/ns/{rng.choice(namespaces)}/sa/{rng.choice(sas)}"},
        ])
        spec = {"action": rng.choice(["Allow", "Allow", "Deny"]), "priority": rng.randint(0, 5), "sources": [selector],
                "targets": [{"sparseModel": rng.choice(models + ["*"])}]}
        if rng.random() < 0.5:
            spec["ports"] = [{"port": rng.choice([8080, 9090])}]
        sources.append(PolicySource(namespace="models", name=f"p{i}", generation=1, spec=spec))
    data, _ = build_opa_data(sources=sources, trust_domain=TD, rego=routing_rego)
    opa = RoutingOpa(url=opa_server.url)
    try:
        await opa.push(rego=routing_rego, data=data)
        queries = candidate_queries(targets=data["targets"], pods=pods, trust_domain=TD)
        answers = await opa.decide_many([q.opa_input(trust_domain=TD) for q in queries])
        table = FlowTable.from_document(flow_document(decisions=dict(zip(queries, answers)), pods=pods))
        pairs = [(s, d, port) for s in pods for d in pods if d.model for port in (8080, 9090)]
        inputs = [{"source": {"namespace": s.namespace, "serviceAccount": s.service_account, "labels": dict(s.labels)},
                   "target": {"namespace": d.namespace, "sparseModel": d.model, "port": port, "protocol": "tcp"}}
                  for s, d, port in pairs]
        truth = await opa.decide_many(inputs)
        allowed = 0
        for (s, d, port), answer in zip(pairs, truth):
            assert table.allows(src_ip=s.ip, dst_ip=d.ip, port=port) is answer["allow"], (s, d, port, answer)
            allowed += answer["allow"]
        assert 0 < allowed < len(pairs)  # the scenario exercises both outcomes
    finally:
        opa.close()


def _generated(seed: int, *, sparse: bool = False) -> tuple[list[PolicySource], list[PodInfo]]:
    """Policies of every shape the CRD allows (SPIFFE IDs, namespace/service-account/label selectors,
    `*` namespaces and targets, Deny and Allow, priorities, ports named or not, tcp and udp, expert
    group and route scopes, several sources x targets) over pods of several identity classes.

    `sparse`: fewer policies, each one selector (no labels) to one named model, so that most (class,
    model) pairs are decided by one rule alone (`flow_question`'s `one`, some buckets deciding several
    pairs) and the rest still overlap (`many`)."""
    if sparse:
        return _generated_sparse(seed)
    rng = random.Random(seed)
    namespaces, sas, models = ["web", "batch", "ops", "models"], ["a", "b", "c"], ["m0", "m1", "m2", "m3"]
    pods = [PodInfo(namespace="models", name=f"m{i}", ip=f"127.20.0.{i + 1}", service_account="srv",
                    labels=(("sparsegate.dev/model", models[i % 4]),),
                    ports=tuple(sorted({Port(8080), *([Port(9090)] if i % 2 else []), *([Port(53, "udp")] if i % 3 == 0 else [])},
                                       key=lambda p: (p.port, p.protocol))))
            for i in range(8)]
    pods += [_pod(f"p{i}", rng.choice(namespaces), f"127.20.1.{i + 1}", rng.choice(sas),
                  **{k: v for k, v in (("tier", rng.choice(["trusted", "edge"])), ("team", rng.choice(["x", "y"])))
                     if rng.random() < 0.5})
             for i in range(30)]
    sources = []
    for i in range(40):
        selectors = [rng.choice([
            {"namespace": rng.choice(namespaces)},
            {"namespace": rng.choice(namespaces), "serviceAccount": rng.choice(sas)},
            {"namespace": rng.choice(namespaces), "matchLabels": {"tier": rng.choice(["trusted", "edge"])}},
            {"namespace": "*", "matchLabels": {"tier": "trusted", "team": rng.choice(["x", "y"])}},
            {"namespace": "*", "serviceAccount": rng.choice(sas)},
            {"spiffeID": f"spiffe://cluster.local/ns/{rng.choice(namespaces)}/sa/{rng.choice(sas)}"},
            {},  # the policy's own namespace
        ]) for _ in range(rng.randint(1, 2))]
        targets = [{"sparseModel": rng.choice(models + ["*"]),
                    **({"expertGroups": ["code"]} if rng.random() < 0.15 else {}),
                    **({"routes": ["/v1/infer"]} if rng.random() < 0.1 else {})}
                   for _ in range(rng.randint(1, 2))]
        spec: dict[str, Any] = {"action": rng.choice(["Allow", "Allow", "Deny"]), "priority": rng.randint(0, 5),
                                "sources": selectors, "targets": targets}
        if rng.random() < 0.5:
            spec["ports"] = [{"port": rng.choice([8080, 9090])}, *([{"port": 53, "protocol": "UDP"}] if rng.random() < 0.3 else [])]
        sources.append(PolicySource(namespace="models", name=f"p{i}", generation=1, spec=spec))
    return sources, pods


def _generated_sparse(seed: int) -> tuple[list[PolicySource], list[PodInfo]]:
    rng = random.Random(seed)
    _, pods = _generated(seed)
    namespaces, sas = ["web", "batch", "ops", "models"], ["a", "b", "c"]
    sources = []
    for i in range(14):
        selector = rng.choice([
            {"namespace": rng.choice(namespaces)},
            {"namespace": rng.choice(namespaces), "serviceAccount": rng.choice(sas)},
            {"spiffeID": f"spiffe://cluster.local/ns/{rng.choice(namespaces)}/sa/{rng.choice(sas)}"},
        ])
        target = {"sparseModel": rng.choice(["m0", "m1", "m2", "m3"]),
                  **({"expertGroups": ["code"]} if rng.random() < 0.15 else {})}
        spec: dict[str, Any] = {"action": rng.choice(["Allow", "Allow", "Deny"]), "priority": rng.randint(0, 5),
                                "sources": [selector], "targets": [target]}
        if rng.random() < 0.5:
            spec["ports"] = [{"port": rng.choice([8080, 9090])}, *([{"port": 53, "protocol": "UDP"}] if rng.random() < 0.3 else [])]
        sources.append(PolicySource(namespace="models", name=f"p{i}", generation=1, spec=spec))
    return sources, pods


@pytest.mark.parametrize("sparse", [False, True], ids=["overlapping", "sparse"])
@pytest.mark.parametrize("seed", range(6))
async def test_one_evaluation_decides_exactly_what_the_per_question_path_decides(
        opa_server, routing_rego: str, seed: int, sparse: bool) -> None:
    """`flow_decisions` (one POST) and `decide_many` over `candidate_queries` (the questions one by
    one through `decision`) give the same allow-list document, entry for entry, on generated policies:
    overlapping ones (every pair gathered: `many`) and sparse ones (mostly decided by one rule:
    `one`, with buckets that decide several pairs). On a port the model's pods do not declare, the
    allow-list takes no port-less Allow (CRD spec.ports): `decision`'s answer less those."""
    sources, pods = _generated(seed, sparse=sparse)
    data, rules = build_opa_data(sources=sources, trust_domain=TD, rego=routing_rego)
    named = {r.id for r in rules if r.ports}
    declared: dict[tuple[str, str | None], set[tuple[int, str]]] = {}
    for p in pods:
        declared.setdefault((p.namespace, p.model), set()).update((x.port, x.protocol) for x in p.ports)
    opa = RoutingOpa(url=opa_server.url)
    try:
        await opa.push(rego=routing_rego, data=data)
        queries = candidate_queries(targets=data["targets"], pods=pods, trust_domain=TD)
        answers = await opa.decide_many([q.opa_input(trust_domain=TD) for q in queries])
        undeclared = sum((q.port, q.protocol) not in declared[(q.target_namespace, q.model)] for q in queries)
        per_question = flow_document(decisions={
            q: a if (q.port, q.protocol) in declared[(q.target_namespace, q.model)] else _named_ports_only(a, named)
            for q, a in zip(queries, answers)}, pods=pods)
        question = flow_question(targets=data["targets"], pods=pods, trust_domain=TD)
        one = flow_document(decisions=question.decisions(await opa.flow_decisions(question.input)), pods=pods)
    finally:
        opa.close()
    assert one == per_question
    actions = {e["action"] for e in ip_entries(one)}
    assert actions == {"allow", "deny"}, actions  # the scenario exercises both outcomes
    assert len(ip_entries(one)) > (10 if sparse else 50)
    assert sparse or undeclared > 0  # ports only a rule names: the port-less Allows left out
    if sparse:  # both paths, and a bucket asked once for several pairs
        assert question.input["many"] and max(len(pairs) for pairs in question.one_pairs) > 1


def _named_ports_only(answer: dict[str, Any], named: set[str]) -> dict[str, Any]:
    """`decision`'s answer without the port-less Allows (a Deny wins as before): ranked as OPA ranks."""
    if answer["matched"]["deny"]:
        return answer
    allows = [rule for rule in answer["matched"]["allow"] if rule in named]
    return {"allow": bool(allows), "rule": allows[0] if allows else ""}


async def test_fail_closed_then_resync_after_restart(opa_server) -> None:
    sync, store = _sync(opa_server.url)
    try:
        policies = [ALLOW_WEB, DENY_BATCH, ALLOW_ALL_NS]
        await sync.sync(policies=policies, pods=PODS)
        good = store.document
        agent_view = parse_policy(good)  # the eBPF agent's own parser accepts what we publish
        assert agent_view.version == good["version"] and len(agent_view.rules) == len(good["rules"])
        table = FlowTable.from_document(good)
        assert table.allows(src_ip="127.20.1.1", dst_ip="127.20.0.10", port=8080)  # fe-0 → mixtral
        assert table.allows(src_ip="127.20.3.1", dst_ip="127.20.0.12", port=8080)  # trusted ops → llama
        assert not table.allows(src_ip="127.20.2.1", dst_ip="127.20.0.12", port=8080)  # batch denied
        assert not table.allows(src_ip="127.20.1.3", dst_ip="127.20.0.10", port=8080)  # no rule
        # fe-0 → 2 mixtral pods by allow-web; fe-1, ops-0 (trusted) → 3 model pods by the higher-priority
        # batch-all; batch job-0 → 3 model pods by the Deny
        assert sync.counts == {"models/allow-web": 2, "models/batch-all": 6, "models/deny-batch": 3}
        assert sync.loaded["models/allow-web"]["generation"] == 1
        writes = store.writes
        await sync.sync(policies=policies, pods=PODS)
        assert store.writes == writes  # nothing changed, nothing written

        opa_server.stop()
        # A wider policy arrives while OPA is down: nothing widens.
        wider = PolicySource(namespace="models", name="allow-other", generation=1, spec={
            "action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "*"}]})
        with pytest.raises(OpaUnavailable):
            await sync.sync(policies=[*policies, wider], pods=PODS)
        assert store.document == good
        # A pod leaves and allow-web is deleted while OPA is down: their entries go (narrower only).
        with pytest.raises(OpaUnavailable):
            await sync.sync(policies=[DENY_BATCH, ALLOW_ALL_NS], pods=[p for p in PODS if p.name != "fe-1"])
        narrowed = store.document
        assert {tuple(sorted(e.items())) for e in ip_entries(narrowed)} < {tuple(sorted(e.items())) for e in ip_entries(good)}
        assert all(e["srcIP"] != "127.20.1.2" and not e["rule"].startswith("models/allow-web") for e in ip_entries(narrowed))

        opa_server.start()  # same port, empty store: a restart
        probe = RoutingOpa(url=opa_server.url)
        assert await probe.revision() is None
        await sync.sync(policies=[*policies, wider], pods=PODS)
        assert await probe.revision() == sync.revision  # everything pushed again
        assert set(await probe.loaded_policies()) == {"models/allow-web", "models/deny-batch", "models/batch-all",
                                                     "models/allow-other"}
        assert FlowTable.from_document(store.document).allows(src_ip="127.20.1.3", dst_ip="127.20.0.10", port=8080)
        probe.close()
    finally:
        sync.opa.close()


def _allows(document: dict[str, Any]) -> set[tuple[str, str, int, str]]:
    return {(e["srcIP"], e["dstIP"], e["dstPort"], e["protocol"]) for e in ip_entries(document) if e["action"] == "allow"}


DENY_MIXTRAL = PolicySource(namespace="models", name="deny-mixtral", generation=1, spec={
    "action": "Deny", "sources": [{"namespace": "*"}], "targets": [{"sparseModel": "mixtral"}]})
# allow-web narrowed: generation 2 names port 9090 instead of 8080
ALLOW_WEB_NARROWED = PolicySource(namespace="models", name="allow-web", generation=2,
                                  spec={**ALLOW_WEB.spec, "ports": [{"port": 9090}]})


async def _truth(url: str, routing_rego: str, policies: list[PolicySource]) -> set[tuple[str, str, int, str]]:
    """What OPA allows for these policies (a fresh push to a scratch OPA-backed sync)."""
    sync, store = _sync(url)
    try:
        await sync.sync(policies=policies, pods=PODS)
    finally:
        sync.opa.close()
    return _allows(store.document)


async def test_changes_while_opa_is_down_fail_closed_and_opa_restores_them(opa_server, routing_rego: str) -> None:
    """A Deny added and an Allow narrowed while OPA is down: the allow-list keeps nothing the new
    specs might remove (compared with what OPA decides for them once back); OPA's return restores."""
    policies = [ALLOW_WEB, DENY_BATCH, ALLOW_ALL_NS]
    with_deny = [*policies, DENY_MIXTRAL]
    narrowed = [ALLOW_WEB_NARROWED, DENY_BATCH, ALLOW_ALL_NS]
    truth = {"deny": await _truth(opa_server.url, routing_rego, with_deny),
             "narrowed": await _truth(opa_server.url, routing_rego, narrowed)}
    opa_server.restart()  # empty again
    sync, store = _sync(opa_server.url)
    try:
        await sync.sync(policies=policies, pods=PODS)
        good = _allows(store.document)
        assert ("127.20.1.1", "127.20.0.10", 8080, "tcp") in good  # fe-0 → mixtral-0 by allow-web
        opa_server.stop()

        # When a Deny of every namespace on mixtral is added while OPA is down
        with pytest.raises(OpaUnavailable):
            await sync.sync(policies=with_deny, pods=PODS)
        during = _allows(store.document)
        # Then no flow to a mixtral pod is left, llama's stay, and nothing is wider than OPA's answer
        assert not {f for f in during if f[1] in ("127.20.0.10", "127.20.0.11")}
        assert {f for f in good if f[1] == "127.20.0.12"} <= during
        assert during <= good and during <= truth["deny"], during - truth["deny"]

        # When instead allow-web is narrowed (8080 → 9090) while OPA is down
        sync2, store2 = _sync(opa_server.url)
        opa_server.start()
        await sync2.sync(policies=policies, pods=PODS)
        opa_server.stop()
        with pytest.raises(OpaUnavailable):
            await sync2.sync(policies=narrowed, pods=PODS)
        during2 = _allows(store2.document)
        assert not any(e["rule"].startswith("models/allow-web#") for e in ip_entries(store2.document))
        assert during2 <= truth["narrowed"], during2 - truth["narrowed"]
        sync2.opa.close()

        # When OPA comes back (empty), the normal sync publishes exactly what OPA allows
        opa_server.start()
        await sync.sync(policies=with_deny, pods=PODS)
        assert _allows(store.document) == truth["deny"]
    finally:
        sync.opa.close()


async def test_operator_restart_while_opa_is_down_widens_nothing(opa_server, routing_rego: str) -> None:
    """A new operator process (no memory) meets OPA down: with the recorded basis matching today's
    specs it keeps the allow-list; a policy changed meanwhile is narrowed; without a record, no
    allow entry of a live policy survives."""
    policies = [ALLOW_WEB, DENY_BATCH, ALLOW_ALL_NS]
    changed = [ALLOW_WEB_NARROWED, DENY_BATCH, ALLOW_ALL_NS]
    truth_changed = await _truth(opa_server.url, routing_rego, changed)
    first, store = _sync(opa_server.url)
    try:
        await first.sync(policies=policies, pods=PODS)
    finally:
        first.opa.close()
    good, basis = store.document, store.basis
    assert basis and set(basis["policies"]) == {p.key for p in policies}
    opa_server.stop()

    async def restarted(current: list[PolicySource]) -> dict[str, Any]:
        sync, _ = _sync(opa_server.url)
        sync.store = store
        try:
            with pytest.raises(OpaUnavailable):
                await sync.sync(policies=current, pods=PODS)
        finally:
            sync.opa.close()
        return store.document

    # Unchanged specs: the recorded basis proves the allow-list still matches them
    assert await restarted(policies) == good
    # allow-web changed while no operator ran (8080 → 9090): its entries go, nothing is wider than
    # what OPA decides for the changed specs
    after_change = await restarted(changed)
    assert not any(e["rule"].startswith("models/allow-web#") for e in ip_entries(after_change))
    assert _allows(after_change) <= truth_changed and _allows(after_change) < _allows(good)
    store.document, store.basis = good, basis
    # A Deny added while no operator ran (and OPA is down): its targets' entries go
    after_deny = await restarted([*policies, DENY_MIXTRAL])
    assert _allows(after_deny) == {f for f in _allows(good) if f[1] not in ("127.20.0.10", "127.20.0.11")}
    # No record at all (an older operator wrote the ConfigMap): nothing a live policy allowed is kept
    store.document, store.basis = good, None
    bare = await restarted(policies)
    assert _allows(bare) == set() and len(_allows(good)) > 0


class _StatusKube:
    """Kube's status read-modify-write over one in-memory RoutingPolicy, counting API requests."""

    def __init__(self, obj: dict[str, Any]) -> None:
        from sparsegate.clients.kube import Kube

        self.obj, self.gets, self.patches = obj, 0, 0
        self._update = Kube.update_status

    def get(self, kind: str, *, namespace: str, name: str) -> dict[str, Any]:
        import copy

        self.gets += 1
        return copy.deepcopy(self.obj)

    def patch_status(self, kind: str, *, namespace: str, name: str, status: dict[str, Any],
                     resource_version: str) -> None:
        from sparsegate.clients.kube import Conflict

        if resource_version != self.obj["metadata"]["resourceVersion"]:
            raise Conflict(409, "Conflict", "stale")
        self.patches += 1
        self.obj["status"] = {**self.obj.get("status", {}), **status}
        self.obj["metadata"]["resourceVersion"] = str(int(resource_version) + 1)

    def update_status(self, *args: Any, **kwargs: Any) -> Any:
        return self._update(self, *args, **kwargs)


async def test_a_resting_resync_asks_opa_its_revision_and_the_api_server_nothing(opa_server, monkeypatch) -> None:
    """Nothing changed (policies, pods, OPA): a policy's periodic resync costs one GET to OPA (its
    revision; no decisions, no read-back of the loaded policies) and no API request (its status
    is compared with the watched object); a stale watched copy costs a 409 and one read."""
    import copy

    from sparsegate.handlers import routingpolicy

    sync, store = _sync(opa_server.url)
    obj = {"apiVersion": "sparsegate.dev/v1alpha1", "kind": "RoutingPolicy",
           "metadata": {"namespace": "models", "name": "allow-web", "generation": 1, "resourceVersion": "1"},
           "spec": ALLOW_WEB.spec}
    sync.kube = kube = _StatusKube(obj)  # type: ignore[assignment]
    monkeypatch.setattr(routingpolicy, "_sync", sync)
    calls: dict[str, int] = {}
    for method in ("revision", "loaded_policies", "flow_decisions", "push"):
        real = getattr(sync.opa, method)

        async def counted(*a: Any, _real: Any = real, _m: str = method, **kw: Any) -> Any:
            calls[_m] = calls.get(_m, 0) + 1
            return await _real(*a, **kw)
        monkeypatch.setattr(sync.opa, method, counted)
    picked = {"name": "allow-web", "namespace": "models", "meta": obj["metadata"],
              "sparsegate_routing_policies": {("models", "allow-web"): [ALLOW_WEB]},
              "sparsegate_flow_pods": {"models": PODS}}
    try:
        await routingpolicy.resync_routing_policy(logger=routingpolicy.log, **picked)  # first: decide, write
        assert calls == {"revision": 1, "push": 1, "flow_decisions": 1, "loaded_policies": 1}
        assert kube.patches == 1 and obj["status"]["loadedInOPA"] is True and obj["status"]["observedGeneration"] == 1
        first = dict(calls)
        gets = kube.gets
        await routingpolicy.resync_routing_policy(logger=routingpolicy.log, body=copy.deepcopy(obj), **picked)
        assert calls == {**first, "revision": 2}, calls
        assert (kube.gets, kube.patches) == (gets, 1), "a resting resync read or wrote the policy"
        # A stale watched copy (before the first write): one 409, one read, no write.
        stale = {**copy.deepcopy(obj), "status": {}, "metadata": {**obj["metadata"], "resourceVersion": "1"}}
        await routingpolicy.resync_routing_policy(logger=routingpolicy.log, body=stale, **picked)
        assert (kube.gets, kube.patches) == (gets + 1, 1)
        assert store.writes == 1
    finally:
        sync.opa.close()
