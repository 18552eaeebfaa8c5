"""OPA decisions → the flow allow-list the eBPF agent enforces (pure).

The operator does not re-implement the Rego: it asks OPA. To keep the number of questions small it
groups pods first. Pods with the same (namespace, service account, labels) are one *identity class*
and get the same answer; pods of one SparseModel are one target. So the questions are
identity classes × models × candidate ports, and the answers expand to IPs afterwards
(`flow_document`). Only classes filed in a bucket of the target's index can match any rule, so
only they are asked.

Document format (`sparsegate_contracts.flowpolicy`, the agent's parser too), identity form: default
deny; one numeric identity per identity class that a rule involves (its pods' IPs listed under it),
an `allow` rule per (source class, class of the model's pods, port) OPA allowed and a `deny` rule
where a Deny rule decided (explains drops; default deny would drop them anyway). So the document
and the agents' maps grow with classes x rules, not with source pods x model pods.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, NamedTuple

from sparsegate_contracts import flowpolicy
from sparsegate_contracts.canonical import sha256_hex
from sparsegate_contracts.names import MODEL_LABEL
from sparsegate_contracts.request_access import caller_identity_keys

from sparsegate.domain import interned
from sparsegate.domain.policy import (
    ANY,
    Action,
    PolicySource,
    Port,
    spiffe_id,
    target_key,
)


Identity = tuple[str, str, tuple[tuple[str, str], ...]]  # (namespace, service account, labels): a class


@dataclass(frozen=True)
class PodInfo:
    namespace: str
    name: str
    ip: str  # status.podIP: the primary address
    service_account: str
    labels: tuple[tuple[str, str], ...]
    ports: tuple[Port, ...] = ()
    ips: tuple[str, ...] = ()  # status.podIPs (dual-stack: one per family), primary first; () = (ip,)

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every address of the pod (IPv4 and IPv6): each is published in the allow-list."""
        return self.ips or (self.ip,)

    # Cached: a build reads them for every pod several times (the instance stays frozen: the cache
    # lives in __dict__, outside the dataclass fields that equality, hashing and astuple use).
    @cached_property
    def model(self) -> str | None:
        return dict(self.labels).get(MODEL_LABEL)

    @cached_property
    def identity(self) -> Identity:
        return (self.namespace, self.service_account, self.labels)


def _canonical_ips(raw: Iterable[Any]) -> tuple[str, ...]:
    """Valid addresses among ``raw``, in ``flowpolicy.ip_text``'s canonical text, first seen first;
    anything else is left out (the API server validates pod IPs: this only guards the document)."""
    out: dict[str, None] = {}
    for value in raw:
        try:
            out[flowpolicy.ip_text(value, where="podIPs")] = None
        except flowpolicy.FlowPolicyError:
            continue
    return tuple(out)


def listed_addresses(text: str, *, where: str) -> tuple[str, ...]:
    """Comma-separated addresses (the downward API's ``status.podIPs``) in canonical text;
    ``flowpolicy.FlowPolicyError`` (a ValueError) naming ``where`` for a bad one."""
    return tuple(flowpolicy.ip_text(ip.strip(), where=where) for ip in text.split(",") if ip.strip())


