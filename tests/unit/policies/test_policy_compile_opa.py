"""Differential test of the two zero-trust decision paths on generated RoutingPolicy sets and pods.

(a) OPA with the shipped Rego, asked per flow (`batch_decisions`, a question naming no expert group
or route) and per request (one naming a group and a route); (b) the allow-list the operator compiles
(`flow_question` -> the real `opa eval` of `flow_decisions` -> `flow_document`), as the agent loads
it (`compile_policy` records) and, when BPF is available, as the XDP program judges SYNs and
datagrams (BPF_PROG_TEST_RUN).

The contract (README "Node agent: what it polices", CRD RoutingPolicy): only pods of a model some
RoutingPolicy targets are policed (the rest pass); to those, the allow-list admits exactly what OPA
allows for the flow (Deny wins; a scoped Allow admits the connection, a scoped Deny does not cut
it), except that a port-less Allow covers only the ports the model's pods declare. So every request
OPA allows on a port an allowing rule names or the pods declare is on an admitted flow. The rule an
allow-list entry names is OPA's deciding rule (highest priority, then id). While OPA is down the
published allow-list never admits a flow today's policies and pods do not (fail closed).
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import subprocess
from pathlib import Path
from typing import Any

import pytest
from localcluster.binaries import find_binary
from sparsegate_contracts import flowpolicy

from sparsegate.clients.opa import OpaUnavailable
from sparsegate.domain.policy import PolicySource, build_opa_data
from sparsegate.domain.policy_compile import PodInfo, flow_document, flow_question, pod_info
from sparsegate.handlers.routingpolicy import PolicySync, Settings
from sparsegate_contracts.rego import routing_policy
from test_policy_sync_malformed_answer import FakeOpa, MemoryStore

TD = "cluster.local"
SOURCES: list[dict[str, Any]] = [
    {"namespace": "web"}, {"serviceAccount": "a"}, {"namespace": "*", "serviceAccount": "b"}, {"namespace": "*"},
    {"spiffeID": "spiffe://cluster.local/ns/web/sa/c"}, {"spiffeID": "spiffe://other.td/ns/web/sa/c"},
    {"spiffeID": "spiffe://cluster.local/ns/ml/sa/a/extra"}, {"spiffeID": "spiffe://cluster.local/ns/ml/sa/srv"},
    {"matchLabels": {"app": "x"}}, {"namespace": "web", "matchLabels": {"tier": "y"}}, {"matchLabels": {}},
    {"namespace": "web", "serviceAccount": "a"}, {"namespace": "*", "matchLabels": {"app": "x", "tier": "y"}},
    {"namespace": "other"}, {"namespace": "ml", "serviceAccount": "srv"}]
PORTS: list[list[dict[str, Any]]] = [
    [], [], [{"port": 8080}], [{"port": 8080, "protocol": "TCP"}], [{"port": 9090}], [{"port": 8080, "protocol": "UDP"}],
    [{"port": 8080}, {"port": 8080, "protocol": "UDP"}], [{"port": 5000}], [{"port": 9090, "protocol": "UDP"}, {"port": 8080}]]
FLOW_PORTS = [(8080, "tcp"), (8080, "udp"), (9090, "tcp"), (9090, "udp"), (5000, "tcp"), (7000, "tcp")]
GROUPS, ROUTES = ("g1", "g2"), ("/v1/infer", "/v1/completions")
MODELS = (("ml", "m1"), ("ml", "m2"), ("web", "m1"), ("ml", "m3"))


def _subset(rng: random.Random, items: tuple[str, ...]) -> list[str]:
    return [] if rng.random() < 0.6 else rng.sample(items, rng.randint(1, len(items)))


def _policy(rng: random.Random, name: str) -> PolicySource:
    spec: dict[str, Any] = {
        "action": rng.choice(["Allow", "Deny"]), "priority": rng.choice([-1, 0, 0, 1]),  # ties
        "sources": rng.sample(SOURCES, rng.randint(1, 3)),
        "targets": [{"sparseModel": rng.choice(["m1", "m1", "m2", "*", "m3"]),
                     **({"expertGroups": g} if (g := _subset(rng, GROUPS)) else {}),
                     **({"routes": r} if (r := _subset(rng, ROUTES)) else {})} for _ in range(rng.randint(1, 2))]}
    ports = rng.choice(PORTS)
    if ports or rng.random() < 0.5:
        spec["ports"] = ports
    if rng.random() < 0.2:
        del spec["priority"]
    return PolicySource(namespace=rng.choice(("ml", "ml", "web")), name=name, generation=1, spec=spec)


def _pod(rng: random.Random, ns: str, name: str, ip: str, labels: dict[str, str], sa: str | None,
         ports: list[tuple[int, str | None]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    status: dict[str, Any] = {"podIP": ip, "phase": "Running"}
    if rng.random() < 0.3:  # dual-stack
        status["podIPs"] = [{"ip": ip}, {"ip": "fd00::" + ip.replace(".", ":").split(":", 2)[-1]}]
    spec: dict[str, Any] = {"containers": [{"ports": [{"containerPort": p, **({"protocol": pr} if pr else {})}
                                                      for p, pr in ports]}]}
    if sa:
        spec["serviceAccountName"] = sa
    return {"metadata": {"namespace": ns, "name": name, "labels": labels}, "spec": spec, "status": status}


def _cluster(rng: random.Random, first_ip: int = 1) -> tuple[list[PolicySource], list[dict[str, Any]]]:
    policies = [_policy(rng, f"p{i}") for i in range(rng.randint(1, 5))]
    pods, n = [], first_ip
    for ns, model in MODELS:
        for k in range(rng.randint(1, 2)):
            labels = {"sparsegate.dev/model": model, **({"app": "x"} if rng.random() < 0.3 else {})}
            ports = rng.sample([(8080, "TCP"), (9090, "TCP"), (8080, "UDP"), (7000, None)], rng.randint(0, 2))
            pods.append(_pod(rng, ns, f"{model}-{k}-{n}", f"10.9.{n // 200}.{n % 200 + 1}", labels,
                             rng.choice(["srv", "a"]), ports))
            n += 1
    for k in range(rng.randint(2, 7)):
        labels = {**({"app": rng.choice(["x", "z"])} if rng.random() < 0.5 else {}),
                  **({"tier": "y"} if rng.random() < 0.4 else {})}
        pods.append(_pod(rng, rng.choice(["ml", "web", "other"]), f"c{k}-{n}", f"10.9.{n // 200}.{n % 200 + 1}", labels,
                         rng.choice(["a", "b", "c", "default", None])))
        n += 1
    return policies, pods


def _opa(tmp: Path, rego: str, data: dict[str, Any], flow_input: dict[str, Any], query: str) -> dict[str, Any]:
    (tmp / "routing.rego").write_text(rego)
    (tmp / "data.json").write_text(json.dumps({"sparsegate": {"policies": data}}))
    (tmp / "input.json").write_text(json.dumps(flow_input))
    run = subprocess.run([str(find_binary("opa")), "eval", "-f", "json", "-d", str(tmp / "routing.rego"),
                          "-d", str(tmp / "data.json"), "-i", str(tmp / "input.json"), query],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout)["result"][0]["bindings"]


def _question(c: PodInfo, m: PodInfo, port: int, protocol: str, **scope: str) -> dict[str, Any]:
    return {"source": {"namespace": c.namespace, "serviceAccount": c.service_account, "labels": dict(c.labels)},
            "target": {"namespace": m.namespace, "sparseModel": m.model, "port": port, "protocol": protocol.upper(),
                       **scope}}


def _flows(pods: list[PodInfo]) -> list[tuple[PodInfo, PodInfo, int, str]]:
    return [(c, m, port, proto) for c in pods for m in pods if m.model and m is not c for port, proto in FLOW_PORTS]


def _expected(flows: list[tuple[PodInfo, PodInfo, int, str]], answers: list[dict[str, Any]],
              sources: list[PolicySource], data: dict[str, Any], pods: list[PodInfo]) -> list[tuple[bool, str]]:
    """(admitted, deciding rule or "") per flow, by the contract, from OPA's flow answers."""
    rules = {r.id: r for r in build_opa_data(sources=sources, trust_domain=TD, rego="")[1]}
    declared = {(p.namespace, p.model, port.port, port.protocol) for p in pods if p.model for port in p.ports}
    out = []
    for (c, m, port, proto), d in zip(flows, answers):
        if not ({f"{m.namespace}/{m.model}", f"{m.namespace}/*"} & set(data["targets"])):
            out.append((True, ""))  # not policed
        elif d["matched"]["deny"]:
            # Deny entries only explain drops: written for the ports worth asking about (those the
            # model's rules name, and its pods' ports when one names none); elsewhere the default drops.
            mine = [r for r in rules.values() if r.target_key in (f"{m.namespace}/{m.model}", f"{m.namespace}/*")]
            asked = {(p.port, p.protocol) for r in mine for p in r.ports} | (
                {(p, proto_) for ns, model, p, proto_ in declared if (ns, model) == (m.namespace, m.model)}
                if any(not r.ports for r in mine) else set())
            out.append((False, d["rule"] if (port, proto) in asked else ""))
        else:
            allows = [rules[i] for i in d["matched"]["allow"] if rules[i].ports or (m.namespace, m.model, port, proto)
                      in declared]
            out.append((True, min(allows, key=lambda r: (-r.priority, r.id)).id) if allows else (False, ""))
    return out


