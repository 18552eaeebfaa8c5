"""OPA decisions → flow allow-list (sparsegate.domain.policy_compile)."""

from __future__ import annotations

import itertools

from sparsegate_contracts import flowpolicy

from sparsegate.domain.policy import (
    PolicySource,
    Port,
    build_opa_data,
    decision_basis,
    source_digest,
    undecided_policies,
)
from sparsegate.domain.policy_compile import (
    FlowTable,
    PodInfo,
    QueryKey,
    candidate_queries,
    decision_counts,
    flow_document,
    flow_question,
    ip_owners,
    narrow_document,
    narrow_undecided,
    pod_info,
)

TD = "cluster.local"


def pod(name: str, ns: str, ip: str, sa: str = "default", model: str | None = None, ports: tuple = (), **labels: str) -> PodInfo:
    if model:
        labels = {**labels, "sparsegate.dev/model": model}
    return PodInfo(namespace=ns, name=name, ip=ip, service_account=sa, labels=tuple(sorted(labels.items())),
                   ports=tuple(Port(p) for p in ports))


M1 = pod("m-0", "models", "127.20.0.10", model="mixtral", ports=(8080,))
M2 = pod("m-1", "models", "127.20.0.11", model="mixtral", ports=(8080,))
FE = pod("fe-0", "web", "127.20.1.1", sa="frontend", app="fe")
FE2 = pod("fe-1", "web", "127.20.1.2", sa="frontend", app="fe")
OTHER = pod("x-0", "web", "127.20.1.3", sa="other")
BATCH = pod("job-0", "batch", "127.20.2.1", sa="job")


def test_pod_info_reads_identity_ip_and_ports() -> None:
    info = pod_info({
        "metadata": {"name": "m-0", "namespace": "models", "labels": {"sparsegate.dev/model": "mixtral"}},
        "spec": {"serviceAccountName": "srv", "containers": [{"ports": [{"containerPort": 8080, "name": "http"}]}]},
        "status": {"podIP": "127.20.0.10", "phase": "Running"},
    })
    assert info == PodInfo("models", "m-0", "127.20.0.10", "srv", (("sparsegate.dev/model", "mixtral"),), (Port(8080),))
    assert info.model == "mixtral"
    assert pod_info({"metadata": {"name": "p"}, "status": {}}) is None  # no IP yet
    assert pod_info({"metadata": {"name": "p"}, "status": {"podIP": "1.2.3.4", "phase": "Succeeded"}}) is None
    assert pod_info({"metadata": {"name": "p", "namespace": "n"}, "spec": {}, "status": {"podIP": "1.2.3.4"}}).service_account == "default"


def _targets(*policies: dict) -> dict:
    sources = [PolicySource(namespace="models", name=f"p{i}", generation=1, spec=s) for i, s in enumerate(policies)]
    return build_opa_data(sources=sources, trust_domain=TD, rego="")[0]["targets"]