def pod_info(pod: Mapping[str, Any]) -> PodInfo | None:
    """A pod that can take part in a flow: it has an IP of its own and is not finished. Its
    addresses: ``status.podIPs`` (dual-stack: an IPv4 and an IPv6 one), else ``status.podIP``.
    A ``hostNetwork`` pod takes none: its address is its node's, shared with every other such pod
    there (one address, one identity), and the data plane always passes the node's traffic."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    if spec.get("hostNetwork"):
        return None
    listed = [p.get("ip") for p in status.get("podIPs") or () if isinstance(p, Mapping)]
    ips = _canonical_ips([status.get("podIP"), *listed])
    if not ips or status.get("phase") in ("Succeeded", "Failed") or meta.get("deletionTimestamp"):
        return None
    ports = {
        _port(int(p["containerPort"]), str(p.get("protocol") or "TCP").lower())
        for c in spec.get("containers") or ()
        for p in c.get("ports") or ()
        if p.get("containerPort") and str(p.get("protocol") or "TCP").lower() in flowpolicy.PROTOCOLS
    }  # the data plane polices TCP and UDP only (SCTP passes it), and the allow-list names no other
    # Kept in the operator's index of every pod for as long as the pod exists: strings interned.
    return PodInfo(
        namespace=interned.text(meta.get("namespace", "default")),
        name=interned.text(meta["name"]),
        ip=interned.text(ips[0]),
        service_account=interned.text(spec.get("serviceAccountName") or "default"),
        labels=interned.deep(tuple(sorted((meta.get("labels") or {}).items()))),
        ports=tuple(sorted(ports, key=lambda p: (p.port, p.protocol))),
        ips=interned.deep(ips) if len(ips) > 1 else (),
    )


@lru_cache(maxsize=1024)
def _port(port: int, protocol: str) -> Port:
    """One ``Port`` per (port, protocol) for every pod that declares it (pods of a model share theirs)."""
    return Port(port=port, protocol=protocol)


class QueryKey(NamedTuple):
    """One question to OPA: may this identity class reach this model on this port? (A NamedTuple, not
    a frozen dataclass: a build at 10,000 rules makes one per answer, and this is ~5x cheaper.)"""

    namespace: str
    service_account: str
    labels: tuple[tuple[str, str], ...]
    target_namespace: str
    model: str
    port: int
    protocol: str

    def opa_input(self, *, trust_domain: str) -> dict[str, Any]:
        return {
            "source": {
                "spiffeID": spiffe_id(
                    trust_domain=trust_domain, namespace=self.namespace, service_account=self.service_account
                ),
                "namespace": self.namespace,
                "serviceAccount": self.service_account,
                "labels": dict(self.labels),
            },
            "target": {
                "namespace": self.target_namespace,
                "sparseModel": self.model,
                "port": self.port,
                "protocol": self.protocol,
            },
        }


def _models(pods: Iterable[PodInfo]) -> dict[tuple[str, str], list[PodInfo]]:
    models: dict[tuple[str, str], list[PodInfo]] = {}
    for pod in pods:
        if pod.model:
            models.setdefault((pod.namespace, pod.model), []).append(pod)
    return models


def _model_buckets(
    targets: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], *, namespace: str, model: str
) -> list[tuple[str, str]]:
    """The rule buckets (target key, identity key) that can decide flows to one model."""
    return [(tkey, ikey)
            for tkey in (target_key(namespace=namespace, model=model), target_key(namespace=namespace, model=ANY))
            for ikey in (targets.get(tkey) or {})]


def _candidate_ports(
    targets: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], buckets: Iterable[tuple[str, str]],
    model_pods: Sequence[PodInfo],
) -> set[Port]:
    """Ports worth asking about for a model: those its rules name, plus its pods' declared ports when
    a rule names none (a port-less rule covers every port, and the pods' ports are the ones that matter)."""
    named: set[tuple[int, str]] = set()
    portless = False
    for tkey, ikey in buckets:
        for rule in targets[tkey][ikey]:
            if rule.get("ports"):
                named.update((p["port"], p["protocol"]) for p in rule["ports"])
            else:
                portless = True
    ports = {Port(port=port, protocol=protocol) for port, protocol in named}  # one Port per distinct port
    if portless:
        ports.update(port for pod in model_pods for port in pod.ports)
    return ports


def _classes_by_key(
    pods: Iterable[PodInfo], *, trust_domain: str
) -> dict[str, set[Identity]]:
    """identity key -> the identity classes filed there: each bucket finds its classes by lookup,
    so the cost follows the matches, not models × classes."""
    by_key: dict[str, set[Identity]] = {}
    for identity in {pod.identity for pod in pods}:  # keyed once per class, not per pod
        namespace, service_account, _ = identity
        for key in caller_identity_keys(trust_domain=trust_domain, namespace=namespace,
                                        service_account=service_account):
            by_key.setdefault(key, set()).add(identity)
    return by_key


def candidate_queries(
    *, targets: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], pods: Sequence[PodInfo], trust_domain: str
) -> list[QueryKey]:
    """The questions worth asking, given the indexed rules (`data.sparsegate.policies.targets`), on
    the candidate ports (`_candidate_ports`)."""
    by_key = _classes_by_key(pods, trust_domain=trust_domain)
    queries: set[QueryKey] = set()
    for (namespace, model), model_pods in sorted(_models(pods).items()):
        buckets = _model_buckets(targets, namespace=namespace, model=model)
        if not buckets:
            continue
        ports = _candidate_ports(targets, buckets, model_pods)
        classes = set().union(*(by_key.get(ikey, ()) for _, ikey in buckets))
        for ns, sa, labels in classes:
            for port in ports:
                queries.add(
                    QueryKey(
                        namespace=ns, service_account=sa, labels=labels,
                        target_namespace=namespace, model=model, port=port.port, protocol=port.protocol,
                    )
                )
    return sorted(queries, key=lambda q: (q.target_namespace, q.model, q.port, q.protocol, q.namespace,
                                          q.service_account, q.labels))


