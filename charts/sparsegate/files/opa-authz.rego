# OPA's own API authorization for the sparsegate OPA sidecar (`opa run --authentication=token
# --authorization=basic`): OPA asks `data.system.authz.allow` before serving any request.
#
# The only client is the sparsegate operator in the same pod. It sends `Authorization: Bearer
# <token>`, and OPA hands the bearer token to this policy as `input.identity`. The expected token
# is the sidecar's environment variable SPARSEGATE_OPA_TOKEN (from the chart's Secret, which the
# operator container reads too). OPA listens on the pod IP, not loopback (pods sharing one network
# namespace must not collide on the port), so the token, not the address, keeps other pods out.
#
# The kubelet's readiness and liveness probes carry no token: `GET /health` is open. It reveals
# only whether OPA is up. Everything else, reads included (policies and data are the zero-trust
# routing rules), needs the token. No token configured means nothing but /health is allowed: the
# policy fails closed.
package system.authz

default allow := false

# The kubelet's probes: GET /health (any query, e.g. ?plugins).
allow if {
	input.method == "GET"
	input.path == ["health"]
}

# The operator: the bearer token matches the one this OPA was started with.
allow if {
	expected_token != ""
	input.identity == expected_token
}

expected_token := opa.runtime().env.SPARSEGATE_OPA_TOKEN