class AgentModel:
    """The agent's lookups on the records it writes (`sparsegate_ebpf.policy.compile_policy`)."""

    def __init__(self, document: dict[str, Any]) -> None:
        from sparsegate_ebpf.maps import IDENTITY_ALLOWED, KEY_POLICED_DST, KEY_RULE, KEY_SOURCE, ip_of
        from sparsegate_ebpf.policy import compile_policy, parse_policy
        self.policy = parse_policy(json.dumps(document))
        records = compile_policy(self.policy, generation=1)
        self.default = records[0][1].action
        self.policed = {ip_of(k.daddr): v.identity for k, v in records if k.kind == KEY_POLICED_DST}
        self.sources = {ip_of(k.saddr): v.identity for k, v in records if k.kind == KEY_SOURCE}
        self.rules = {(bytes(k.saddr), bytes(k.daddr), k.dport, k.proto): v for k, v in records if k.kind == KEY_RULE}
        self.allowed_identity = IDENTITY_ALLOWED

    def judge(self, src: str, dst: str, port: int, protocol: str) -> tuple[bool, str]:
        from sparsegate_ebpf.maps import ACTION_ALLOW, PROTO_NUMBERS, identity_addr, port_to_be16
        if dst not in self.policed:
            return True, ""
        src_id = self.sources.get(src, 0)
        if src_id == self.allowed_identity:
            return True, ""
        val = self.rules.get((bytes(identity_addr(src_id)), bytes(identity_addr(self.policed[dst])),
                              port_to_be16(port), PROTO_NUMBERS[protocol]))
        if val is None:
            return self.default == ACTION_ALLOW, ""
        return val.action == ACTION_ALLOW, self.policy.rule_names()[val.rule_id]


