//go:build tools

// Package tools pins the OPA command built by dev/setup/binaries.sh.
package tools

import _ "github.com/open-policy-agent/opa"
