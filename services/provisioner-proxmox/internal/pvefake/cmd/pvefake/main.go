// Command pvefake runs the fake Proxmox VE API for manual runs of
// provisioner-proxmox: a node pv1-1 with the seed storage proxy-seeds, the
// Debian template 9001, and a token with the documented ACL. It writes the token
// and the CA to --dir and prints a providers entry that uses them.
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:8006", "listen address")
	dir := flag.String("dir", ".", "where to write token and ca.pem")
	flag.Parse()
	s, err := pvefake.Start(pvefake.Options{Addr: *addr})
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	defer s.Close()
	const user, secret = "proxy-operator@pve!operator", "pvefake-secret"
	s.AddToken(user, secret, s.OperatorACL())
	s.AddTemplate(9001, "pv1-1", pvefake.DebianTemplate(), false)
	token, ca := filepath.Join(*dir, "token"), filepath.Join(*dir, "ca.pem")
	if err := os.WriteFile(token, []byte(user+"="+secret+"\n"), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := os.WriteFile(ca, s.CAPEM, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf(`fake Proxmox VE %s at %s
providers:
  - name: pve-fake
    type: proxmox
    proxmox:
      url: %s
      tokenFile: %s
      caFile: %s
      nodes: [pv1-1]
      isoStorage: proxy-seeds
      templates: {debian-13: {vmid: 9001}}
      machineTypes: {small: {cores: 1, memoryMiB: 1024}}
`, pvefake.Version, s.URL, s.URL, token, ca)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, os.Interrupt)
	<-sig
}
