"""`PolicySync` keeps the published allow-list no wider than today's policies and pods allow when it
cannot publish OPA's answer: OPA down (in this process or after an operator restart), or an
allow-list too large to publish. OPA stands in at our own boundary (`RoutingOpa`'s methods); the
real one is the e2e suite's (tests/e2e/policies/test_opa_routing.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sparsegate.clients.opa import OpaUnavailable
from sparsegate.domain.policy import PolicySource, Port
from sparsegate.domain.policy_capacity import Capacity
from sparsegate.domain.policy_compile import FlowTable, PodInfo
from sparsegate.handlers.routingpolicy import PolicySync, Settings
from sparsegate_contracts import flowpolicy
from test_policy_sync_malformed_answer import FakeOpa, MemoryStore

M = PodInfo("models", "mixtral-0", "127.20.0.10", "default", (("sparsegate.dev/model", "mixtral"),), (Port(8080),))
TRUSTED = PodInfo("web", "fe-0", "127.20.1.1", "frontend", (("role", "trusted"),))
OTHER = PodInfo("web", "x-0", "127.20.1.2", "other", (("role", "other"),))
JOB = PodInfo("batch", "job-0", "127.20.2.1", "job", ())
ALLOW = PolicySource("models", "allow-trusted", 1, {
    "action": "Allow", "sources": [{"namespace": "web", "matchLabels": {"role": "trusted"}}],
    "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]})
ALLOW_WEB = PolicySource("models", "allow-web", 1, {
    "action": "Allow", "sources": [{"namespace": "web"}], "targets": [{"sparseModel": "mixtral"}],
    "ports": [{"port": 8080}]})
DENY = PolicySource("models", "deny-other", 1, {
    "action": "Deny", "sources": [{"namespace": "web", "serviceAccount": "other"}, {"namespace": "batch"}],
    "targets": [{"sparseModel": "mixtral"}], "ports": [{"port": 8080}]})


def opa_answer(policies: list[PolicySource]) -> Any:
    """What the Rego answers `flow_decisions` for these policies (all on 8080, Deny wins)."""
    def decide(namespace: str, service_account: str, labels: dict[str, str]) -> tuple[bool, str] | None:
        hits = []
        for p in policies:
            for i, source in enumerate(p.spec["sources"]):
                if source.get("namespace") == namespace and source.get("serviceAccount", service_account) == \
                        service_account and all(labels.get(k) == v for k, v in source.get("matchLabels", {}).items()):
                    hits.append((p.spec["action"] == "Allow", f"{p.key}#s{i}t0"))
        denies = [h for h in hits if not h[0]]
        return (denies or hits or [None])[0]

    def answer(q: dict[str, Any]) -> dict[str, list[Any]]:
        one, many = [], []
        for k, (_, ikey) in enumerate(q["one"]):
            ns = ikey.removeprefix("ns:").split("/ns/")[-1].split("/")[0]
            sa = ikey.split("/sa/")[1] if "/sa/" in ikey else "any"
            verdict = decide(ns, sa, {})
            if verdict:
                one.append([k, verdict[0], verdict[1], [{"port": 8080, "protocol": "tcp"}]])
        for i, j, buckets in q["many"]:
            c = q["classes"][i]
            ns = buckets[0][1].removeprefix("ns:").split("/ns/")[-1].split("/")[0]
            verdict = decide(ns, c["serviceAccount"], c.get("labels", {}))
            if verdict:
                many.append([i, j, 8080, "tcp", verdict[0], verdict[1]])
        return {"one": one, "many": many}
    return answer


def operator(store: MemoryStore, *, capacity: Capacity = Capacity()) -> tuple[FakeOpa, PolicySync]:
    """A new operator process (nothing in memory) over the published `store`."""
    opa = FakeOpa()
    return opa, PolicySync(settings=Settings(opa_url=opa.url, namespace="sparsegate-system",
                                             trust_domain="cluster.local", resync_seconds=10, capacity=capacity),
                           opa=opa, store=store)


async def sync_while_down(sync: PolicySync, opa: FakeOpa, policies: list[PolicySource], pods: list[PodInfo]) -> None:
    opa.answer = OpaUnavailable("OPA at http://opa.test:8181: ConnectionError")
    try:
        await sync.sync(policies=policies, pods=pods)
    except OpaUnavailable:
        return
    raise AssertionError("the sync did not report OPA down")


def allows(store: MemoryStore, src: PodInfo, dst: PodInfo = M) -> bool:
    assert store.document is not None
    return FlowTable.from_document(store.document).allows(src_ip=src.ip, dst_ip=dst.ip, port=8080)


def reaches(store: MemoryStore, src: PodInfo, dst: PodInfo) -> bool:
    """What an agent does: a destination the document does not police passes every caller."""
    assert store.document is not None
    return dst.ip not in flowpolicy.policed_of(store.document) or allows(store, src, dst)


async def decided(policies: list[PolicySource], pods: list[PodInfo]) -> tuple[MemoryStore, FakeOpa, PolicySync]:
    store = MemoryStore()
    opa, sync = operator(store)
    opa.answer = opa_answer(policies)
    await sync.sync(policies=policies, pods=pods)
    return store, opa, sync


async def test_a_pod_relabelled_while_opa_is_down_loses_the_access_of_its_old_labels() -> None:
    store, opa, sync = await decided([ALLOW], [M, TRUSTED])
    assert allows(store, TRUSTED)
    # fe-0 keeps its name and IP but no longer carries role=trusted, which the Allow requires
    relabelled = dataclasses.replace(TRUSTED, labels=(("role", "untrusted"),))
    await sync_while_down(sync, opa, [ALLOW], [M, relabelled])
    assert not allows(store, relabelled)


async def test_after_a_restart_while_opa_is_down_an_ip_reused_by_another_class_gets_no_access() -> None:
    store, _, _ = await decided([ALLOW], [M, TRUSTED])
    assert allows(store, TRUSTED)
    # fe-0 went and its IP now belongs to a pod of another class; a new operator starts, OPA is down
    newcomer = PodInfo("web", "evil-0", TRUSTED.ip, "evil", (("role", "untrusted"),))
    opa, restarted = operator(store)
    await sync_while_down(restarted, opa, [ALLOW], [M, newcomer])
    assert not allows(store, newcomer)


async def test_after_a_restart_while_opa_is_down_a_relabelled_model_pod_loses_access_unchanged_ones_not() -> None:
    store, _, _ = await decided([ALLOW], [M, TRUSTED])
    good = store.document
    opa, restarted = operator(store)
    await sync_while_down(restarted, opa, [ALLOW], [M, TRUSTED])
    assert store.document == good and allows(store, TRUSTED)
    # and a model pod relabelled to another model meanwhile leaves the model's identity
    moved = dataclasses.replace(M, labels=(("sparsegate.dev/model", "llama"),))
    opa, again = operator(store)
    await sync_while_down(again, opa, [ALLOW], [moved, TRUSTED])
    assert not allows(store, TRUSTED, moved)


async def test_a_deny_that_makes_the_allow_list_too_large_still_takes_the_access_away() -> None:
    """The allow-list of Allow + Deny does not fit (the Deny adds rows for batch's callers): it is
    not published, but the one kept must not let the denied caller through."""
    store = MemoryStore()
    opa, sync = operator(store, capacity=Capacity(max_records=5))
    pods = [M, TRUSTED, OTHER, JOB]
    opa.answer = opa_answer([ALLOW_WEB])
    await sync.sync(policies=[ALLOW_WEB], pods=pods)
    assert sync.too_large is None and allows(store, OTHER) and allows(store, TRUSTED)
    opa.answer = opa_answer([ALLOW_WEB, DENY])
    await sync.sync(policies=[ALLOW_WEB, DENY], pods=pods)
    assert sync.too_large is not None and "needs 7 policy map records, capacity 5" in sync.too_large
    assert not allows(store, OTHER), "the Deny's caller kept access through the allow-list kept"
    assert not allows(store, JOB)


async def test_model_pods_new_to_the_policies_while_opa_is_down_are_policed() -> None:
    """A replica of a policed model started, or a model a new Deny targets, while OPA is down: its pods
    must be judged (default deny), not left out of policedDestinations, where every caller passes."""
    replica = PodInfo("models", "mixtral-1", "127.20.0.11", "default", (("sparsegate.dev/model", "mixtral"),),
                      (Port(8080),))
    llama = PodInfo("models", "llama-0", "127.20.0.20", "default", (("sparsegate.dev/model", "llama"),), (Port(8080),))
    deny_llama = PolicySource("models", "deny-llama", 1, {
        "action": "Deny", "sources": [{"namespace": "batch"}], "targets": [{"sparseModel": "llama"}]})
    store, opa, sync = await decided([ALLOW], [M, TRUSTED, JOB, llama])
    assert not reaches(store, JOB, M) and reaches(store, JOB, llama)  # llama: no policy targets it yet
    await sync_while_down(sync, opa, [ALLOW], [M, replica, TRUSTED, JOB, llama])
    assert not reaches(store, JOB, replica), "a new replica of a policed model passed a caller no policy allows"
    await sync_while_down(sync, opa, [ALLOW, deny_llama], [M, replica, TRUSTED, JOB, llama])
    assert not reaches(store, JOB, llama), "a Deny added while OPA was down did not close its target"
    assert reaches(store, TRUSTED, M)  # what OPA allowed and no change touches stays
    # the same after a restart, OPA still down
    restarted_store = MemoryStore()
    opa, first = operator(restarted_store)
    opa.answer = opa_answer([ALLOW])
    await first.sync(policies=[ALLOW], pods=[M, TRUSTED, JOB, llama])
    opa, restarted = operator(restarted_store)
    await sync_while_down(restarted, opa, [ALLOW, deny_llama], [M, replica, TRUSTED, JOB, llama])
    assert not reaches(restarted_store, JOB, replica) and not reaches(restarted_store, JOB, llama)
