# METADATA
# title: SparseGate zero-trust routing
# description: >-
#   Decides whether a workload identity may reach a SparseModel (optionally one expert group or
#   route) on a port. Default deny; Deny wins over Allow whatever the priorities; every decision
#   names the rules that matched.
#
#   The rules are data, pushed by the operator to data.sparsegate.policies (built by
#   sparsegate.domain.policy.build_opa_data), already indexed by target and by identity:
#
#     {"revision": "sha256:...", "trustDomain": "cluster.local",
#      "policies": {"<ns>/<name>": {"generation": 3, "rules": 2}},
#      "targets": {"<ns>/<model>|<ns>/*": {"<identity key>": [rule, ...]}}}
#
#   identity key: "spiffe://<td>/ns/<ns>/sa/<sa>" | "ns:<ns>" | "*"
#   rule: {"id": "<ns>/<name>#s<i>t<j>", "policy": "<ns>/<name>", "action": "allow"|"deny",
#          "priority": int, "serviceAccount"?: str, "matchLabels": {}, "ports": [{"port", "protocol"}],
#          "expertGroups": [], "routes": []}
#
#   Why this shape: OPA's rule indexing does not reach into iterations over arrays
#   (`rules[i].target == x` is a scan), so the operator pre-indexes. A decision is at most six map
#   lookups with ground keys (two target keys × up to three identity keys: SPIFFE ID, ns:<ns>, *)
#   plus a check of the few rules in the selected buckets: its cost follows
#   the rules for one (target, identity), not the total count.
package sparsegate.routing

# --- The caller, normalised -------------------------------------------------------------------
# Callers send a SPIFFE ID, or namespace + service account (+ labels), or both.

default trust_domain := "cluster.local"

trust_domain := data.sparsegate.policies.trustDomain

spiffe_id := input.source.spiffeID

spiffe_id := sprintf("spiffe://%s/ns/%s/sa/%s", [trust_domain, input.source.namespace, input.source.serviceAccount]) if {
	not input.source.spiffeID
	input.source.namespace
	input.source.serviceAccount
}

# Only an ID of our own trust domain says which namespace and service account it is.
local_parts := parts if {
	parts := split(trim_prefix(spiffe_id, "spiffe://"), "/")
	count(parts) == 5
	parts[0] == trust_domain
	parts[1] == "ns"
	parts[3] == "sa"
}

src_namespace := input.source.namespace

src_namespace := local_parts[2] if not input.source.namespace

src_service_account := input.source.serviceAccount

src_service_account := local_parts[4] if not input.source.serviceAccount

src_labels := object.get(input.source, "labels", {})

# Buckets this caller can be found in (see sparsegate.domain.policy.identity_key).
identity_keys contains spiffe_id

identity_keys contains concat("", ["ns:", src_namespace])

identity_keys contains "*" if src_namespace

# --- The target ----------------------------------------------------------------------------

target_keys contains concat("/", [input.target.namespace, input.target.sparseModel])

target_keys contains concat("/", [input.target.namespace, "*"])

target_protocol := lower(object.get(input.target, "protocol", "tcp"))

# --- Matching ------------------------------------------------------------------------------

# Map lookups with ground keys: no scan over all rules.
candidates contains rule if {
	some tkey in target_keys
	some ikey in identity_keys
	some rule in data.sparsegate.policies.targets[tkey][ikey]
}

# The request's fields as the matching functions below take them (null when the request leaves one
# out): `flow_decisions` calls the same functions with each caller class and port.
default caller_service_account := null

caller_service_account := src_service_account

matches(rule) if {
	service_account_ok(rule, caller_service_account)
	labels_ok(rule, src_labels)
	port_ok(rule, object.get(input.target, "port", null), target_protocol)
	scope_ok(rule, "expertGroups", object.get(input.target, "expertGroup", null))
	scope_ok(rule, "routes", object.get(input.target, "route", null))
}

service_account_ok(rule, _) if not rule.serviceAccount

service_account_ok(rule, service_account) if rule.serviceAccount == service_account

labels_ok(rule, labels) if {
	every key, value in object.get(rule, "matchLabels", {}) {
		labels[key] == value
	}
}

port_ok(rule, _, _) if count(object.get(rule, "ports", [])) == 0

port_ok(rule, port, protocol) if {
	some p in rule.ports
	p.port == port
	lower(p.protocol) == protocol
}

# A rule without a scope list covers the whole model.
scope_ok(rule, list, _) if count(object.get(rule, list, [])) == 0

# A scoped rule covers requests naming one of its entries.
scope_ok(rule, list, requested) if requested in rule[list]

# A flow (L4) query names no expert group or route: a scoped Allow admits the connection (the
# model server narrows it per request), a scoped Deny must not cut the whole flow. A request (L7)
# names one or both: the one it leaves out means all of them (no group: the whole model), which
# only an unscoped rule covers, as the model server's table decides it.
scope_ok(rule, _, null) if {
	rule.action == "allow"
	flow_query
}

flow_query if {
	object.get(input.target, "expertGroup", null) == null
	object.get(input.target, "route", null) == null
}

deny_hits contains rule if {
	some rule in candidates
	rule.action == "deny"
	matches(rule)
}

allow_hits contains rule if {
	some rule in candidates
	rule.action == "allow"
	matches(rule)
}