def test_only_identity_classes_filed_under_the_target_are_asked() -> None:
    targets = _targets({"action": "Allow", "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
                        "targets": [{"sparseModel": "mixtral"}]})
    queries = candidate_queries(targets=targets, pods=[M1, M2, FE, FE2, OTHER, BATCH], trust_domain=TD)
    # fe-0 and fe-1 share one identity class; port from the model pods (the rule names none)
    assert queries == [QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp")]
    assert queries[0].opa_input(trust_domain=TD)["source"]["spiffeID"] == "spiffe://cluster.local/ns/web/sa/frontend"


def test_flow_question_joins_classes_and_buckets_and_asks_what_the_questions_ask() -> None:
    """One question for the whole allow-list: the (class, model) pairs and candidate ports are the
    per-question path's, and only a pair with one unconditional rule skips gathering in OPA."""
    targets = _targets(
        {"action": "Allow", "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
         "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 9090}]},
        {"action": "Deny", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "*"}]},
        {"action": "Allow", "sources": [{"namespace": "web", "serviceAccount": "other", "matchLabels": {"a": "b"}}],
         "targets": [{"sparseModel": "mixtral"}]})
    pods = [M1, M2, FE, FE2, OTHER, BATCH]
    q = flow_question(targets=targets, pods=pods, trust_domain=TD)
    assert q.models == (("models", "mixtral"),)
    fe = "spiffe://cluster.local/ns/web/sa/frontend"
    other = "spiffe://cluster.local/ns/web/sa/other"
    candidates = ((8080, "tcp"), (9090, "tcp"))
    # One unconditional rule alone decides frontend's and batch's pairs: their buckets, asked once each.
    one = dict(zip(map(tuple, q.input["one"]), q.one_pairs))
    assert one == {("models/mixtral", fe): ((FE.identity, ("models", "mixtral"), candidates),),
                   ("models/*", "ns:batch"): ((BATCH.identity, ("models", "mixtral"), candidates),)}
    # A label condition must be checked against the class: gathered, with the class and the model
    # (and its candidate ports) the only rows of `classes` and `models`.
    assert q.many_classes == (OTHER.identity,) and q.many_models == (("models", "mixtral"),)
    assert q.input["classes"] == [{"serviceAccount": "other"}]
    assert q.input["models"] == [{"namespace": "models", "sparseModel": "mixtral",  # 8080: the pods'
                                  "ports": [{"port": 8080, "protocol": "tcp", "declared": True},
                                            {"port": 9090, "protocol": "tcp"}]}]
    assert q.declared == {("models", "mixtral"): ((8080, "tcp"),)}
    assert q.input["many"] == [[0, 0, [["models/mixtral", other]]]]
    # Every question the per-question path asks names a pair of the one question, on its ports.
    pairs = {(c[:2], m) for pairs in q.one_pairs for c, m, _ in pairs}
    pairs |= {(q.many_classes[i][:2], q.many_models[j]) for i, j, _ in q.input["many"]}
    asked = candidate_queries(targets=targets, pods=pods, trust_domain=TD)
    assert {((a.namespace, a.service_account), (a.target_namespace, a.model)) for a in asked} == pairs
    assert {a.port for a in asked} == {8080, 9090}


