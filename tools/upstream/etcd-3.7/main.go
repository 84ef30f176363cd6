// Command etcd is etcd's server. The etcd binary's own main package lives in etcd's root
// module, whose go.mod replaces its sibling modules with local paths, so it cannot be built
// from the module proxy; this calls the same entry point from the published server module.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