# --- Decision ------------------------------------------------------------------------------

default allow := false

allow if {
	count(allow_hits) > 0
	count(deny_hits) == 0
}

# Rule ids by priority (highest first), then id: the first one is reported as deciding.
ranked(hits) := [pair[1] | some pair in sort([[0 - r.priority, r.id] | some r in hits])]

default deciding_rule := ""

deciding_rule := ranked(deny_hits)[0] if count(deny_hits) > 0

deciding_rule := ranked(allow_hits)[0] if allow

default reason := "no Allow rule matches (default deny)"

reason := "denied by a Deny rule (Deny wins over Allow)" if count(deny_hits) > 0

reason := "allowed" if allow

decision := {
	"allow": allow,
	"rule": deciding_rule,
	"reason": reason,
	"matched": {"deny": ranked(deny_hits), "allow": ranked(allow_hits)},
}

# Defined only when this module and the operator's data are both loaded: the operator compares it
# with the revision it pushed to notice an OPA restart (empty store) or a stale push.
data_revision := data.sparsegate.policies.revision

# Many decisions in one request (the operator's allow-list build): one per element of input.batch,
# in order. Cheaper than one ad-hoc query per input: the module is compiled once.
batch_decisions := [d |
	some q in input.batch
	d := decision with input as q
]

# --- The whole allow-list in one evaluation ----------------------------------------------------
# The operator's allow-list build: every (caller class, model, port) a rule decides, for the pushed
# rules and the pods the operator sends (sparsegate.domain.policy_compile.flow_question):
#
#   input: {"one": [[target key, identity key], ...],
#           "classes": [{"serviceAccount", "labels"?}],
#           "models": [{"namespace", "sparseModel", "ports": [{"port", "protocol", "declared"?}]}],
#           "many": [[class index, model index, [[target key, identity key], ...]], ...]}
#   flow_decisions: {"one": [[one index, allow, rule id, ports], ...],
#                    "many": [[class index, model index, port, protocol, allow, rule id], ...]}
#
# The same questions as asking `decision` once per candidate (policy_compile.candidate_queries) and
# the same answers, without a `with` per question, but for one narrowing: a port-less Allow admits
# only ports the model's pods declare (`declared`), not one that only another rule names. The
# operator has joined classes and rule buckets by identity key (indexing, not policy: the buckets a
# class is filed in are the ones `decision` would look up for it). `one`: buckets holding one rule
# with no service-account or label condition, each the only bucket of some (class, model) pairs:
# that rule decides those pairs whatever the class, so each bucket is asked once and answered with
# the ports the rule names (`[]`: the operator expands the pairs and the model's declared ports for
# an Allow, its candidate ports for a Deny).
# `many`: every other pair, with its model's candidate ports (those its rules name, plus its pods'
# ports when a rule names none), gathered and ranked per port. OPA pays microseconds per
# expression, so the common case does the least. A question no rule decides gets no element
# (default deny).

flow_decisions := {"one": flow_one, "many": flow_many}

flow_one := [[k, r.action == "allow", r.id, r.ports] |
	some k, [tkey, ikey] in input.one
	r := data.sparsegate.policies.targets[tkey][ikey][0]
	flow_scope_ok(r)
]

flow_many contains answer if {
	some [i, j, buckets] in input.many
	c := input.classes[i]

	# The class's rules for this model whose port-independent conditions hold.
	rules := [r |
		some [tkey, ikey] in buckets
		some r in data.sparsegate.policies.targets[tkey][ikey]
		service_account_ok(r, c.serviceAccount)
		labels_ok(r, object.get(c, "labels", {}))
		flow_scope_ok(r)
	]
	count(rules) > 0
	some p in input.models[j].ports
	denies := [r.id | some r in rules; r.action == "deny"; port_ok(r, p.port, p.protocol)]
	allows := [r.id | some r in rules; r.action == "allow"; flow_allow_port_ok(r, p)]
	verdict := flow_verdict(denies, allows, rules)
	answer := [i, j, p.port, p.protocol, verdict[0], verdict[1]]
}

# On the allow-list a port-less Allow covers the ports the model's pods declare (`declared`, CRD
# spec.ports), not one that only another rule names; a port-less Deny covers every port.
flow_allow_port_ok(r, p) if {
	count(r.ports) > 0
	port_ok(r, p.port, p.protocol)
}

flow_allow_port_ok(r, p) if {
	count(object.get(r, "ports", [])) == 0
	p.declared == true
}

# scope_ok for both lists when the request names neither (a flow): any Allow, an unscoped Deny.
flow_scope_ok(r) if r.action == "allow"

flow_scope_ok(r) if {
	count(object.get(r, "expertGroups", [])) == 0
	count(object.get(r, "routes", [])) == 0
}

# Deny wins; the reported rule is the highest-priority one of the winning action (as `decision`).
flow_verdict(denies, _, rules) := [false, best(denies, rules)] if count(denies) > 0

flow_verdict(denies, allows, rules) := [true, best(allows, rules)] if {
	count(denies) == 0
	count(allows) > 0
}

best(ids, _) := ids[0] if count(ids) == 1

best(ids, rules) := ranked({r | some r in rules; r.id in ids})[0] if count(ids) > 1
