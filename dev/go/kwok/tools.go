//go:build tools

// Package tools pins the kwok command built by dev/setup/binaries.sh.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
