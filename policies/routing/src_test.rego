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

# A request (L7) names its route: naming no group it asks for the whole model, which an Allow
# scoped to groups does not cover (only a flow, naming neither, is admitted by a scoped Allow).
test_request_naming_no_group_is_not_admitted_by_a_group_scoped_allow if {
	target := object.union(to_model("mixtral", 8080), {"route": "/v1/infer"})
	not decide(req(caller("tools", "agent", {}), target)).allow
	decide(req(caller("tools", "agent", {}), object.union(target, {"expertGroup": "code"}))).allow
	decide(req(caller("web", "frontend", {}), target)).allow # an unscoped Allow covers it
}

test_request_naming_no_route_is_not_admitted_by_a_route_scoped_allow if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1mixtral/ns:ops", "value": [rule("models/ops-infer#s0t0", "allow", {"routes": ["/v1/infer"]})]}])
	target := object.union(to_model("mixtral", 8080), {"expertGroup": "code"})
	not routing.allow with input as req(caller("ops", "bot", {}), target) with data.sparsegate.policies as p
	routing.allow with input as req(caller("ops", "bot", {}), object.union(target, {"route": "/v1/infer"}))
		with data.sparsegate.policies as p
	routing.allow with input as req(caller("ops", "bot", {}), to_model("mixtral", 8080)) with data.sparsegate.policies as p
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

# A caller named by namespace alone has no service account: namespace-wide rules apply to it,
# rules naming a service account do not.
test_caller_without_service_account if {
	p := {"trustDomain": td, "targets": {"models/mixtral": {"*": [rule("models/sa#s0t0", "allow", {"serviceAccount": "gateway"})]}}}
	not routing.allow with input as req({"namespace": "edge"}, to_model("mixtral", 8080)) with data.sparsegate.policies as p
	d := decide(req({"namespace": "batch"}, to_model("mixtral", 8080)))
	d.rule == "models/deny-batch#s0t0"
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

# --- The whole allow-list in one evaluation ------------------------------------------------------

# Classes and models as the operator sends them (policy_compile.flow_question): classes with the
# identity keys they are filed under (`keys`, used here to join them, not read by the policy),
# models with their candidate ports (named by a rule, or the pods' ports where a rule names none;
# `declared`: one of the pods' ports), and the pairs joined by identity key, split into `one` (a
# single bucket of one unconditional rule) and `many`.
flow_classes := [
	{"serviceAccount": "frontend", "keys": [frontend_id, "ns:web", "*"]},
	{"serviceAccount": "job", "labels": {"tier": "trusted"}, "keys": ["spiffe://cluster.local/ns/batch/sa/job", "ns:batch", "*"]},
	{"serviceAccount": "tool", "keys": ["spiffe://cluster.local/ns/tools/sa/tool", "ns:tools", "*"]},
	{"serviceAccount": "bot", "labels": {"tier": "trusted"}, "keys": ["spiffe://cluster.local/ns/ops/sa/bot", "ns:ops", "*"]},
	{"serviceAccount": "intruder", "keys": ["spiffe://cluster.local/ns/web/sa/intruder", "ns:web", "*"]},
]

flow_models := [
	{"namespace": "models", "sparseModel": "mixtral", "ports": [{"port": 8080, "protocol": "tcp", "declared": true}, {"port": 9090, "protocol": "tcp"}]},
	{"namespace": "models", "sparseModel": "llama", "ports": [{"port": 7070, "protocol": "udp", "declared": true}, {"port": 8080, "protocol": "tcp", "declared": true}]},
]

flow_pairs(p) := [[i, j, bs] |
	some j, m in flow_models
	some i, c in flow_classes
	bs := [[t, k] |
		some t in [concat("/", [m.namespace, m.sparseModel]), concat("/", [m.namespace, "*"])]
		some k in c.keys
		p.targets[t][k]
	]
	count(bs) > 0
]

unconditional(r) if {
	not r.serviceAccount
	count(r.matchLabels) == 0
}

# A pair decided by one unconditional rule alone: its bucket goes to `one`.
one_rule_pair(p, bs) if {
	count(bs) == 1
	count(p.targets[bs[0][0]][bs[0][1]]) == 1
	unconditional(p.targets[bs[0][0]][bs[0][1]][0])
}

flow_input_for(p) := {
	"classes": [object.remove(c, ["keys"]) | some c in flow_classes],
	"models": flow_models,
	"one": [b | some b in {bs[0] | some [_, _, bs] in flow_pairs(p); one_rule_pair(p, bs)}],
	"many": [[i, j, bs] | some [i, j, bs] in flow_pairs(p); not one_rule_pair(p, bs)],
}

# flow_decisions as [class, model, port, protocol, allow, rule] rows: each `one` answer expanded
# over the pairs its bucket decides and, where the rule names no port, the model's declared ports
# (an Allow) or candidate ports (a Deny), as policy_compile.FlowQuestion.decisions does.
flat(p, inp, fd) := {f | some f in fd.many} | {[i, j, port.port, port.protocol, allow, id] |
	some [k, allow, id, ports] in fd.one
	some [i, j, bs] in flow_pairs(p)
	bs == [inp.one[k]]
	some port in answer_ports(ports, j, allow)
}

answer_ports(ports, _, _) := ports if count(ports) > 0

answer_ports(ports, j, false) := flow_models[j].ports if count(ports) == 0

answer_ports(ports, j, true) := [q | some q in flow_models[j].ports; q.declared] if count(ports) == 0

flow_input := flow_input_for(policies)

flows := flat(policies, flow_input, fd) if {
	fd := routing.flow_decisions with input as flow_input with data.sparsegate.policies as policies
}

test_flow_decisions_cover_every_decided_flow if {
	flows == {
		[0, 0, 8080, "tcp", true, "models/allow-frontend#s0t0"],
		[1, 0, 8080, "tcp", false, "models/deny-batch#s0t0"], # deny wins over batch-all (prio 100)
		[1, 0, 9090, "tcp", false, "models/deny-batch#s0t0"], # port-less deny: every candidate port
		[2, 0, 8080, "tcp", true, "models/tools-code#s0t0"], # scoped allow admits the flow
		[3, 0, 9090, "tcp", true, "models/trusted#s0t0"], # any namespace, labels match
		[1, 1, 8080, "tcp", true, "models/batch-all#s0t0"], # <ns>/* target; no deny on llama
		[1, 1, 7070, "udp", true, "models/batch-all#s0t0"], # port-less allow: the pods' ports
	}
}

test_flow_decisions_agree_with_single_decisions if {
	every f in flows {
		c := flow_classes[f[0]]
		m := flow_models[f[1]]
		ns := split(c.keys[1], ":")[1]
		d := decide(req(caller(ns, c.serviceAccount, object.get(c, "labels", {})), {"namespace": m.namespace, "sparseModel": m.sparseModel, "port": f[2], "protocol": f[3]}))
		d.allow == f[4]
		d.rule == f[5]
	}
}

test_flow_decisions_rank_several_hits_and_skip_scoped_deny if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1mixtral/ns:web", "value": [
		rule("models/low#s0t0", "allow", {"priority": 1}),
		rule("models/high#s0t0", "allow", {"priority": 50}),
		rule("models/no-math#s0t0", "deny", {"expertGroups": ["math"]}),
	]}])
	fs := flat(p, flow_input_for(p), routing.flow_decisions) with input as flow_input_for(p)
		with data.sparsegate.policies as p
	[0, 0, 8080, "tcp", true, "models/high#s0t0"] in fs
	not [0, 0, 8080, "tcp", true, "models/allow-frontend#s0t0"] in fs
	[4, 0, 8080, "tcp", true, "models/high#s0t0"] in fs # web/intruder: the namespace-wide allows
}

