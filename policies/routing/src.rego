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
#   (`rules[i].target == x` is a scan), so the operator pre-indexes. A decision is two or four map
#   lookups with ground keys plus a check of the few rules in the selected buckets: its cost follows
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

matches(rule) if {
	service_account_ok(rule)
	labels_ok(rule)
	port_ok(rule)
	scope_ok(rule, "expertGroups", "expertGroup")
	scope_ok(rule, "routes", "route")
}

service_account_ok(rule) if not rule.serviceAccount

service_account_ok(rule) if rule.serviceAccount == src_service_account

labels_ok(rule) if {
	every key, value in object.get(rule, "matchLabels", {}) {
		src_labels[key] == value
	}
}

port_ok(rule) if count(object.get(rule, "ports", [])) == 0

port_ok(rule) if {
	some p in rule.ports
	p.port == input.target.port
	lower(p.protocol) == target_protocol
}

# A rule without a scope list covers the whole model.
scope_ok(rule, list, _) if count(object.get(rule, list, [])) == 0

# A scoped rule covers requests naming one of its entries.
scope_ok(rule, list, field) if input.target[field] in rule[list]

# A flow (L4) query names no expert group or route: a scoped Allow admits the connection (the
# model server narrows it per request), a scoped Deny must not cut the whole flow.
scope_ok(rule, _, field) if {
	rule.action == "allow"
	not input.target[field]
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