def test_flow_question_asks_a_bucket_once_for_every_pair_it_decides() -> None:
    """A namespace-wide rule decides every class of the namespace: one `one` row, answered once,
    expanded by `decisions` to each class on the ports the rule names (none named: every candidate)."""
    targets = _targets({"action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "mixtral"}]})
    q = flow_question(targets=targets, pods=[M1, FE, FE2, OTHER], trust_domain=TD)
    assert q.input["one"] == [["models/mixtral", "ns:web"]] and q.input["many"] == []
    assert {c for c, _, _ in q.one_pairs[0]} == {FE.identity, OTHER.identity}
    rule = "models/p0#s0t0"
    decided = q.decisions({"one": [[0, True, rule, []]], "many": []})
    assert decided == {QueryKey(*c, "models", "mixtral", 8080, "tcp"): {"allow": True, "rule": rule}
                       for c in (FE.identity, OTHER.identity)}
    # Ports the rule names replace the model's candidates.
    named = q.decisions({"one": [[0, False, rule, [{"port": 9090, "protocol": "tcp"}]]], "many": []})
    assert {(k.service_account, k.port, v["allow"]) for k, v in named.items()} == {("frontend", 9090, False),
                                                                                   ("other", 9090, False)}


def test_rule_ports_and_namespace_wide_selectors() -> None:
    targets = _targets({"action": "Deny", "sources": [{"namespace": "*"}], "targets": [{"sparseModel": "*"}],
                        "ports": [{"port": 9090}]})
    queries = candidate_queries(targets=targets, pods=[M1, FE, BATCH], trust_domain=TD)
    assert {(q.namespace, q.port) for q in queries} == {("models", 9090), ("web", 9090), ("batch", 9090)}


def test_no_rules_no_queries() -> None:
    assert candidate_queries(targets={}, pods=[M1, FE], trust_domain=TD) == []


def test_flow_document_gives_classes_identities_and_rules() -> None:
    allow = QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp")
    denied = QueryKey("batch", "job", (), "models", "mixtral", 8080, "tcp")
    unmatched = QueryKey("web", "other", (), "models", "mixtral", 8080, "tcp")
    decisions = {
        allow: {"allow": True, "rule": "models/p0#s0t0"},
        denied: {"allow": False, "rule": "models/deny#s0t0"},
        unmatched: {"allow": False, "rule": ""},
    }
    doc = flow_document(decisions=decisions, pods=[M1, M2, FE, FE2, OTHER, BATCH])
    assert doc["defaultAction"] == "deny" and doc["version"].startswith("sha256:")
    # One identity per class a rule involves (fe-0/fe-1 share one, m-0/m-1 another), one rule per
    # (source class, model pods' class, port): not source pods x model pods.
    members = {tuple(i["ips"]) for i in doc["identities"]}
    assert members == {(BATCH.ip,), (FE.ip, FE2.ip), (M1.ip, M2.ip)}
    assert all(i["identity"] >= flowpolicy.FIRST_IDENTITY for i in doc["identities"])
    assert len(doc["rules"]) == 2 and "entries" not in doc
    entries = flowpolicy.ip_entries(doc)
    allowed = {(e["srcIP"], e["dstIP"]) for e in entries if e["action"] == "allow"}
    assert allowed == set(itertools.product([FE.ip, FE2.ip], [M1.ip, M2.ip]))
    denied_rows = [e for e in entries if e["action"] == "deny"]
    assert {e["srcIP"] for e in denied_rows} == {BATCH.ip} and denied_rows[0]["rule"] == "models/deny#s0t0"
    assert all(e["srcIP"] != OTHER.ip for e in entries)  # default deny, no identity, no rule
    assert decision_counts(doc) == {"models/p0": 4, "models/deny": 2}  # IP-level pairs
    assert flow_document(decisions=dict(reversed(decisions.items())), pods=[BATCH, FE2, FE, OTHER, M2, M1]) == doc

    table = FlowTable.from_document(doc)
    assert table.allows(src_ip=FE.ip, dst_ip=M2.ip, port=8080)
    assert not table.allows(src_ip=FE.ip, dst_ip=M2.ip, port=8081)
    assert not table.allows(src_ip=BATCH.ip, dst_ip=M1.ip, port=8080)
    assert not table.allows(src_ip=OTHER.ip, dst_ip=M1.ip, port=8080)


def test_decision_count_is_pod_pairs_times_ports_on_dual_stack_too() -> None:
    """status.decisionCount is (caller pod, model pod, port) triples (README, CRD): a dual-stack pod's
    two addresses (one per family) are one pod. Counted per address pair, one caller pod allowed one
    model pod on one port was 4 decisions (2 of them an IPv4 caller to an IPv6 address)."""
    import dataclasses

    m = dataclasses.replace(M1, ips=(M1.ip, "fd00::10"))
    fe = dataclasses.replace(FE, ips=(FE.ip, "fd00::1:1"))
    allow = QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp")
    doc = flow_document(decisions={allow: {"allow": True, "rule": "models/p0#s0t0"}}, pods=[m, fe])
    assert len(flowpolicy.ip_entries(doc)) == 4  # what the agents enforce: every address pair
    assert decision_counts(doc) == {"models/p0": 1}  # without the pods: a class's addresses of one family
    assert decision_counts(doc, ip_owners([m, fe])) == {"models/p0": 1}
    # A second caller pod, IPv4 only, of the same class: 2 pods x 1 model pod x 1 port.
    fe2 = FE2
    doc = flow_document(decisions={allow: {"allow": True, "rule": "models/p0#s0t0"}}, pods=[m, fe, fe2])
    assert decision_counts(doc, ip_owners([m, fe, fe2])) == {"models/p0": 2}


def test_model_pods_of_two_classes_get_a_rule_each() -> None:
    canary = pod("m-2", "models", "127.20.0.12", model="mixtral", ports=(8080,), track="canary")
    allow = QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp")
    doc = flow_document(decisions={allow: {"allow": True, "rule": "models/p0#s0t0"}}, pods=[M1, M2, canary, FE])
    assert len(doc["rules"]) == 2 and len(doc["identities"]) == 3
    assert {e["dstIP"] for e in flowpolicy.ip_entries(doc)} == {M1.ip, M2.ip, canary.ip}


def test_identity_form_is_far_smaller_than_ip_pairs() -> None:
    models = [pod(f"m-{i}", "models", f"127.30.0.{i + 1}", model="mixtral", ports=(8080,)) for i in range(50)]
    callers = [pod(f"fe-{i}", "web", f"127.31.{i // 200}.{i % 200 + 1}", sa="frontend", app="fe") for i in range(400)]
    allow = QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp")
    doc = flow_document(decisions={allow: {"allow": True, "rule": "models/p0#s0t0"}}, pods=models + callers,
                        policed_models=[("models", "mixtral")])
    assert len(doc["rules"]) == 1 and decision_counts(doc) == {"models/p0": 400 * 50}
    # records: 1 rule + 50 policed destinations + 400 source addresses (not 20,000 entries)
    assert flowpolicy.map_records(doc) == 1 + 50 + 400


def test_narrowing_never_widens() -> None:
    decisions = {
        QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp"): {"allow": True, "rule": "models/a#s0t0"},
        QueryKey("web", "other", (), "models", "mixtral", 8080, "tcp"): {"allow": True, "rule": "models/b#s0t0"},
    }
    pods = [M1, M2, FE, FE2, OTHER]
    doc = flow_document(decisions=decisions, pods=pods)
    then = ip_owners(pods)
    # fe-1 is gone, its IP now belongs to a new pod; policy b was deleted; m-1 is gone
    newcomer = pod("evil-0", "web", FE2.ip, sa="frontend", app="fe")
    now = ip_owners([M1, FE, OTHER, newcomer])
    narrowed = narrow_document(document=doc, owners_then=then, owners_now=now, live_policies={"models/a"})
    old_rows = {tuple(sorted(e.items())) for e in flowpolicy.ip_entries(doc)}
    new_rows = {tuple(sorted(e.items())) for e in flowpolicy.ip_entries(narrowed)}
    assert new_rows < old_rows
    assert {(e["srcIP"], e["dstIP"]) for e in flowpolicy.ip_entries(narrowed)} == {(FE.ip, M1.ip)}
    table = FlowTable.from_document(narrowed)
    assert not table.allows(src_ip=FE2.ip, dst_ip=M1.ip, port=8080)  # the reused IP left its identity
    # Without owner knowledge (a restarted operator) nor recorded classes, only deleted policies go.
    kept = narrow_document(document=doc, owners_then=None, owners_now=now, live_policies={"models/a", "models/b"})
    assert kept == doc


def test_narrowing_drops_ips_whose_pod_is_now_of_another_class_than_recorded() -> None:
    """Without pod owners (a restarted operator), the class each identity was recorded for still
    tells a relabelled pod or a reused IP: its IP leaves the identity; unchanged ones stay."""
    from sparsegate.domain.policy_compile import identity_classes, ip_classes

    decisions = {QueryKey("web", "frontend", (("app", "fe"),), "models", "mixtral", 8080, "tcp"):
                 {"allow": True, "rule": "models/a#s0t0"}}
    pods = [M1, M2, FE, FE2]
    doc = flow_document(decisions=decisions, pods=pods)
    recorded = identity_classes(doc, pods)
    assert len(recorded) == 2  # the callers' class and the model's
    relabelled = pod("fe-0", "web", FE.ip, sa="frontend", app="evil")
    reused = pod("evil-0", "web", FE2.ip, sa="evil", app="fe")
    now = [M1, M2, relabelled, reused]
    narrowed = narrow_document(document=doc, owners_then=None, owners_now=ip_owners(now), live_policies={"models/a"},
                               classes_then=recorded, classes_now=ip_classes(now))
    table = FlowTable.from_document(narrowed)
    assert not table.allows(src_ip=FE.ip, dst_ip=M1.ip, port=8080)
    assert not table.allows(src_ip=FE2.ip, dst_ip=M1.ip, port=8080)
    kept = narrow_document(document=doc, owners_then=None, owners_now=ip_owners(pods), live_policies={"models/a"},
                           classes_then=recorded, classes_now=ip_classes(pods))
    assert kept == doc
    # An identity the record does not name vouches for none of its IPs.
    unvouched = narrow_document(document=doc, owners_then=None, owners_now={}, live_policies={"models/a"},
                                classes_then={}, classes_now=ip_classes(pods))
    assert flowpolicy.ip_entries(unvouched) == []


def test_policies_named_and_narrowing_to_live_policies_without_pod_owners() -> None:
    """The operator's startup check: entries of policies that are gone are dropped, nothing else."""
    from sparsegate.domain.policy_compile import narrow_document, policies_named

    rows = [flowpolicy.entry(src_ip="10.0.0.1", dst_ip="10.0.0.2", dst_port=8080, protocol="tcp", action="allow",
                             rule=f"{key}#r0") for key in ("a/kept", "b/deleted")]
    document = flowpolicy.build_document(entries=rows)
    assert policies_named(document) == {"a/kept", "b/deleted"}
    narrowed = narrow_document(document=document, owners_then=None, owners_now={}, live_policies={"a/kept"})
    assert [e["rule"] for e in narrowed["entries"]] == ["a/kept#r0"]
    assert narrowed["defaultAction"] == flowpolicy.DENY


# --- Fail closed on policy changes OPA could not evaluate -------------------------------------------

LLAMA = pod("l-0", "models", "127.20.0.20", model="llama", ports=(8080,))
OTHER_NS_MODEL = pod("n-0", "elsewhere", "127.20.0.30", model="mixtral", ports=(8080,))
PODS = [M1, M2, LLAMA, OTHER_NS_MODEL, FE, FE2, OTHER, BATCH]


def allow(src: PodInfo, dst: PodInfo, policy: str, port: int = 8080) -> dict:
    return flowpolicy.entry(src_ip=src.ip, dst_ip=dst.ip, dst_port=port, protocol="tcp", action="allow",
                            rule=f"{policy}#s0t0")


def deny(src: PodInfo, dst: PodInfo, policy: str) -> dict:
    return flowpolicy.entry(src_ip=src.ip, dst_ip=dst.ip, dst_port=8080, protocol="tcp", action="deny",
                            rule=f"{policy}#s0t0")


# The last decided allow-list: frontend → both mixtral pods and llama (policy fe), other → mixtral-0
# (policy wide), mixtral in another namespace (policy far), batch denied (policy no-batch).
DECIDED = flowpolicy.build_document(entries=[
    allow(FE, M1, "models/fe"), allow(FE, M2, "models/fe"), allow(FE, LLAMA, "models/fe"),
    allow(OTHER, M1, "models/wide"), allow(FE2, OTHER_NS_MODEL, "elsewhere/far"), deny(BATCH, M1, "models/no-batch"),
])


def rows(document: dict) -> set[tuple[str, str, str, str]]:
    return {(e["srcIP"], e["dstIP"], e["action"], e["rule"].split("#")[0]) for e in document["entries"]}


def source(name: str, spec: dict, *, ns: str = "models", generation: int = 1) -> PolicySource:
    return PolicySource(namespace=ns, name=name, generation=generation, spec=spec)


FE_SPEC = {"action": "Allow", "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
           "targets": [{"sparseModel": "mixtral"}, {"sparseModel": "llama"}]}
WIDE_SPEC = {"action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "*"}]}
SOURCES = [source("fe", FE_SPEC), source("wide", WIDE_SPEC), source("far", WIDE_SPEC, ns="elsewhere"),
           source("no-batch", {"action": "Deny", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "*"}]})]


def test_nothing_undecided_removes_nothing() -> None:
    out = narrow_undecided(document=DECIDED, sources=SOURCES, undecided=set(), pods=PODS)
    assert out == DECIDED


def test_a_deny_added_removes_every_allow_towards_its_targets_whoever_allowed_it() -> None:
    added = source("deny-mixtral", {"action": "Deny", "sources": [{"spiffeID": "spiffe://x/ns/y/sa/z"}],
                                    "targets": [{"sparseModel": "mixtral"}]})
    out = narrow_undecided(document=DECIDED, sources=[*SOURCES, added], undecided={"models/deny-mixtral"}, pods=PODS)
    # mixtral in `models` is closed to everyone (fe and wide); llama and the other namespace's mixtral stay
    assert rows(out) == {(FE.ip, LLAMA.ip, "allow", "models/fe"), (FE2.ip, OTHER_NS_MODEL.ip, "allow", "elsewhere/far"),
                         (BATCH.ip, M1.ip, "deny", "models/no-batch")}
    assert rows(out) <= rows(DECIDED) and out["defaultAction"] == "deny"


def test_a_deny_with_wildcard_targets_removes_every_model_of_its_namespace_and_unknown_ips() -> None:
    wild = source("deny-all", {"action": "Deny", "sources": [{"namespace": "*"}], "targets": [{"sparseModel": "*"}]})
    gone = flowpolicy.entry(src_ip=FE.ip, dst_ip="127.20.9.9", dst_port=8080, protocol="tcp", action="allow",
                            rule="elsewhere/far#s0t0")  # towards an IP no pod has now
    document = flowpolicy.build_document(entries=[*DECIDED["entries"], gone])
    out = narrow_undecided(document=document, sources=[*SOURCES, wild], undecided={"models/deny-all"}, pods=PODS)
    assert rows(out) == {(FE2.ip, OTHER_NS_MODEL.ip, "allow", "elsewhere/far"), (BATCH.ip, M1.ip, "deny", "models/no-batch")}


def test_an_allow_narrowed_or_retargeted_loses_all_it_allowed_and_nothing_else() -> None:
    # fe no longer names llama: the llama entry must go (the new spec's targets would not find it)
    narrowed = source("fe", {**FE_SPEC, "targets": [{"sparseModel": "mixtral"}]}, generation=2)
    sources = [narrowed, *SOURCES[1:]]
    out = narrow_undecided(document=DECIDED, sources=sources, undecided={"models/fe"}, pods=PODS)
    assert rows(out) == rows(DECIDED) - {(FE.ip, M1.ip, "allow", "models/fe"), (FE.ip, M2.ip, "allow", "models/fe"),
                                         (FE.ip, LLAMA.ip, "allow", "models/fe")}
    # an Allow turned into a Deny also closes its targets to the others
    turned = source("fe", {**FE_SPEC, "action": "Deny"}, generation=3)
    out = narrow_undecided(document=DECIDED, sources=[turned, *SOURCES[1:]], undecided={"models/fe"}, pods=PODS)
    assert rows(out) == {(FE2.ip, OTHER_NS_MODEL.ip, "allow", "elsewhere/far"), (BATCH.ip, M1.ip, "deny", "models/no-batch")}


def test_a_new_allow_removes_nothing() -> None:
    new = source("new", WIDE_SPEC)
    assert narrow_undecided(document=DECIDED, sources=[*SOURCES, new], undecided={"models/new"}, pods=PODS) == DECIDED


def test_everything_undecided_keeps_no_allow_of_a_live_policy() -> None:
    """An operator restarted while OPA is down, with no record of what OPA decided."""
    out = narrow_undecided(document=DECIDED, sources=SOURCES, undecided={s.key for s in SOURCES}, pods=PODS)
    assert [e["action"] for e in out["entries"]] == ["deny"]


def test_undecided_policies_follow_generation_spec_rego_and_trust_domain() -> None:
    basis = decision_basis(sources=SOURCES, trust_domain=TD, rego="package a")
    assert undecided_policies(current=basis, decided=basis) == set()
    assert undecided_policies(current=basis, decided=None) == {s.key for s in SOURCES}
    bumped = [source("fe", FE_SPEC, generation=2), *SOURCES[1:]]  # same spec, new generation: undecided
    assert undecided_policies(current=decision_basis(sources=bumped, trust_domain=TD, rego="package a"),
                              decided=basis) == {"models/fe"}
    # deleted and re-created with another spec: generation 1 again, the digest tells them apart
    recreated = [source("fe", {**FE_SPEC, "targets": [{"sparseModel": "*"}]}), *SOURCES[1:]]
    assert source_digest(recreated[0]) != source_digest(SOURCES[0])
    assert undecided_policies(current=decision_basis(sources=recreated, trust_domain=TD, rego="package a"),
                              decided=basis) == {"models/fe"}
    added = [*SOURCES, source("new", WIDE_SPEC)]
    assert undecided_policies(current=decision_basis(sources=added, trust_domain=TD, rego="package a"),
                              decided=basis) == {"models/new"}
    assert undecided_policies(current=decision_basis(sources=SOURCES, trust_domain=TD, rego="package b"),
                              decided=basis) == {s.key for s in SOURCES}
    assert undecided_policies(current=decision_basis(sources=SOURCES, trust_domain="other.td", rego="package a"),
                              decided=basis) == {s.key for s in SOURCES}