@dataclass(frozen=True)
class FlowQuestion:
    """The whole allow-list as one question to OPA (`data.sparsegate.routing.flow_decisions`).

    `input`: `one`, the distinct rule buckets that alone decide some (class, model) pairs; `many`,
    the other pairs with their buckets, indexing `classes` and `models` rows (only the classes and
    models those pairs use). OPA answers `{"one": [[k, allow, rule, ports]], "many": [[i, j, port,
    protocol, allow, rule]]}`; `decisions` maps both back to the `QueryKey`s the per-question path
    (`candidate_queries`) would have asked, so `flow_document` is unchanged. One difference from that
    path: a port-less Allow admits only the ports the model's pods declare (CRD spec.ports), not one
    that only another rule names.
    """

    models: tuple[tuple[str, str], ...]  # every model some pair joins (policed), in name order
    many_classes: tuple[Identity, ...]  # input.classes
    many_models: tuple[tuple[str, str], ...]  # input.models
    # For input.one[k]: the pairs it decides, each with the model's candidate ports (port, protocol).
    one_pairs: tuple[tuple[tuple[Identity, tuple[str, str], tuple[tuple[int, str], ...]], ...], ...]
    input: dict[str, Any]
    # Per model of `one_pairs`: the candidate ports its pods declare (a port-less Allow's ports).
    declared: Mapping[tuple[str, str], tuple[tuple[int, str], ...]] = field(default_factory=dict)

    def decisions(self, answers: Mapping[str, Iterable[Sequence[Any]]]) -> dict[QueryKey, dict[str, Any]]:
        """OPA's answer as decisions per `QueryKey`. Raises `MalformedAnswer`, naming the first entry
        not shaped as the Rego defines (only a broken Rego answers so), and none of it is used:
        coerced, a string "false" would read as allow and an index -1 as another bucket's pairs."""
        one, many = _answer_list(answers, "one"), _answer_list(answers, "many")
        out: dict[QueryKey, dict[str, Any]] = {}
        for n, entry in enumerate(one):
            if not (isinstance(entry, list) and len(entry) == 4):
                raise _malformed(f"one[{n}]", entry, "expected [index, allow, rule, ports]")
            k, allow, rule, ports = entry
            if type(k) is not int or not 0 <= k < len(self.one_pairs):
                raise _malformed(f"one[{n}][0]", k, f"expected an index below {len(self.one_pairs)}")
            decision = _answer_decision(allow, rule, f"one[{n}]")
            if not isinstance(ports, list):
                raise _malformed(f"one[{n}][3]", ports, "expected a list of ports")
            named = tuple(_answer_port(p, f"one[{n}][3]") for p in ports)
            for (ns, sa, labels), (target_ns, model), candidates in self.one_pairs[k]:
                # A rule that names no port: an Allow covers the ports the model's pods declare, not
                # those only another rule names (CRD spec.ports); a Deny every candidate port.
                if not named and decision["allow"]:
                    candidates = self.declared.get((target_ns, model), ())
                for port, protocol in named or candidates:
                    out[QueryKey(ns, sa, labels, target_ns, model, port, protocol)] = decision
        classes, models = self.many_classes, self.many_models
        for n, entry in enumerate(many):
            if not (isinstance(entry, list) and len(entry) == 6):
                raise _malformed(f"many[{n}]", entry, "expected [class, model, port, protocol, allow, rule]")
            class_index, model_index, port, protocol, allow, rule = entry
            if type(class_index) is not int or not 0 <= class_index < len(classes) \
                    or type(model_index) is not int or not 0 <= model_index < len(models):
                raise _malformed(f"many[{n}]", entry, f"expected a class index below {len(classes)} and a model "
                                                      f"index below {len(models)}")
            if type(port) is not int or type(protocol) is not str:
                raise _malformed(f"many[{n}]", entry, "expected an integer port and a string protocol")
            if type(allow) is not bool or type(rule) is not str:  # inline: ~10^5 entries at 10,000 rules
                raise _malformed(f"many[{n}]", entry, "expected a boolean allow and a string rule id")
            ns, sa, labels = classes[class_index]
            target_ns, model = models[model_index]
            out[QueryKey(ns, sa, labels, target_ns, model, port, protocol)] = {"allow": allow, "rule": rule}
        return out


