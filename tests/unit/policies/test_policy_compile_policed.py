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
