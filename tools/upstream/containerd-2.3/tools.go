//go:build tools

// Package upstream pins the programs scripts/build-upstream.sh builds; nothing here is compiled.
package upstream

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
