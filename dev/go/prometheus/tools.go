//go:build tools

// Package tools pins the Prometheus server built by dev/setup/binaries.sh (the rollout analysis's
// Prometheus provider is tested against it).
package tools

import _ "github.com/prometheus/prometheus/cmd/prometheus"
