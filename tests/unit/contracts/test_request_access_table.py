"""The access document's parser (errors name the field) and what a request may activate
(`AccessTable.scope`): a named group's experts, the whole model less denied groups, or nothing."""

from __future__ import annotations

import copy

import pytest

from sparsegate.domain.policy import rules_from_spec
from sparsegate.domain.request_access import access_document
from sparsegate_contracts.request_access import AccessDocumentError, parse_access_document

GROUPS = {"math": (0, 1), "code": (2, 3), "chat": (4, 5)}


def _table(*specs: dict, port: int = 8080):
    rules = [r for i, spec in enumerate(specs) for r in rules_from_spec(namespace="ml", name=f"p{i}", spec=spec)]
    return parse_access_document(access_document(rules, namespace="ml", model="moe", serving_port=port,
                                                 trust_domain="cluster.local"))


def _allow(sa: str, **target) -> dict:
    return {"action": "Allow", "sources": [{"namespace": "web", "serviceAccount": sa}],
            "targets": [{"sparseModel": "moe", **target}]}


def _scope(table, sa: str, group: str | None, route: str = "/v1/infer"):
    return table.scope(namespace="web", service_account=sa, route=route, group=group, groups=GROUPS,
                       num_experts=8)


def test_no_policy_no_enforcement():
    table = _table(_allow("a") | {"targets": [{"sparseModel": "other"}]})
    assert not table.enforced
    assert _scope(table, "x", None).experts is None and _scope(table, "x", None).decision.allow
    assert _scope(table, "x", "math").experts == (0, 1)  # a named group still narrows the request


def test_scoped_caller_gets_only_its_group_and_must_name_it():
    table = _table(_allow("a", expertGroups=["math"]))
    assert table.enforced
    assert _scope(table, "a", "math").experts == (0, 1)
    assert not _scope(table, "a", "code").decision.allow
    whole = _scope(table, "a", None)
    assert not whole.decision.allow and "scoped to expert groups math" in whole.decision.reason
    denied = _scope(table, "b", "math")
    assert not denied.decision.allow and "default deny" in denied.decision.reason and denied.experts == ()


def test_whole_model_less_denied_groups_and_deny_wins():
    deny = {"action": "Deny", "priority": -5, "sources": [{"namespace": "web"}],
            "targets": [{"sparseModel": "*", "expertGroups": ["code"]}]}
    table = _table(_allow("a", routes=["/v1/infer"]), deny)
    whole = _scope(table, "a", None)
    assert whole.decision.allow and whole.experts == (0, 1, 4, 5, 6, 7)
    code = _scope(table, "a", "code")
    assert not code.decision.allow and code.decision.rule == "ml/p1#s0t0" and "Deny wins" in code.decision.reason
    assert not _scope(table, "a", None, route="/v1/chat/completions").decision.allow


def test_an_allowed_caller_denied_every_group_covering_the_model_is_refused():
    """Groups that cover every expert, each denied: nothing is left to route to, so the request is
    refused (403 in the server) rather than run with every expert masked (or a 500)."""
    deny = {"action": "Deny", "priority": -5, "sources": [{"namespace": "web"}],
            "targets": [{"sparseModel": "*", "expertGroups": ["low", "high"]}]}
    table = _table(_allow("a"), deny)
    scope = table.scope(namespace="web", service_account="a", route="/v1/infer", group=None,
                        groups={"low": (0, 1, 2, 3), "high": (4, 5, 6, 7)}, num_experts=8)
    assert not scope.decision.allow and scope.experts == ()
    assert scope.decision.reason == "every expert is in a group denied to this caller (high, low)"
    # One expert outside the groups: that one is left, and the request is allowed with it.
    scope = table.scope(namespace="web", service_account="a", route="/v1/infer", group=None,
                        groups={"low": (0, 1, 2, 3), "high": (4, 5, 6)}, num_experts=8)
    assert scope.decision.allow and scope.experts == (7,)


def test_rules_on_other_ports_do_not_admit_the_serving_port():
    table = _table(_allow("a") | {"ports": [{"port": 9090}]})
    assert table.enforced and table.rules == () and not _scope(table, "a", None).decision.allow


def test_label_rules_refuse_when_labels_cannot_be_verified():
    labelled_allow = {"action": "Allow", "sources": [{"namespace": "web", "matchLabels": {"app": "x"}}],
                      "targets": [{"sparseModel": "moe"}]}
    labelled_deny = labelled_allow | {"action": "Deny"}
    assert not _scope(_table(labelled_allow), "a", None).decision.allow
    assert not _scope(_table(_allow("a"), labelled_deny), "a", None).decision.allow


@pytest.mark.parametrize("path, value, field", [
    (("version",), 2, "version"),
    (("enforced",), "yes", "enforced"),
    (("model",), "", "model"),
    (("rules", 0, "action"), "permit", r"rules\[0\].action"),
    (("rules", 0, "priority"), 1.5, r"rules\[0\].priority"),
    (("rules", 0, "needsLabels"), None, r"rules\[0\].needsLabels"),
    (("rules", 0, "expertGroups"), "math", r"rules\[0\].expertGroups"),
    (("rules", 0, "routes"), [1], r"rules\[0\].routes"),
    (("rules", 0, "serviceAccount"), 3, r"rules\[0\].serviceAccount"),
    (("rules", 0, "identity"), "", r"rules\[0\].identity"),
])
def test_bad_documents_are_refused_naming_the_field(path, value, field):
    rules = rules_from_spec(namespace="ml", name="p", spec=_allow("a", expertGroups=["math"]))
    doc = copy.deepcopy(access_document(rules, namespace="ml", model="moe", serving_port=8080,
                                        trust_domain="cluster.local"))
    holder = doc
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    with pytest.raises(AccessDocumentError, match=field):
        parse_access_document(doc)
    with pytest.raises(AccessDocumentError, match="JSON object"):
        parse_access_document([doc])


def test_a_named_group_keeps_the_experts_it_shares_with_a_denied_group_masked():
    """Groups may overlap (the CRD only forbids repeats inside one group). A Deny on group "code"
    keeps its experts from the caller whether it names no group or a group sharing them: Deny wins.
    A group merely not allowed (no Deny) masks nothing of an allowed one."""
    groups = {"math": (0, 1, 2), "code": (2, 3), "chat": (3,)}
    deny = {"action": "Deny", "sources": [{"namespace": "web"}],
            "targets": [{"sparseModel": "moe", "expertGroups": ["code"]}]}
    table = _table(_allow("a"), deny)

    def scope(group):
        return table.scope(namespace="web", service_account="a", route="/v1/infer", group=group,
                           groups=groups, num_experts=8)

    assert scope(None).experts == (0, 1, 4, 5, 6, 7)
    math = scope("math")
    assert math.decision.allow and math.experts == (0, 1)
    chat = scope("chat")  # its only expert is in the denied group
    assert not chat.decision.allow and chat.experts == ()
    scoped = _table(_allow("a", expertGroups=["math"]))  # "code" not allowed, but not denied
    assert scoped.scope(namespace="web", service_account="a", route="/v1/infer", group="math",
                        groups=groups, num_experts=8).experts == (0, 1, 2)
