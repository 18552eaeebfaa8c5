# `opa test` suite for opa-authz.rego (run by tests/unit/chart/test_opa_authz.py).
package system.authz_test

import data.system.authz

runtime(token) := {"env": {"SPARSEGATE_OPA_TOKEN": token}}

request(method, path, identity) := {"method": method, "path": path, "identity": identity}

anonymous(method, path) := {"method": method, "path": path}

test_probe_without_token_is_allowed if {
	authz.allow with input as anonymous("GET", ["health"]) with opa.runtime as runtime("s3cret")
}

test_probe_allowed_even_when_no_token_is_configured if {
	authz.allow with input as anonymous("GET", ["health"]) with opa.runtime as {"env": {}}
}

test_only_get_health_is_open if {
	not authz.allow with input as anonymous("POST", ["health"]) with opa.runtime as runtime("s3cret")
	not authz.allow with input as anonymous("GET", ["health", "extra"]) with opa.runtime as runtime("s3cret")
	not authz.allow with input as anonymous("GET", ["metrics"]) with opa.runtime as runtime("s3cret")
}

test_operator_with_the_token_may_do_anything if {
	every req in [
		request("PUT", ["v1", "policies", "sparsegate-routing"], "s3cret"),
		request("PUT", ["v1", "data", "sparsegate", "policies"], "s3cret"),
		request("GET", ["v1", "data", "sparsegate", "routing", "data_revision"], "s3cret"),
		request("POST", ["v1", "data", "sparsegate", "routing", "batch_decisions"], "s3cret"),
	] {
		authz.allow with input as req with opa.runtime as runtime("s3cret")
	}
}

test_reads_need_the_token_too if {
	not authz.allow with input as anonymous("GET", ["v1", "data"]) with opa.runtime as runtime("s3cret")
	not authz.allow with input as anonymous("GET", ["v1", "policies"]) with opa.runtime as runtime("s3cret")
}

test_wrong_token_is_refused if {
	not authz.allow with input as request("GET", ["v1", "data"], "guess") with opa.runtime as runtime("s3cret")
	not authz.allow with input as request("GET", ["v1", "data"], "s3cret ") with opa.runtime as runtime("s3cret")
}

test_no_configured_token_refuses_everyone if {
	not authz.allow with input as request("GET", ["v1", "data"], "") with opa.runtime as runtime("")
	not authz.allow with input as request("GET", ["v1", "data"], "") with opa.runtime as {"env": {}}
	not authz.allow with input as anonymous("GET", ["v1", "data"]) with opa.runtime as {"env": {}}
}
