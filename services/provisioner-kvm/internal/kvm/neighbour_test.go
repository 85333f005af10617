package kvm

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os/exec"
	"strings"
	"testing"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"golang.org/x/crypto/ssh"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/logtest"
)

// iproute2's own output for a table with the guest's entry in several
// states and unrelated entries.
const neighbourJSON = `[{"dst":"10.231.7.78","dev":"egk1","lladdr":"52:54:00:a9:f2:37","state":["STALE"]},` +
	`{"dst":"10.231.7.79","dev":"egk1","lladdr":"52:54:00:a9:f2:37","state":["REACHABLE"]},` +
	`{"dst":"10.231.7.80","dev":"egk1","lladdr":"52:54:00:a9:f2:37","state":["FAILED"]},` +
	`{"dst":"10.231.7.81","dev":"egk1","state":["INCOMPLETE"]},` +
	`{"dst":"192.0.2.1","dev":"eth0","lladdr":"02:fc:00:00:00:05","state":["STALE"]}]`

func TestNeighbourAddress(t *testing.T) {
	t.Parallel()
	ns, err := hostNeighbours(context.Background(), "h1", func(context.Context, string) ([]byte, error) { return []byte(neighbourJSON), nil })
	if err != nil || len(ns) != 5 {
		t.Fatalf("parsed table = %+v, %v", ns, err)
	}
	tests := []struct {
		name string
		ns   []neighbour
		macs []string
		want string
	}{
		{"reachable wins over stale", ns, []string{"52:54:00:A9:F2:37"}, "10.231.7.79"},
		{"stale when nothing fresher", ns[:1], []string{"52:54:00:a9:f2:37"}, "10.231.7.78"},
		{"failed is never used", ns[2:3], []string{"52:54:00:a9:f2:37"}, ""},
		{"another MAC", ns, []string{"52:54:00:00:00:01"}, ""},
		{"no MACs", ns, nil, ""},
		{"link-local is not an address", []neighbour{{Dst: "169.254.3.4", LLAddr: "52:54:00:00:00:01", State: []string{"REACHABLE"}}}, []string{"52:54:00:00:00:01"}, ""},
		{"permanent", []neighbour{{Dst: "198.51.100.4", LLAddr: "52:54:00:00:00:01", State: []string{"PERMANENT"}}}, []string{"52:54:00:00:00:01"}, "198.51.100.4"},
	}
	for _, tc := range tests {
		if got := neighbourAddress(tc.ns, tc.macs); got != tc.want {
			t.Errorf("%s: address = %q, want %q", tc.name, got, tc.want)
		}
	}
}

// Get falls back to the host's neighbour table when neither the guest
// agent nor libvirt's ARP source has an address (libvirt 9.0 answers the
// latter with "wrong nlmsg len" on recent kernels).
func TestGetAddressFromHostNeighbours(t *testing.T) {
	t.Parallel()
	api := newFakeAPI("default")
	be, d := fakeBackend(t, api, newImageServer(t), nil)
	var logs logtest.Buffer
	be.log = slog.New(slog.NewJSONHandler(&logs, nil))
	var commands []string
	table, runErr := neighbourJSON, error(nil)
	d.run = func(_ context.Context, cmd string) ([]byte, error) {
		commands = append(commands, cmd)
		return []byte(table), runErr
	}
	ctx := context.Background()
	in, err := be.Create(ctx, req("u1"))
	if err != nil {
		t.Fatal(err)
	}
	x := api.domains["proxy-u1"].xml
	api.domains["proxy-u1"].xml = strings.Replace(x, `<interface type="bridge">`, `<interface type="bridge"><mac address="52:54:00:a9:f2:37"></mac>`, 1)
	api.fail["DomainInterfaceAddresses"] = lvErr(libvirt.ErrInternalError, "internal error: wrong nlmsg len")
	getReq := &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "u1"}
	got, err := be.Get(ctx, getReq)
	if err != nil || got.GetIp() != "10.231.7.79" || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_RUNNING ||
		got.GetDetails()["addressSource"] != sourceNeighbours {
		t.Fatalf("Get = %v, %v; want Running at 10.231.7.79 from the host's neighbours", got, err)
	}
	if len(commands) != 1 || commands[0] != "ip -j -4 neigh show" {
		t.Errorf("commands run on the host = %q", commands)
	}

	// An empty ARP answer falls back the same way.
	delete(api.fail, "DomainInterfaceAddresses")
	if got, err := be.Get(ctx, getReq); err != nil || got.GetIp() != "10.231.7.79" {
		t.Fatalf("Get with an empty ARP answer = %v, %v", got, err)
	}
	// libvirt's ARP source, when it answers, is used before the host's table.
	api.arp["52:54:00:a9:f2:37"] = "10.231.7.90"
	if got, err := be.Get(ctx, getReq); err != nil || got.GetIp() != "10.231.7.90" || got.GetDetails()["addressSource"] != sourceARP {
		t.Fatalf("Get with an ARP answer = %v, %v", got, err)
	}
	delete(api.arp, "52:54:00:a9:f2:37")

	// A table that cannot be read leaves the domain Provisioning, never an
	// error, and is one WARNING per host until it is readable again.
	runErr = &commandError{cmd: neighbourCommand, err: &ssh.ExitError{Waitmsg: ssh.Waitmsg{}}, stderr: "This account is currently not available."}
	for range 2 {
		if got, err := be.Get(ctx, getReq); err != nil || got.GetState() != provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING || got.GetIp() != "" {
			t.Fatalf("Get with an unreadable table = %v, %v", got, err)
		}
	}
	if n := strings.Count(logs.String(), "WARNING: the kvm host's neighbour table cannot be read"); n != 1 {
		t.Errorf("%d WARNINGs for the unreadable table, want 1:\n%s", n, logs.String())
	}
	runErr = nil
	if got, err := be.Get(ctx, getReq); err != nil || got.GetIp() != "10.231.7.79" {
		t.Fatalf("Get once the table is readable = %v, %v", got, err)
	}
	// The guest agent wins when it answers; the host is not asked.
	api.agentIP = "198.51.100.9"
	commands = nil
	if got, err := be.Get(ctx, getReq); err != nil || got.GetIp() != "198.51.100.9" || got.GetDetails()["addressSource"] != sourceAgent || len(commands) != 0 {
		t.Fatalf("Get via the agent = %v, %v (commands %q)", got, err, commands)
	}
}

