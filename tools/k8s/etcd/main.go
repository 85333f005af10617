// Command etcd is etcd's own server main, built here because the distribution
// package is too old for a current kube-apiserver's watch streams.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