# A port-less Allow covers the ports the model's pods declare, not 9090, which only the `trusted`
# rule names (CRD spec.ports); a port-less Deny covers every candidate port.
test_flow_portless_allow_covers_declared_ports_only if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1mixtral/ns:web", "value": [rule("models/web-any#s0t0", "allow", {"ports": []})]}])
	fs := flat(p, flow_input_for(p), routing.flow_decisions) with input as flow_input_for(p)
		with data.sparsegate.policies as p
	[4, 0, 8080, "tcp", true, "models/web-any#s0t0"] in fs
	not [4, 0, 9090, "tcp", true, "models/web-any#s0t0"] in fs
	[1, 0, 9090, "tcp", false, "models/deny-batch#s0t0"] in fs
}

test_flow_decisions_without_data_or_classes_are_empty if {
	routing.flow_decisions == {"one": [], "many": set()} with input as flow_input
	routing.flow_decisions == {"one": [], "many": set()}
		with input as {"classes": [], "models": flow_models, "one": [], "many": []}
		with data.sparsegate.policies as policies
}

test_flow_input_exercises_both_paths if {
	flow_input.one == [["models/*", "ns:batch"]] # batch/job -> llama: batch-all alone
	count(flow_input.many) == 5 # every class reaches mixtral through its "*" bucket
}

# The shortcut for `one` answers exactly what gathering would.
test_one_rule_shortcut_agrees_with_the_general_path if {
	all_many := object.union(flow_input, {"one": [], "many": [[i, j, bs] | some [i, j, bs] in flow_pairs(policies)]})
	flat(policies, all_many, routing.flow_decisions) == flows with input as all_many
		with data.sparsegate.policies as policies
}

test_one_rule_shortcut_answers_only_the_ports_its_rule_names if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1llama", "value": {frontend_id: [rule("models/fe-llama#s0t0", "allow", {"ports": [{"port": 7070, "protocol": "udp"}]})]}}])
	inp := flow_input_for(p)
	["models/llama", frontend_id] in inp.one
	fd := routing.flow_decisions with input as inp with data.sparsegate.policies as p
	fs := flat(p, inp, fd)
	[0, 1, 7070, "udp", true, "models/fe-llama#s0t0"] in fs
	not [0, 1, 8080, "tcp", true, "models/fe-llama#s0t0"] in fs
}

# A bucket that alone decides several pairs (here: every class, through "*") is asked once.
test_one_bucket_is_asked_once_for_every_pair_it_decides if {
	p := json.patch(policies, [{"op": "add", "path": "/targets/models~1llama", "value": {"*": [rule("models/all-llama#s0t0", "deny", {"ports": []})]}}])
	inp := flow_input_for(p)
	[b | some b in inp.one; b == ["models/llama", "*"]] == [["models/llama", "*"]]
	fd := routing.flow_decisions with input as inp with data.sparsegate.policies as p
	[k, false, "models/all-llama#s0t0", []] in fd.one
	inp.one[k] == ["models/llama", "*"]
	fs := flat(p, inp, fd)
	every i, _ in flow_classes {
		every port in flow_models[1].ports {
			[i, 1, port.port, port.protocol, false, "models/all-llama#s0t0"] in fs
		}
	}
}