// The neighbour table read through the real SSH path: the in-process
// server runs the command on this machine, whose table holds an entry the
// test adds on an interface of its own.
func TestHostNeighboursOverSSH(t *testing.T) {
	t.Parallel()
	f := newSSHFixture(t)
	b := make([]byte, 3)
	_, _ = rand.Read(b)
	dev := "egkn" + hex.EncodeToString(b)
	ip := fmt.Sprintf("10.%d.%d.9", 100+int(b[0])%100, b[1])
	mac := fmt.Sprintf("52:54:00:%02x:%02x:%02x", b[0], b[1], b[2])
	for _, args := range [][]string{
		{"link", "add", dev, "type", "bridge"},
		{"link", "set", dev, "up"},
		{"neigh", "add", ip, "lladdr", mac, "nud", "permanent", "dev", dev},
	} {
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %v: %v: %s", args, err, out)
		}
		if args[0] == "link" && args[1] == "add" {
			t.Cleanup(func() { _ = exec.Command("ip", "link", "del", dev).Run() })
		}
	}
	c := f.dial(t)
	ns, err := hostNeighbours(context.Background(), "h1", c.run)
	if err != nil {
		t.Fatal(err)
	}
	if got := neighbourAddress(ns, []string{strings.ToUpper(mac)}); got != ip {
		t.Fatalf("address for %s = %q, want %s (table %+v)", mac, got, ip, ns)
	}
}

// Each way reading the table over SSH fails, and its class.
func TestHostNeighboursErrors(t *testing.T) {
	t.Parallel()
	f := newSSHFixture(t)
	c := f.dial(t)
	reply := func(stdout, stderr string, status uint32, exit bool) *execHandler {
		h := execHandler(func(_ string, o, e io.Writer) (uint32, bool) {
			_, _ = io.WriteString(o, stdout)
			_, _ = io.WriteString(e, stderr)
			return status, exit
		})
		return &h
	}
	hang := make(chan struct{})
	defer close(hang)
	tests := []struct {
		name    string
		handler *execHandler
		reject  ssh.RejectionReason
		timeout time.Duration
		class   errclass.Class
		want    string
	}{
		{"no ip on the host", reply("", "sh: 1: ip: not found", 127, true), 0, 0, errclass.Permanent, "ip: not found"},
		{"iproute2 without -j", reply("", `Option "-j" is unknown, try "ip -help".`, 255, true), 0, 0, errclass.Permanent, "exited with status 255"},
		{"an account that takes no commands", reply("This account is currently not available.\n", "", 1, true), 0, 0, errclass.Permanent, "status 1"},
		{"not a table", reply("10.0.0.1 dev br0 lladdr 52:54:00:00:00:01 REACHABLE\n", "", 0, true), 0, 0, errclass.Permanent, "printed no neighbour table"},
		{"killed mid-command", reply("[{", "", 0, false), 0, 0, errclass.Transient, "without exit status"},
		{"sessions prohibited", nil, ssh.Prohibited, 0, errclass.Permanent, "session refused"},
		{"no session free", nil, ssh.ResourceShortage, 0, errclass.Transient, "session refused"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f.srv.exec.Store(tc.handler)
			f.srv.sessionReject.Store(uint32(tc.reject))
			defer func() { f.srv.exec.Store(nil); f.srv.sessionReject.Store(0) }()
			_, err := hostNeighbours(context.Background(), "h1", c.run)
			if got := errclass.Of(err); err == nil || got != tc.class || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("hostNeighbours = %v (%v), want %v containing %q", err, got, tc.class, tc.want)
			}
			if !strings.Contains(err.Error(), "host h1") {
				t.Errorf("error %q does not name the host", err)
			}
		})
	}

	// A command that never ends ends with the caller's context, and the
	// connection stays usable.
	h := execHandler(func(string, io.Writer, io.Writer) (uint32, bool) { <-hang; return 0, true })
	f.srv.exec.Store(&h)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := hostNeighbours(ctx, "h1", c.run); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hung command = %v, want the context's deadline", err)
	}
	f.srv.exec.Store(reply("[]", "", 0, true))
	if ns, err := hostNeighbours(context.Background(), "h1", c.run); err != nil || len(ns) != 0 {
		t.Fatalf("after the hung command = %v, %v", ns, err)
	}
	if !c.alive() {
		t.Error("the connection died with the command")
	}
}