def _compare(tmp: Path, seed: int, xdp: Any = None, load: Any = None) -> dict[str, int]:
    rng, rego = random.Random(seed), routing_policy()
    sources, raw = _cluster(rng)
    pods = [p for p in map(pod_info, raw) if p]
    data, _ = build_opa_data(sources=sources, trust_domain=TD, rego=rego)
    question = flow_question(targets=data["targets"], pods=pods, trust_domain=TD)
    flows = _flows(pods)
    requests = [(k, _question(c, m, port, proto, expertGroup=g, route=r))
                for k, (c, m, port, proto) in enumerate(flows) if port != 7000
                for g, r in ((GROUPS[0], ROUTES[0]), (GROUPS[1], ROUTES[1]), (None, ROUTES[0]))]
    got = _opa(tmp, rego, data, {**question.input, "batch": [_question(*f) for f in flows] + [q for _, q in requests]},
               "f := data.sparsegate.routing.flow_decisions; b := data.sparsegate.routing.batch_decisions")
    document = flow_document(decisions=question.decisions(got["f"]), pods=pods, policed_models=question.models)
    agent = AgentModel(document)
    if load is not None:
        load(document)
    want = _expected(flows, got["b"][:len(flows)], sources, data, pods)
    seen = {"flows": 0, "policed": 0, "admitted": 0, "by_deny": 0, "by_request": 0}
    for (c, m, port, proto), (allow, rule), d in zip(flows, want, got["b"]):
        case = (seed, c.namespace, c.name, c.service_account, c.labels, m.namespace, m.name, m.ports, port, proto, d)
        for src, dst in ((s, t) for s in c.addresses for t in m.addresses if (":" in s) == (":" in t)):
            assert agent.judge(src, dst, port, proto) == (allow, rule), (src, dst, *case)
            if xdp is not None:
                assert (xdp(src, dst, port, proto) == "pass") == allow, ("xdp", src, dst, *case)
        policed = bool({f"{m.namespace}/{m.model}", f"{m.namespace}/*"} & set(data["targets"]))
        seen["flows"] += 1
        seen["policed"] += policed
        seen["admitted"] += allow and policed
        seen["by_deny"] += policed and bool(d["matched"]["deny"])
    # A request OPA allows, on a port its allowing rule names or the pods declare, is on an admitted flow.
    rules = {r.id: r for r in build_opa_data(sources=sources, trust_domain=TD, rego="")[1]}
    for (k, q), d in zip(requests, got["b"][len(flows):]):
        c, m, port, proto = flows[k]
        if d["allow"] and (rules[d["rule"]].ports or any(p.port == port and p.protocol == proto
                                                          for p in pods if p.model == m.model
                                                          and p.namespace == m.namespace for p in p.ports)):
            assert want[k][0], (seed, q, d)
            seen["by_request"] += 1
    return seen


