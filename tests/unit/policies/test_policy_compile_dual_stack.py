"""Dual-stack pods: the operator reads every address of `status.podIPs` and publishes each one
(identities, policed destinations, IP owners for narrowing), and the capacity check counts them."""
from __future__ import annotations

import pytest

from sparsegate_contracts import flowpolicy

from sparsegate.domain.policy_capacity import Capacity, check
from sparsegate.domain.policy_compile import (
    FlowTable,
    PodInfo,
    QueryKey,
    flow_document,
    ip_owners,
    listed_addresses,
    narrow_document,
    pod_info,
)


def pod_body(name: str, ns: str, ips: list[str], *, model: str | None = None, sa: str = "default") -> dict:
    labels = {"sparsegate.dev/model": model} if model else {}
    return {"metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {"serviceAccountName": sa, "containers": [{"ports": [{"containerPort": 8080}]}] if model else []},
            "status": {"phase": "Running", "podIP": ips[0], "podIPs": [{"ip": ip} for ip in ips]}}


def info(body: dict) -> PodInfo:
    got = pod_info(body)
    assert got is not None
    return got


M1 = info(pod_body("m-0", "models", ["10.1.0.10", "fd00:10::a"], model="mixtral"))
M2 = info(pod_body("m-1", "models", ["fd00:10::b"], model="mixtral"))  # IPv6-only pod
FE = info(pod_body("fe-0", "web", ["10.1.1.1", "FD00:11:0::1"], sa="frontend"))
PODS = [M1, M2, FE]
ALLOW = {QueryKey(namespace="web", service_account="frontend", labels=(), target_namespace="models", model="mixtral",
                  port=8080, protocol="tcp"): {"allow": True, "rule": "models/fe#s0t0"}}


def test_pod_info_reads_every_address_of_status_pod_ips() -> None:
    assert M1.ip == "10.1.0.10" and M1.addresses == ("10.1.0.10", "fd00:10::a")
    assert FE.addresses == ("10.1.1.1", "fd00:11::1")  # canonical text
    assert M2.ip == "fd00:10::b" and M2.addresses == ("fd00:10::b",) and M2.ips == ()
    # Only podIPs (podIP not yet set), and a single-stack pod stays as before.
    only_list = pod_body("p", "n", ["fd00::5"])
    del only_list["status"]["podIP"]
    assert info(only_list).ip == "fd00::5"
    single = info(pod_body("s", "n", ["10.0.0.5"]))
    assert single == PodInfo("n", "s", "10.0.0.5", "default", (), ())


def test_pod_with_no_usable_address_is_left_out() -> None:
    body = pod_body("p", "n", ["10.0.0.1"])
    body["status"] = {"phase": "Running", "podIPs": [{"ip": "not-an-ip"}, {}, "junk"]}
    assert pod_info(body) is None


def test_document_lists_both_families_of_every_pod() -> None:
    doc = flow_document(decisions=ALLOW, pods=PODS, policed_models=[("models", "mixtral")],
                        allowed_sources=["10.9.9.9", "fd00:99::9"])
    ips = {i["identity"]: i["ips"] for i in doc["identities"]}
    assert sorted(ips.values()) == [["10.1.0.10", "fd00:10::a", "fd00:10::b"], ["10.1.1.1", "fd00:11::1"]]
    assert doc["policedDestinations"] == ["10.1.0.10", "fd00:10::a", "fd00:10::b"]
    policy = flowpolicy.parse_document(doc)  # what the agents load
    assert policy.allowed_sources == ("10.9.9.9", "fd00:99::9")
    table = FlowTable.from_document(doc)
    assert table.allows(src_ip="fd00:11::1", dst_ip="fd00:10::b", port=8080)
    assert table.allows(src_ip="10.1.1.1", dst_ip="fd00:10::a", port=8080)  # families may mix in the table
    assert not table.allows(src_ip="fd00:11::2", dst_ip="fd00:10::b", port=8080)


def test_narrowing_follows_each_address() -> None:
    doc = flow_document(decisions=ALLOW, pods=PODS, policed_models=[("models", "mixtral")])
    owners = ip_owners(PODS)
    assert owners["fd00:11::1"] == owners["10.1.1.1"] == "web/fe-0"
    # fe-0's IPv6 address now belongs to another pod: it leaves the identity, its IPv4 one stays.
    now = dict(owners, **{"fd00:11::1": "web/other"})
    narrowed = narrow_document(document=doc, owners_then=owners, owners_now=now, live_policies={"models/fe"})
    ips = {ip for i in narrowed["identities"] for ip in i["ips"]}
    assert "fd00:11::1" not in ips and "10.1.1.1" in ips
    assert narrowed["policedDestinations"] == doc["policedDestinations"]


def test_capacity_counts_each_address() -> None:
    doc = flow_document(decisions=ALLOW, pods=PODS, policed_models=[("models", "mixtral")], allowed_sources=[])
    needed, too_large = check(doc, Capacity())
    # 1 rule + 3 policed addresses + 2 source addresses of fe-0.
    assert (needed.records, too_large) == (6, None)
    _, too_large = check(doc, Capacity(max_records=5))
    assert too_large is not None and "needs 6 policy map records, capacity 5" in too_large.message


def test_listed_addresses_from_the_downward_api() -> None:
    assert listed_addresses("10.0.0.3,FD00::3", where="POD_IPS") == ("10.0.0.3", "fd00::3")
    assert listed_addresses("", where="POD_IPS") == ()
    with pytest.raises(ValueError, match="POD_IPS: not an IPv4 or IPv6 address: 'fd00::zz'"):
        listed_addresses("10.0.0.3, fd00::zz", where="POD_IPS")


def test_operator_allows_its_own_addresses_of_both_families(monkeypatch: pytest.MonkeyPatch) -> None:
    from sparsegate.handlers.routingpolicy import Settings

    monkeypatch.setenv("POD_IP", "10.0.0.7")
    monkeypatch.setenv("POD_IPS", "10.0.0.7,fd00:0::7")
    assert Settings.from_env().allowed_sources == ["10.0.0.7", "fd00::7"]
    monkeypatch.setenv("POD_IPS", "fd00::7,bogus")
    with pytest.raises(ValueError, match="POD_IPS: not an IPv4 or IPv6 address: 'bogus'"):
        Settings.from_env()
