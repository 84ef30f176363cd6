//go:build tools

// Package upstream pins the programs scripts/build-upstream.sh builds; nothing here is compiled.
package upstream

import (
	_ "sigs.k8s.io/cri-tools/cmd/crictl"
)