class MalformedAnswer(ValueError):
    """OPA's `flow_decisions` answer is not shaped as the Rego defines; the message names the part."""


def _malformed(part: str, value: Any, expected: str) -> MalformedAnswer:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else f"{shown[:77]}..."
    return MalformedAnswer(f"flow_decisions{'.' if part else ''}{part}: {expected}, got {shown}")


def _answer_list(answers: Any, part: str) -> list[Any]:
    if not isinstance(answers, Mapping):
        raise _malformed("", answers, "expected an object {one, many}")
    value = answers.get(part)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _malformed(part, value, "expected a list")
    return value


def _answer_decision(allow: Any, rule: Any, part: str) -> dict[str, Any]:
    if type(allow) is not bool or type(rule) is not str:
        raise _malformed(part, [allow, rule], "expected a boolean allow and a string rule id")
    return {"allow": allow, "rule": rule}


def _answer_port(p: Any, part: str) -> tuple[int, str]:
    port = p.get("port") if isinstance(p, Mapping) else None
    protocol = p.get("protocol") if isinstance(p, Mapping) else None
    if type(port) is not int or type(protocol) is not str:
        raise _malformed(part, p, "expected ports as {port: integer, protocol: string}")
    return port, protocol


def flow_question(
    *, targets: Mapping[str, Mapping[str, Sequence[Mapping[str, Any]]]], pods: Sequence[PodInfo], trust_domain: str
) -> FlowQuestion:
    """The (identity class, model) pairs of `pods` that the indexed rules (`targets`) can decide, as
    `flow_decisions` takes them.

    The join of classes and rule buckets by identity key is done here, not in Rego: it is indexing,
    not policy, and OPA pays several microseconds per expression (grouping inside Rego cost more than
    the decisions). A pair whose one bucket holds one rule with no service-account or label condition
    is decided by that rule alone, whatever the class: such buckets go to `one`, once each however
    many pairs they decide (OPA answers per bucket; a namespace-wide rule is asked once, not per
    class). Every other pair goes to `many` with its buckets, and its model with its candidate ports
    (`_candidate_ports`, as `candidate_queries` asks). Classes and models no bucket joins are left
    out: the input stays proportional to what can match.
    """
    by_key = _classes_by_key(pods, trust_domain=trust_domain)
    models: list[tuple[str, str]] = []
    class_index: dict[Identity, int] = {}  # -> position in many_classes
    many_classes: list[Identity] = []
    class_rows: list[dict[str, Any]] = []
    many_models: list[tuple[str, str]] = []
    model_rows: list[dict[str, Any]] = []
    one_index: dict[tuple[str, str], int] = {}  # bucket -> position in one
    one: list[list[str]] = []
    one_pairs: list[list[tuple[Identity, tuple[str, str], tuple[tuple[int, str], ...]]]] = []
    declared: dict[tuple[str, str], tuple[tuple[int, str], ...]] = {}
    many: list[list[Any]] = []
    for (ns, model), model_pods in sorted(_models(pods).items()):
        buckets = _model_buckets(targets, namespace=ns, model=model)
        per_class: dict[Identity, list[tuple[str, str]]] = {}
        for tkey, ikey in buckets:
            for identity in by_key.get(ikey, ()):
                per_class.setdefault(identity, []).append((tkey, ikey))
        if buckets:
            # Targeted: policed whether or not a running pod can match a source yet (default deny;
            # a model left out would pass every caller until one could).
            models.append((ns, model))
        if not per_class:
            continue
        candidates = sorted(_candidate_ports(targets, buckets, model_pods), key=lambda p: (p.port, p.protocol))
        ports = tuple((p.port, p.protocol) for p in candidates)
        pod_ports = {port for pod in model_pods for port in pod.ports}
        declared[(ns, model)] = tuple((p.port, p.protocol) for p in candidates if p in pod_ports)
        j = None  # this model's row in input.models, added when a `many` pair needs it
        for identity, pair_buckets in sorted(per_class.items()):
            bucket = pair_buckets[0]
            rules = targets[bucket[0]][bucket[1]]
            if len(pair_buckets) == 1 and len(rules) == 1 and _unconditional(rules[0]):
                if bucket not in one_index:
                    one_index[bucket] = len(one)
                    one.append(list(bucket))
                    one_pairs.append([])
                one_pairs[one_index[bucket]].append((identity, (ns, model), ports))
                continue
            if j is None:
                j = len(many_models)
                many_models.append((ns, model))
                # `declared`: a port the model's pods declare, which a port-less Allow covers.
                model_rows.append({"namespace": ns, "sparseModel": model,
                                   "ports": [{**p.to_json(), "declared": True} if p in pod_ports else p.to_json()
                                             for p in candidates]})
            if identity not in class_index:
                class_index[identity] = len(many_classes)
                many_classes.append(identity)
                _, sa, labels = identity
                row: dict[str, Any] = {"serviceAccount": sa}
                if labels:
                    row["labels"] = dict(labels)
                class_rows.append(row)
            many.append([class_index[identity], j, [list(b) for b in pair_buckets]])
    return FlowQuestion(models=tuple(models), many_classes=tuple(many_classes), many_models=tuple(many_models),
                        one_pairs=tuple(tuple(pairs) for pairs in one_pairs), declared=declared,
                        input={"classes": class_rows, "models": model_rows, "one": one, "many": many})


