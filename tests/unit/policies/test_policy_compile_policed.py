"""The flow allow-list names what the agents police: every pod of a model some RoutingPolicy targets
(`policedDestinations`), and the operator's own IP (`allowedSources`); narrowing keeps both."""

from __future__ import annotations

from sparsegate_contracts import flowpolicy

from sparsegate.domain.policy import Port
from sparsegate.domain.policy_compile import PodInfo, QueryKey, flow_document, narrow_document


def pod(name: str, ns: str, ip: str, sa: str = "default", model: str | None = None) -> PodInfo:
    labels = {"sparsegate.dev/model": model} if model else {}
    return PodInfo(namespace=ns, name=name, ip=ip, service_account=sa, labels=tuple(sorted(labels.items())),
                   ports=(Port(8080),) if model else ())


M1, M2 = pod("m-0", "models", "127.21.0.10", model="mixtral"), pod("m-1", "models", "127.21.0.11", model="mixtral")
LLAMA = pod("l-0", "models", "127.21.0.12", model="llama")  # no policy targets it
FE = pod("fe-0", "web", "127.21.1.1", sa="frontend")
PODS = [M1, M2, LLAMA, FE]
ALLOW = {QueryKey(namespace="web", service_account="frontend", labels=(), target_namespace="models", model="mixtral",
                  port=8080, protocol="tcp"): {"allow": True, "rule": "models/fe#s0t0"}}


def test_every_pod_of_a_targeted_model_is_policed_even_without_entries() -> None:
    doc = flow_document(decisions={}, pods=PODS, policed_models=[("models", "mixtral")], allowed_sources=["10.9.9.9"])
    assert doc["rules"] == [] and doc["identities"] == []
    assert doc["policedDestinations"] == [M1.ip, M2.ip] and doc["allowedSources"] == ["10.9.9.9"]
    parsed = flowpolicy.parse_document(doc)
    assert parsed.policed_destinations == (M1.ip, M2.ip) and parsed.allowed_sources == ("10.9.9.9",)


def test_without_policed_models_the_document_is_as_before() -> None:
    doc = flow_document(decisions=ALLOW, pods=PODS)
    assert "policedDestinations" not in doc and "allowedSources" not in doc
    assert flowpolicy.parse_document(doc).policed_destinations == (M1.ip, M2.ip)  # the rules' destinations


def test_narrowing_never_unpolices_a_destination() -> None:
    doc = flow_document(decisions=ALLOW, pods=PODS, policed_models=[("models", "mixtral")], allowed_sources=[])
    narrowed = narrow_document(document=doc, owners_then=None, owners_now={}, live_policies=set())
    assert narrowed["rules"] == [] and narrowed["policedDestinations"] == [M1.ip, M2.ip]
    # A document that never listed them keeps the ones its rules named.
    legacy = flow_document(decisions=ALLOW, pods=PODS)
    narrowed = narrow_document(document=legacy, owners_then=None, owners_now={}, live_policies=set())
    assert narrowed["policedDestinations"] == [M1.ip, M2.ip]
    dropped = flowpolicy.without_policies(legacy, live=())
    assert dropped is not None and dropped["rules"] == [] and dropped["policedDestinations"] == [M1.ip, M2.ip]
    # Documents of older operators (entries form) narrow the same way.
    old = flowpolicy.build_document(entries=flowpolicy.ip_entries(legacy))
    dropped = flowpolicy.without_policies(old, live=())
    assert dropped is not None and dropped["entries"] == [] and dropped["policedDestinations"] == [M1.ip, M2.ip]


def test_a_targeted_model_is_policed_before_any_caller_pod_can_match() -> None:
    """An Allow for web/frontend while no frontend pod runs yet (or a Deny for a namespace with no
    pod): the model is policed all the same, so every caller meets the default deny (it was left
    out of the question and passed every caller until a matching pod existed)."""
    from sparsegate_contracts import rego

    from sparsegate.domain.policy import PolicySource, build_opa_data
    from sparsegate.domain.policy_compile import flow_question

    allow = {"action": "Allow", "sources": [{"namespace": "web", "serviceAccount": "frontend"}],
             "targets": [{"sparseModel": "mixtral"}]}
    data, _ = build_opa_data(sources=[PolicySource(namespace="models", name="fe", generation=1, spec=allow)],
                             trust_domain="cluster.local", rego=rego.routing_policy(None))
    other = pod("x-0", "other", "127.21.3.7", sa="attacker")
    question = flow_question(targets=data["targets"], pods=[M1, M2, LLAMA, other], trust_domain="cluster.local")
    assert list(question.models) == [("models", "mixtral")]
    doc = flow_document(decisions={}, pods=[M1, M2, LLAMA, other], policed_models=question.models, allowed_sources=[])
    assert flowpolicy.parse_document(doc).policed_destinations == (M1.ip, M2.ip)


def test_pods_the_allow_list_cannot_name_take_no_part() -> None:
    """A hostNetwork pod's address is its node's (shared; the data plane passes the node's traffic);
    an SCTP port is not policed (the allow-list has TCP and UDP only)."""
    from sparsegate.domain.policy_compile import pod_info

    def raw(name: str, *, host: bool = False, ports: tuple = ()) -> dict:
        return {"metadata": {"name": name, "namespace": "kube-system"},
                "spec": {"hostNetwork": host, "containers": [{"ports": [
                    {"containerPort": p, "protocol": proto} for p, proto in ports]}]},
                "status": {"phase": "Running", "podIP": "172.18.0.3"}}

    assert pod_info(raw("kube-proxy", host=True)) is None
    info = pod_info(raw("m", ports=((8080, "TCP"), (9999, "SCTP"), (53, "UDP"))))
    assert info is not None and [(p.port, p.protocol) for p in info.ports] == [(53, "udp"), (8080, "tcp")]


def test_an_address_two_classes_report_belongs_to_neither() -> None:
    """Pods of two classes reporting one address (an IP reused while the old pod is still listed):
    the agents refuse a document that gives an address two identities, which froze them on their
    last policy; the address gets none (default action), the rest of the document stands."""
    ghost = pod("fe-old", "web", FE.ip, sa="batch")
    decisions = {**ALLOW, QueryKey(namespace="web", service_account="batch", labels=(), target_namespace="models",
                                   model="mixtral", port=8080, protocol="tcp"): {"allow": True, "rule": "models/b#s0t0"}}
    doc = flow_document(decisions=decisions, pods=[*PODS, ghost], policed_models=[("models", "mixtral")],
                        allowed_sources=[])
    parsed = flowpolicy.parse_document(doc)  # the agents' own parser accepts it
    assert FE.ip not in {ip for ips in flowpolicy.identity_ips(doc).values() for ip in ips}
    assert parsed.policed_destinations == (M1.ip, M2.ip)
