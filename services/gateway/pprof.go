//go:build pprof

package main

import (
	"net/http"
	_ "net/http/pprof" // the profiling endpoints, in builds tagged pprof only
	"os"
)

// A build tagged pprof serves net/http/pprof on EGRESS_GATEWAY_PPROF (a
// loopback address): the gateway benchmark profiles the gateway through
// it. Release builds do not carry it.
func init() {
	if addr := os.Getenv("EGRESS_GATEWAY_PPROF"); addr != "" {
		go func() { _ = http.ListenAndServe(addr, nil) }()
	}
}
