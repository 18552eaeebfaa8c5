package sparsegate.routing_test

import data.sparsegate.routing

# --- Builders --------------------------------------------------------------------------------

td := "cluster.local"

rule(id, action, overrides) := object.union(
	{
		"id": id, "policy": split(id, "#")[0], "action": action, "priority": 0,
		"matchLabels": {}, "ports": [{"port": 8080, "protocol": "tcp"}],
		"expertGroups": [], "routes": [],
	},
	overrides,
)

caller(ns, sa, labels) := {"namespace": ns, "serviceAccount": sa, "labels": labels}

to_model(model, port) := {"namespace": "models", "sparseModel": model, "port": port, "protocol": "tcp"}

req(source, target) := {"source": source, "target": target}

frontend_id := sprintf("spiffe://%s/ns/web/sa/frontend", [td])

# web/frontend may call models/mixtral on 8080; batch jobs are denied; the whole `tools` namespace
# may call expert group "code" only; anything in the cluster labelled tier=trusted may call on 9090.
policies := {
	"revision": "sha256:test",
	"trustDomain": td,
	"policies": {},
	"targets": {
		"models/mixtral": {
			frontend_id: [rule("models/allow-frontend#s0t0", "allow", {})],
			"ns:batch": [rule("models/deny-batch#s0t0", "deny", {"priority": 5, "ports": []})],
			"ns:tools": [rule("models/tools-code#s0t0", "allow", {"expertGroups": ["code"]})],
			"*": [rule("models/trusted#s0t0", "allow", {"matchLabels": {"tier": "trusted"}, "ports": [{"port": 9090, "protocol": "tcp"}]})],
		},
		"models/*": {"ns:batch": [rule("models/batch-all#s0t0", "allow", {"priority": 100, "ports": []})]},
	},
}

decide(request) := d if {
	d := routing.decision with input as request with data.sparsegate.policies as policies
}

# --- Default deny ------------------------------------------------------------------------------

test_default_deny_without_data if {
	d := routing.decision with input as req(caller("web", "frontend", {}), to_model("mixtral", 8080))
	not d.allow
	d.rule == ""
	d.reason == "no Allow rule matches (default deny)"
}

test_default_deny_unknown_identity if {
	d := decide(req(caller("web", "intruder", {}), to_model("mixtral", 8080)))
	not d.allow
	d.matched == {"deny": [], "allow": []}
}

test_default_deny_unknown_model if {
	not decide(req(caller("web", "frontend", {}), to_model("llama", 8080))).allow
}

# --- Allow by identity -------------------------------------------------------------------------

test_allow_by_namespace_and_service_account if {
	d := decide(req(caller("web", "frontend", {}), to_model("mixtral", 8080)))
	d.allow
	d.rule == "models/allow-frontend#s0t0"
	d.reason == "allowed"
}

test_allow_by_spiffe_id_alone if {
	d := decide(req({"spiffeID": frontend_id}, to_model("mixtral", 8080)))
	d.allow
	d.rule == "models/allow-frontend#s0t0"
}

test_wrong_port_denied if {
	not decide(req(caller("web", "frontend", {}), to_model("mixtral", 8081))).allow
}

test_wrong_protocol_denied if {
	target := object.union(to_model("mixtral", 8080), {"protocol": "udp"})
	not decide(req(caller("web", "frontend", {}), target)).allow
}

test_foreign_trust_domain_is_not_our_namespace if {
	d := decide(req({"spiffeID": "spiffe://evil.example/ns/tools/sa/x"}, to_model("mixtral", 8080)))
	not d.allow
}

test_labels_must_all_match if {
	trusted := caller("ops", "bot", {"tier": "trusted", "team": "x"})
	decide(req(trusted, to_model("mixtral", 9090))).allow
	not decide(req(caller("ops", "bot", {"tier": "other"}), to_model("mixtral", 9090))).allow
	not decide(req(caller("ops", "bot", {}), to_model("mixtral", 9090))).allow
}

# --- Scopes: expert groups ---------------------------------------------------------------------