def _unconditional(rule: Mapping[str, Any]) -> bool:
    """A rule that holds for every class filed in its bucket (no service account or label condition)."""
    return rule.get("serviceAccount") is None and not rule.get("matchLabels")


def flow_document(
    *, decisions: Mapping[QueryKey, Mapping[str, Any]], pods: Sequence[PodInfo],
    policed_models: Collection[tuple[str, str]] | None = None, allowed_sources: Collection[str] | None = None,
) -> dict[str, Any]:
    """Turn OPA's answers (the `decision` object of the Rego) into identity rules.

    Each identity class (namespace, service account, labels) that a rule involves gets an identity
    (`flowpolicy.FIRST_IDENTITY` upwards, in class order) listing its pods' IPs; a decision for
    (source class, model, port) becomes one rule per class among the model's pods.
    `policed_models`: the (namespace, SparseModel) pairs some RoutingPolicy targets (`FlowQuestion.models`);
    their pods' IPs are published as `policedDestinations`, the only destinations the agent judges.
    None: the field is left out (the agent then polices the destinations the rules name).
    `allowed_sources`: IPs always allowed to policed destinations (the operator's own pod)."""
    by_identity: dict[Identity, list[PodInfo]] = {}
    for pod in pods:
        by_identity.setdefault(pod.identity, []).append(pod)
    models = _models(pods)
    dst_classes = {key: {pod.identity for pod in model_pods} for key, model_pods in models.items()}
    found = set()
    for query, decision in decisions.items():
        rule = decision.get("rule") or ""
        if not rule:
            continue  # nothing matched: default deny covers it
        src = (query.namespace, query.service_account, query.labels)
        if src not in by_identity:
            continue  # no pod of that class now: nothing to allow or deny
        action = flowpolicy.ALLOW if decision.get("allow") else flowpolicy.DENY
        for dst in dst_classes.get((query.target_namespace, query.model), ()):
            found.add((src, dst, query.port, query.protocol, action, rule))
    # More classes than identity numbers: numbered past MAX_IDENTITY, which the capacity check
    # (domain.policy_capacity) refuses before the document is published.
    classes = sorted({c for row in found for c in row[:2]})
    number = {c: flowpolicy.FIRST_IDENTITY + i for i, c in enumerate(classes)}
    # Numbered first, then sorted as plain tuples: the same order as sorting by (numbers, rest).
    numbered = sorted([(number[s], number[d], p, proto, a, r) for s, d, p, proto, a, r in found])
    rows = [flowpolicy.identity_rule_json(*row) for row in numbered]
    # An address is one identity's (the agents refuse a document that gives one two): an address
    # pods of several classes report at once (a reused IP seen twice) belongs to none of them, so
    # traffic from it takes the default action rather than freezing every agent on its last policy.
    owners: dict[str, set[Identity]] = {}
    for c in classes:
        for pod in by_identity[c]:
            for ip in pod.addresses:
                owners.setdefault(ip, set()).add(c)
    identities = [{"identity": number[c], "ips": list(dict.fromkeys(
                      ip for pod in by_identity[c] for ip in pod.addresses if len(owners[ip]) == 1))}
                  for c in classes]
    policed = None
    if policed_models is not None:
        policed = {ip for key in policed_models for pod in models.get(tuple(key), ()) for ip in pod.addresses}
        policed.update(ip for c in {d for _, d, *_ in found} for pod in by_identity[c] for ip in pod.addresses)
    return flowpolicy.build_document(rules=rows, identities=identities, default_action=flowpolicy.DENY,
                                     policed_destinations=policed, allowed_sources=allowed_sources)