@pytest.mark.opa
def test_allow_list_admits_exactly_what_opa_allows_per_flow(tmp_path: Path) -> None:
    totals = {"flows": 0, "policed": 0, "admitted": 0, "by_deny": 0, "by_request": 0}
    for seed in range(20):
        for k, v in _compare(tmp_path, seed).items():
            totals[k] += v
    # The generator must reach every kind of answer, or the comparison proves little.
    assert totals["policed"] > 3000 and totals["admitted"] > 200 and totals["by_deny"] > 80 \
        and totals["by_request"] > 200, totals


@pytest.mark.opa
@pytest.mark.bpf
def test_xdp_judges_generated_allow_lists_as_opa(tmp_path: Path, enforce_prog: Any) -> None:
    from sparsegate_ebpf import packets as P
    from sparsegate_ebpf.policy import parse_policy
    from sparsegate_ebpf.policyswap import PolicySwapper
    from sparsegate_ebpf.testrun import run_xdp

    swapper = PolicySwapper(bpf=enforce_prog.bpf)
    sport = iter(range(20000, 65000))

    def verdict(src: str, dst: str, port: int, protocol: str) -> str:
        frame = (P.tcp_frame(src=src, dst=dst, sport=next(sport), dport=port, flags=P.TCP_SYN) if protocol == "tcp"
                 else P.udp_frame(src=src, dst=dst, sport=next(sport), dport=port))
        return run_xdp(prog_fd=enforce_prog.prog_fd, data=frame).verdict

    for seed in range(100, 110):
        _compare(tmp_path, seed, xdp=verdict, load=lambda document: swapper.apply(parse_policy(json.dumps(document))))


class _Opa(FakeOpa):
    """Holds what was pushed and answers `flow_decisions` with the real `opa eval`, or raises."""

    def __init__(self, tmp: Path) -> None:
        super().__init__()
        self.tmp, self.data = tmp, None

    async def push(self, *, rego: str, data: dict[str, Any]) -> None:
        self.revision_held, self.data = data["revision"], data

    async def flow_decisions(self, flow_input: dict[str, Any]) -> dict[str, list[Any]]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return _opa(self.tmp, routing_policy(), self.data, flow_input, "f := data.sparsegate.routing.flow_decisions")["f"]


