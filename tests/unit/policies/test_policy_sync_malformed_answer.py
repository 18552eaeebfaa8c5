"""A `flow_decisions` answer not shaped as the Rego defines (only a broken Rego gives one) fails
closed exactly as an unreachable OPA does: `OpaUnavailable` naming the entry, the published
allow-list only narrowed; nothing of the answer is used (coerced, a string "false" read as allow).
OPA stands in at our own boundary (`RoutingOpa`'s methods); the real one is the e2e suite's."""

from __future__ import annotations

from typing import Any

import pytest
from sparsegate_contracts import flowpolicy

from sparsegate.clients.opa import OpaUnavailable
from sparsegate.domain.policy import PolicySource, Port
from sparsegate.domain.policy_compile import MalformedAnswer, PodInfo, flow_question
from sparsegate.handlers.routingpolicy import PolicySync, Settings

RULE, LABELLED = "models/allow-web#s0t0", "models/allow-fe#s0t0"
PODS = [PodInfo(namespace="models", name="mixtral-0", ip="127.20.0.10", service_account="default",
                labels=(("sparsegate.dev/model", "mixtral"),), ports=(Port(8080),)),
        PodInfo(namespace="models", name="llama-0", ip="127.20.0.11", service_account="default",
                labels=(("sparsegate.dev/model", "llama"),), ports=(Port(8080),)),
        PodInfo(namespace="web", name="fe-0", ip="127.20.1.1", service_account="frontend", labels=(("app", "fe"),))]


def policies(generation: int, port: int) -> list[PolicySource]:
    """One rule decided alone (OPA's `one`: a service account) and one with a label condition (`many`)."""
    def allow(name: str, model: str, **source: Any) -> PolicySource:
        return PolicySource(namespace="models", name=name, generation=generation, spec={
            "action": "Allow", "priority": 10, "sources": [{"namespace": "web", "serviceAccount": "frontend", **source}],
            "targets": [{"sparseModel": model}], "ports": [{"port": port}]})
    return [allow("allow-fe", "llama", matchLabels={"app": "fe"}), allow("allow-web", "mixtral")]


class FakeOpa:
    """Holds what was pushed; answers `flow_decisions` with `answer(question input)`, or raises."""

    url = "http://opa.test:8181"

    def __init__(self) -> None:
        self.revision_held: str | None = None
        self.answer: Any = None

    async def revision(self) -> str | None:
        if isinstance(self.answer, Exception):  # unreachable: every call fails
            raise self.answer
        return self.revision_held

    async def push(self, *, rego: str, data: dict[str, Any]) -> None:
        self.revision_held = data["revision"]

    async def loaded_policies(self) -> dict[str, dict[str, Any]]:
        return {}

    async def flow_decisions(self, flow_input: dict[str, Any]) -> dict[str, list[Any]]:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer(flow_input)


class MemoryStore:
    half_published = False

    def __init__(self) -> None:
        self.document: dict[str, Any] | None = None
        self.basis: dict[str, Any] | None = None

    async def read_published(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        return self.document, self.basis

    async def publish(self, document: dict[str, Any], *, basis: dict[str, Any] | None = None) -> None:
        self.document, self.basis = document, basis


def allowed(flow_input: dict[str, Any], port: int = 8080) -> dict[str, list[Any]]:
    """OPA's well-formed answer: both rules allow, on `port`."""
    return {"one": [[k, True, RULE, [{"port": port, "protocol": "tcp"}]] for k in range(len(flow_input["one"]))],
            "many": [[i, j, port, "tcp", True, LABELLED] for i, j, _ in flow_input["many"]]}


def with_entry(part: str, entry: Any) -> Any:
    """The well-formed answer (on 9090) with its first `part` entry replaced by `entry`."""
    def answer(flow_input: dict[str, Any]) -> dict[str, Any]:
        out = allowed(flow_input, port=9090)
        out[part] = [entry, *out[part][1:]] if entry is not None else "nope"
        return out
    return answer


async def after_second_sync(second: Any) -> tuple[dict[str, Any], Exception | None]:
    """Policy decided and published on 8080; then changed to 9090 and OPA answers `second`."""
    opa, store = FakeOpa(), MemoryStore()
    sync = PolicySync(settings=Settings(opa_url=opa.url, namespace="sparsegate-system", trust_domain="cluster.local",
                                        resync_seconds=10), opa=opa, store=store)
    opa.answer = allowed
    await sync.sync(policies=policies(1, 8080), pods=PODS)
    assert sorted(e["rule"] for e in flowpolicy.ip_entries(store.document)) == [LABELLED, RULE]
    opa.answer = second
    error = None
    try:
        await sync.sync(policies=policies(2, 9090), pods=PODS)
    except OpaUnavailable as e:
        error = e
    assert store.document is not None
    return store.document, error


@pytest.mark.parametrize(("answer", "part"), [
    (with_entry("many", [0, 0, 9090, "tcp", "false", LABELLED]), "flow_decisions.many[0]: expected a boolean allow"),
    (with_entry("many", [0, 0, "9090", "tcp", True, LABELLED]), "flow_decisions.many[0]: expected an integer port"),
    (with_entry("many", [0, 0, 9090]), "flow_decisions.many[0]: expected [class, model, port"),
    (with_entry("many", [-1, 0, 9090, "tcp", True, LABELLED]), "expected a class index below 1"),
    (with_entry("many", None), "flow_decisions.many: expected a list"),
    (with_entry("one", [0, 1, RULE, []]), "flow_decisions.one[0]: expected a boolean allow"),
    (with_entry("one", [1, True, RULE, []]), "flow_decisions.one[0][0]: expected an index below 1"),
    (with_entry("one", [0, True, RULE, [{"port": 9090}]]), "flow_decisions.one[0][3]: expected ports as"),
    (with_entry("one", {"k": 0}), "flow_decisions.one[0]: expected [index, allow, rule, ports]"),
])
async def test_a_malformed_answer_fails_closed_as_an_unreachable_opa(answer: Any, part: str) -> None:
    document, error = await after_second_sync(answer)
    assert error is not None and part in str(error) and "malformed answer, not used" in str(error)
    assert isinstance(error.__cause__, MalformedAnswer)
    # Exactly what OPA being down leaves: the changed policy's allow entries gone, nothing added.
    down, _ = await after_second_sync(OpaUnavailable("OPA at http://opa.test:8181: ConnectionError"))
    assert document == down and flowpolicy.ip_entries(document) == []


async def test_a_well_formed_answer_is_still_published() -> None:
    document, error = await after_second_sync(lambda q: allowed(q, port=9090))
    assert error is None
    assert sorted((e["dstPort"], e["rule"]) for e in flowpolicy.ip_entries(document)) == [
        (9090, LABELLED), (9090, RULE)]


def test_the_question_reads_a_well_formed_answer_unchanged() -> None:
    from sparsegate.domain.policy import build_opa_data

    data, _ = build_opa_data(sources=policies(1, 8080), trust_domain="cluster.local", rego="")
    question = flow_question(targets=data["targets"], pods=PODS, trust_domain="cluster.local")
    assert len(question.input["one"]) == 1 and len(question.input["many"]) == 1  # both parts exercised
    decisions = question.decisions(allowed(question.input))
    assert sorted((k.namespace, k.service_account, k.model, k.port, k.protocol, d["allow"], d["rule"])
                  for k, d in decisions.items()) == [("web", "frontend", "llama", 8080, "tcp", True, LABELLED),
                                                     ("web", "frontend", "mixtral", 8080, "tcp", True, RULE)]