def _rebuilt(document: Mapping[str, Any], rows: list[Any], *, ips_kept: Any = None,
             police: Collection[str] = ()) -> dict[str, Any]:
    """`document` with only `rows` (and, identity form, only the IPs `ips_kept(ip)` accepts) left: what
    it polices and always allows stays (narrowing only), and the IPs of `police` are policed too."""
    identities = flowpolicy.identity_ips(document)
    kept = {i: [ip for ip in ips if ips_kept is None or ips_kept(ip)] for i, ips in identities.items()}
    policed = flowpolicy.policed_of(document)
    more = set(police) - set(policed)
    if len(rows) == len(flowpolicy.rows_of(document)) and kept == identities and not more:
        return dict(document)  # nothing removed: the same document
    if more:
        document = {**document, flowpolicy.POLICED_DESTINATIONS: [*policed, *sorted(more)]}
    return flowpolicy.with_rows(document, rows, identities=[{"identity": i, "ips": ips} for i, ips in kept.items()])


def _dst_ips(document: Mapping[str, Any], row: Mapping[str, Any]) -> list[str]:
    """The destination IPs a rule or entry covers."""
    if "dstIP" in row:
        return [row["dstIP"]]
    return flowpolicy.identity_ips(document).get(int(row.get("dstIdentity", 0)), [])


def _pods_of(ips: Iterable[str], owners: Mapping[str, str] | None) -> int:
    """How many pods ``ips`` are the addresses of: a dual-stack pod has one per family. ``owners``:
    the pod of each IP (``ip_owners``); an IP it does not know (or without it) counts with the others
    of its family, the pods being as many as the family with more of them (a cluster gives every
    pod of a class the same families)."""
    pods: set[str] = set()
    v4 = v6 = 0
    for ip in ips:
        if owners is not None and ip in owners:
            pods.add(owners[ip])
        elif ":" in ip:
            v6 += 1
        else:
            v4 += 1
    return len(pods) + max(v4, v6)


def decision_counts(document: Mapping[str, Any], owners: Mapping[str, str] | None = None) -> dict[str, int]:
    """(caller pod, model pod, port) triples each RoutingPolicy ("<ns>/<name>") decided in a flow
    document (``status.decisionCount``): an identity rule counts once per pair of its identities'
    pods, a dual-stack pod's IPv4 and IPv6 addresses once (``owners``: ``ip_owners``, see :func:`_pods_of`);
    an entry of the entries form once per (source pod, destination pod, port, protocol)."""
    counts: dict[str, int] = {}
    ips = flowpolicy.identity_ips(document)
    pods = {i: _pods_of(addresses, owners) for i, addresses in ips.items()}
    owner = (lambda ip: ip) if owners is None else (lambda ip: owners.get(ip, ip))
    entries: set[tuple[Any, ...]] = set()
    for row in flowpolicy.rows_of(document):
        policy = str(row.get("rule", "")).split("#", 1)[0]
        if "srcIP" in row:
            key = (policy, owner(row["srcIP"]), owner(row.get("dstIP")), row.get("dstPort"), row.get("protocol"))
            if key in entries:
                continue
            entries.add(key)
            n = 1
        else:
            n = pods.get(row.get("srcIdentity"), 0) * pods.get(row.get("dstIdentity"), 0)
        counts[policy] = counts.get(policy, 0) + n
    return counts