def _operator(tmp: Path, store: MemoryStore) -> tuple[_Opa, PolicySync]:
    opa = _Opa(tmp)
    return opa, PolicySync(settings=Settings(opa_url=opa.url, namespace="sparsegate-system", trust_domain=TD,
                                             resync_seconds=10), opa=opa, store=store)


def _changed(rng: random.Random, sources: list[PolicySource], raw: list[dict[str, Any]]
             ) -> tuple[list[PolicySource], list[dict[str, Any]]]:
    """Policies added, changed, deleted; pods relabelled, started (new IPs), gone, or their IP reused."""
    sources, raw = list(sources), copy.deepcopy(raw)
    more_sources, more_raw = _cluster(random.Random(rng.random()), first_ip=600)
    for _ in range(rng.randint(1, 3)):
        change = rng.randrange(6)
        if change == 0 and len(sources) > 1:
            sources.pop(rng.randrange(len(sources)))
        elif change == 1:
            new = more_sources[0]
            sources.append(PolicySource(new.namespace, f"new{rng.randrange(99)}", 1, new.spec))
        elif change == 2:
            i = rng.randrange(len(sources))
            sources[i] = PolicySource(sources[i].namespace, sources[i].name, sources[i].generation + 1,
                                      more_sources[-1].spec)
        elif change == 3:
            rng.choice(raw)["metadata"]["labels"].update(rng.choice([{"tier": "y"}, {"app": "x"}, {"app": "z"}]))
        elif change == 4:  # a pod gone, its IP now another class's
            gone = raw.pop(rng.randrange(len(raw)))
            raw.append({**copy.deepcopy(rng.choice(more_raw)), "status": gone["status"]})
        else:  # a pod started (a model's new replica or a caller)
            raw.append(copy.deepcopy(rng.choice(more_raw)))
    return list({s.key: s for s in sources}.values()), raw


@pytest.mark.opa
def test_allow_list_kept_while_opa_is_down_never_admits_what_opa_would_not(tmp_path: Path) -> None:
    rego, widened, narrowed = routing_policy(), [], 0
    for seed in range(30):
        rng = random.Random(seed)
        sources, raw = _cluster(rng)
        store = MemoryStore()
        opa, sync = _operator(tmp_path, store)
        asyncio.run(sync.sync(policies=sources, pods=[p for p in map(pod_info, raw) if p]))
        sources, raw = _changed(rng, sources, raw)
        pods = [p for p in map(pod_info, raw) if p]
        if rng.random() < 0.5:  # the operator restarted meanwhile
            opa, sync = _operator(tmp_path, store)
        opa.answer = OpaUnavailable("OPA at http://opa.test:8181: ConnectionError")
        with pytest.raises(OpaUnavailable):
            asyncio.run(sync.sync(policies=sources, pods=pods))
        assert store.document is not None
        data, _ = build_opa_data(sources=sources, trust_domain=TD, rego=rego)
        flows = _flows(pods)
        answers = _opa(tmp_path, rego, data, {"batch": [_question(*f) for f in flows]},
                       "b := data.sparsegate.routing.batch_decisions")["b"]
        agent = AgentModel(store.document)
        for (c, m, port, proto), (allow, _) in zip(flows, _expected(flows, answers, sources, data, pods)):
            admitted = any(agent.judge(s, t, port, proto)[0] for s in c.addresses for t in m.addresses
                           if (":" in s) == (":" in t))
            narrowed += admitted != allow
            if admitted and not allow:
                widened.append((seed, c.namespace, c.name, c.labels, m.namespace, m.name, port, proto))
    assert not widened, f"{len(widened)} flows admitted that today's policies deny, e.g. {widened[:3]}"
    assert narrowed > 100  # OPA down does take access away
    assert flowpolicy.POLICED_DESTINATIONS in store.document
