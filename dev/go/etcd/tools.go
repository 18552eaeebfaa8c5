//go:build tools

// Package tools pins the etcd server built by dev/setup/binaries.sh.
package tools

import _ "go.etcd.io/etcd/server/v3"
