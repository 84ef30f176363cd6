//go:build tools

// Package upstream pins the programs scripts/build-upstream.sh builds; nothing here is compiled.
package upstream

import (
	_ "github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk"
)