test_scoped_allow_admits_flow_and_named_group if {
	decide(req(caller("tools", "agent", {}), to_model("mixtral", 8080))).allow
	decide(req(caller("tools", "agent", {}), object.union(to_model("mixtral", 8080), {"expertGroup": "code"}))).allow
}

test_scoped_allow_refuses_other_group if {
	target := object.union(to_model("mixtral", 8080), {"expertGroup": "math"})
	not decide(req(caller("tools", "agent", {}), target)).allow
}

test_scoped_deny_does_not_cut_the_flow if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1mixtral/ns:web", "value": [rule("models/no-math#s0t0", "deny", {"expertGroups": ["math"]})]}])
	flow := routing.decision with input as req(caller("web", "frontend", {}), to_model("mixtral", 8080))
		with data.sparsegate.policies as p
	flow.allow
	math := routing.decision with input as req(caller("web", "frontend", {}), object.union(to_model("mixtral", 8080), {"expertGroup": "math"}))
		with data.sparsegate.policies as p
	not math.allow
	math.rule == "models/no-math#s0t0"
}

# --- Deny wins ---------------------------------------------------------------------------------

test_deny_wins_over_higher_priority_allow if {
	d := decide(req(caller("batch", "job", {}), to_model("mixtral", 8080)))
	not d.allow
	d.rule == "models/deny-batch#s0t0"
	d.reason == "denied by a Deny rule (Deny wins over Allow)"
	d.matched.allow == ["models/batch-all#s0t0"]
	d.matched.deny == ["models/deny-batch#s0t0"]
}

test_namespace_wide_target_applies_to_other_models if {
	d := decide(req(caller("batch", "job", {}), to_model("llama", 8080)))
	d.allow
	d.rule == "models/batch-all#s0t0"
}

# --- Explanations ------------------------------------------------------------------------------

test_matched_rules_ranked_by_priority if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1mixtral/ns:web", "value": [
		rule("models/low#s0t0", "allow", {"priority": 1}),
		rule("models/high#s0t0", "allow", {"priority": 50}),
	]}])
	d := routing.decision with input as req(caller("web", "frontend", {}), to_model("mixtral", 8080))
		with data.sparsegate.policies as p
	d.rule == "models/high#s0t0"
	d.matched.allow == ["models/high#s0t0", "models/low#s0t0", "models/allow-frontend#s0t0"]
}

test_service_account_residual_for_any_namespace if {
	p := {"trustDomain": td, "targets": {"models/mixtral": {"*": [rule("models/sa#s0t0", "allow", {"serviceAccount": "gateway"})]}}}
	routing.allow with input as req(caller("edge", "gateway", {}), to_model("mixtral", 8080)) with data.sparsegate.policies as p
	not routing.allow with input as req(caller("edge", "other", {}), to_model("mixtral", 8080)) with data.sparsegate.policies as p
}

test_revision_visible_only_with_policy_and_data if {
	routing.data_revision == "sha256:test" with data.sparsegate.policies as policies
	not routing.data_revision
}

test_batch_decisions_in_input_order if {
	batch := [
		req(caller("web", "frontend", {}), to_model("mixtral", 8080)),
		req(caller("batch", "job", {}), to_model("mixtral", 8080)),
		req(caller("web", "intruder", {}), to_model("mixtral", 8080)),
	]
	ds := routing.batch_decisions with input as {"batch": batch} with data.sparsegate.policies as policies
	[d.rule | some d in ds] == ["models/allow-frontend#s0t0", "models/deny-batch#s0t0", ""]
	[d.allow | some d in ds] == [true, false, false]
}

test_spiffe_id_alone_gives_namespace_and_service_account if {
	p := {"trustDomain": td, "targets": {"models/mixtral": {"*": [rule("models/sa#s0t0", "allow", {"serviceAccount": "gateway"})]}}}
	routing.allow with input as req({"spiffeID": "spiffe://cluster.local/ns/edge/sa/gateway"}, to_model("mixtral", 8080))
		with data.sparsegate.policies as p
	not routing.allow with input as req({"spiffeID": "spiffe://elsewhere/ns/edge/sa/gateway"}, to_model("mixtral", 8080))
		with data.sparsegate.policies as p
}
