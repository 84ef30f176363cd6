//go:build tools

// Package upstream pins the programs scripts/build-upstream.sh builds; nothing here is compiled.
package upstream

import (
	_ "github.com/cri-o/cri-o/cmd/crio"
)
