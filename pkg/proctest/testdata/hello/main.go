// Command hello is what proctest's own tests build: a main package that
// resolves a host name through package net, so that a build with cgo links
// the C resolver.
package main

import (
	"fmt"
	"net"
)

func main() {
	_, _ = net.LookupHost("localhost")
	fmt.Println("hello")
}
