// Command gcpfake runs the fake Compute Engine API for end-to-end tests and
// manual runs of provisioner-gcp. It prints its URL ("url: http://…") and
// a providers entry that uses it.
package main

import (
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/egress-proxies/egress-proxies/services/provisioner-gcp/internal/gcpfake"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:8089", "listen address")
	project := flag.String("project", "egress-fake", "the project that exists")
	zones := flag.String("zones", "europe-west1-b,europe-west1-c", "comma-separated zones that exist")
	quota := flag.String("quota-zones", "", "zones whose inserts fail with QUOTA_EXCEEDED in their operation")
	exhausted := flag.String("exhausted-zones", "", "zones whose inserts fail with ZONE_RESOURCE_POOL_EXHAUSTED in their operation")
	unreachable := flag.String("unreachable-zones", "", "zones that do not answer aggregated lists")
	flag.Parse()
	f := gcpfake.New(gcpfake.Options{Project: *project, Zones: split(*zones), QuotaZones: split(*quota),
		ExhaustedZones: split(*exhausted), UnreachableZones: split(*unreachable)})
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	url := "http://" + ln.Addr().String()
	srv := &http.Server{Handler: f}
	go func() { _ = srv.Serve(ln) }()
	fmt.Printf(`fake Compute Engine API, project %s, zones %s
url: %s
providers:
  - name: gcp-fake
    type: gcp
    gcp:
      project: %s
      zones: [%s]
      machineTypes: [e2-small]
      images: {debian-13: projects/debian-cloud/global/images/family/debian-13}
      endpoint: %s
      withoutAuthentication: true
`, *project, *zones, url, *project, strings.Join(split(*zones), ", "), url)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	<-sig
	_ = srv.Close()
}

func split(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
