//go:build tools

// Package upstream pins the programs scripts/build-upstream.sh builds; nothing here is compiled.
package upstream

import (
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kubectl"
)