def narrow_document(
    *,
    document: Mapping[str, Any],
    owners_then: Mapping[str, str] | None,
    owners_now: Mapping[str, str],
    live_policies: Collection[str],
    classes_then: Mapping[str, str] | None = None,
    classes_now: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Fail closed while OPA is unreachable: only ever remove entries from the last good document.

    Removed: entries of RoutingPolicies that no longer exist, and (when we know which pod owned each
    IP at decision time, `ip -> "<ns>/<pod>"`) entries whose IPs are gone or now belong to another
    pod, so a reused IP does not inherit access. Identity form, when the class each identity stood
    for is known (`classes_then`: identity number as text -> `class_digest`, as `identity_classes`
    records it; `classes_now`: `ip_classes` of today's pods): an IP whose pod now is of another class
    (its labels changed, or the IP went to a pod of another class, even unseen by this process)
    leaves its identity too; an identity not in `classes_then` keeps no IP. Dropping an entry never
    widens access: the default is deny.
    """
    ident_of = {ip: str(i) for i, ips in flowpolicy.identity_ips(document).items() for ip in ips}
    now = classes_now or {}

    def same(ip: str) -> bool:
        if owners_then is not None and not (ip in owners_now and owners_then.get(ip) == owners_now[ip]):
            return False
        if classes_then is None or ip not in ident_of:
            return True
        recorded = classes_then.get(ident_of[ip])
        return recorded is not None and now.get(ip) == recorded

    # Identity form: an IP that left or changed hands leaves its identity (it then matches no rule).
    rows = [
        e
        for e in flowpolicy.rows_of(document)
        if flowpolicy.policy_of_rule(e.get("rule", "")) in live_policies
        and ("srcIP" not in e or (same(e["srcIP"]) and same(e["dstIP"])))
    ]
    return _rebuilt(document, rows, ips_kept=same)


# 16 hex digits (64 bits), as `domain.policy`'s spec digests: recorded per identity in an annotation.
_CLASS_DIGEST_HEX = 16


def class_digest(identity: Identity) -> str:
    """A short digest of an identity class (namespace, service account, labels)."""
    namespace, service_account, labels = identity
    return sha256_hex([namespace, service_account, [list(kv) for kv in labels]])[:_CLASS_DIGEST_HEX]


def ip_classes(pods: Iterable[PodInfo]) -> dict[str, str]:
    """IP -> `class_digest` of the pod that has it now; an IP pods of two classes report has none."""
    digests: dict[Identity, str] = {}
    out: dict[str, str | None] = {}
    for pod in pods:
        digest = digests.get(pod.identity) or digests.setdefault(pod.identity, class_digest(pod.identity))
        for ip in pod.addresses:
            out[ip] = digest if out.get(ip, digest) == digest else None
    return {ip: d for ip, d in out.items() if d is not None}


def identity_classes(document: Mapping[str, Any], pods: Iterable[PodInfo]) -> dict[str, str]:
    """Identity number (as text) -> `class_digest` of the class whose pods' IPs it lists (identity
    form; `flow_document` gives an identity to one class): recorded with the published allow-list so
    that narrowing, in this process or the next, can tell an IP that now belongs to another class
    (`narrow_document`). An identity listing no IP, or IPs of no single class now, is left out."""
    now = ip_classes(pods)
    out: dict[str, str] = {}
    for ident, ips in flowpolicy.identity_ips(document).items():
        digests = {now.get(ip) for ip in ips}
        if len(digests) == 1 and None not in digests:
            out[str(ident)] = digests.pop()  # type: ignore[assignment]
    return out


def narrow_undecided(
    *,
    document: Mapping[str, Any],
    sources: Sequence[PolicySource],
    undecided: Collection[str],
    pods: Sequence[PodInfo],
) -> dict[str, Any]:
    """Fail closed on policy changes OPA could not evaluate: only ever remove allow entries.

    For each policy in `undecided` (`"ns/name"`: new or changed since OPA last decided; see
    `domain.policy.undecided_policies`), whatever its new spec says:
    - its own allow entries go: what it allowed before may be what the change took away (an Allow
      narrowed, retargeted, turned into a Deny);
    - if it now denies, every allow entry towards a pod of its targets goes, whichever rule allowed
      it and whatever the source (a Deny wins over any Allow; a `*` target is every model pod of
      the policy's namespace), and so does every allow entry towards an IP that is no pod now (it
      cannot be shown not to be a target).
    An undecided Allow removes nothing else: an Allow only ever adds access. Deny entries stay
    (they explain drops; the default denies anyway). Every pod of a model some policy targets now
    is policed (a replica started, or a model first targeted, since OPA last decided): unpoliced,
    it would pass every caller. When OPA answers again the normal sync publishes what OPA allows,
    which may be wider again.
    """
    undecided = set(undecided)
    model_of_ip = {ip: (pod.namespace, pod.model) for pod in pods for ip in pod.addresses}
    denied_targets: set[tuple[str, str]] = set()  # (namespace, model | ANY)
    for source in sources:
        if source.key in undecided and str(source.spec.get("action", "Allow")).lower() == Action.DENY.value:
            denied_targets.update((source.namespace, str(t.get("sparseModel") or ANY))
                                  for t in source.spec.get("targets") or ())

    def denied_now(dst_ip: str) -> bool:
        if not denied_targets:
            return False
        if dst_ip not in model_of_ip:
            return True
        namespace, model = model_of_ip[dst_ip]
        return model is not None and ((namespace, model) in denied_targets or (namespace, ANY) in denied_targets)

    rows = [
        e for e in flowpolicy.rows_of(document)
        if e.get("action") != flowpolicy.ALLOW
        or not (flowpolicy.policy_of_rule(e.get("rule", "")) in undecided
                or any(denied_now(ip) for ip in _dst_ips(document, e)))
    ]
    targeted = {(s.namespace, str(t.get("sparseModel") or ANY)) for s in sources for t in s.spec.get("targets") or ()}
    police = [ip for pod in pods if pod.model and ((pod.namespace, pod.model) in targeted
                                                   or (pod.namespace, ANY) in targeted) for ip in pod.addresses]
    return _rebuilt(document, rows, police=police)


def policies_named(document: Mapping[str, Any]) -> set[str]:
    """Every policy (``"ns/name"``) that has entries in a flow document."""
    return {flowpolicy.policy_of_rule(e.get("rule", "")) for e in flowpolicy.rows_of(document)}


def ip_owners(pods: Iterable[PodInfo]) -> dict[str, str]:
    return {ip: f"{pod.namespace}/{pod.name}" for pod in pods for ip in pod.addresses}


@dataclass
class FlowTable:
    """In-process lookup of a flow document: what the data plane does per packet (either form)."""

    default_allow: bool
    table: dict[tuple[Any, Any, int, str], bool] = field(default_factory=dict)
    identity: dict[str, int] | None = None  # identity form: IP -> identity; None: entries form

    @classmethod
    def from_document(cls, document: Mapping[str, Any]) -> FlowTable:
        policy = flowpolicy.parse_document(document)
        default_allow = policy.default_action == flowpolicy.ALLOW
        if not policy.identities and not policy.rules and policy.entries:
            return cls(default_allow=default_allow, table=_deny_wins(
                ((e.src_ip, e.dst_ip, e.dst_port, e.protocol), e.action) for e in policy.entries))
        return cls(default_allow=default_allow,
                   table=_deny_wins(((r.src_identity, r.dst_identity, r.dst_port, r.protocol), r.action)
                                    for r in policy.rules),
                   identity={ip: ident for ident, ips in policy.identities for ip in ips})

    def allows(self, *, src_ip: str, dst_ip: str, port: int, protocol: str = "tcp") -> bool:
        if self.identity is None:
            return self.table.get((src_ip, dst_ip, port, protocol), self.default_allow)
        key = (self.identity.get(src_ip), self.identity.get(dst_ip), port, protocol)
        return self.table.get(key, self.default_allow)


def _deny_wins(rows: Iterable[tuple[tuple[Any, Any, int, str], str]]) -> dict[tuple[Any, Any, int, str], bool]:
    table: dict[tuple[Any, Any, int, str], bool] = {}
    for key, action in rows:
        table[key] = table.get(key, True) and action == flowpolicy.ALLOW
    return table
