package proxmox

import (
	"context"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"os"
	"strings"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/services/provisioner-proxmox/internal/pvefake"
)

// Every reason of the health table.
func TestCheckReasons(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name        string
		setup       func(t *testing.T, e *env)
		timeout     time.Duration
		wantReason  string
		wantMsg     string
		wantDetails []string // keys present
		noRequest   bool
	}{
		{name: "reachable", wantReason: provisioner.ReasonReachable, wantDetails: []string{"tokenID", "pveVersion", "kernel", "isoStorageAvailGiB", "templates"}},
		{name: "token file missing", setup: func(t *testing.T, e *env) { _ = os.Remove(e.tokenFile) }, wantReason: provisioner.ReasonCredentialsUnavailable, noRequest: true},
		{name: "token file malformed", setup: func(t *testing.T, e *env) { writeFile(t, e.tokenFile, "secret-only") }, wantReason: provisioner.ReasonCredentialsUnavailable, noRequest: true},
		{name: "TLS verification fails", setup: func(t *testing.T, e *env) {
			f2, err := pvefake.Start(pvefake.Options{})
			if err != nil {
				t.Fatal(err)
			}
			f2.Close()
			writeFile(t, e.caFile, string(f2.CAPEM))
		}, wantReason: provisioner.ReasonCertificateInvalid, wantDetails: []string{"tokenID"}},
		{name: "CA file missing", setup: func(t *testing.T, e *env) { _ = os.Remove(e.caFile) }, wantReason: provisioner.ReasonCertificateInvalid},
		{name: "CA file without a certificate", setup: func(t *testing.T, e *env) { writeFile(t, e.caFile, "junk") }, wantReason: provisioner.ReasonCertificateInvalid},
		{name: "connection refused", setup: func(t *testing.T, e *env) { e.be.c.base = closedURL(t) + "/api2/json" }, wantReason: provisioner.ReasonUnreachable},
		{name: "connection cut mid-answer", setup: func(t *testing.T, e *env) { e.fake.Inject(pvefake.Fault{Path: "/version", Cut: true}) }, wantReason: provisioner.ReasonUnreachable},
		{name: "595 from pveproxy", setup: func(t *testing.T, e *env) { e.fake.SetNodeDown("pv1-1", 595) }, wantReason: provisioner.ReasonUnreachable, wantDetails: []string{"pveVersion"}},
		{name: "596 from pveproxy", setup: func(t *testing.T, e *env) { e.fake.SetNodeDown("pv1-1", 596) }, wantReason: provisioner.ReasonUnreachable},
		{name: "401", setup: func(t *testing.T, e *env) { writeFile(t, e.tokenFile, tokenUser+"=nope") }, wantReason: provisioner.ReasonUnauthorized, wantMsg: "Authentication failed!"},
		{name: "403", setup: func(t *testing.T, e *env) {
			e.fake.AddToken(tokenUser, tokenSecret, map[string][]string{"/": {"VM.Audit"}})
		}, wantReason: provisioner.ReasonForbidden, wantMsg: "Permission check failed (/nodes/pv1-1, Sys.Audit)"},
		{name: "the round runs out", setup: func(t *testing.T, e *env) { e.fake.Inject(pvefake.Fault{Path: "/status", Delay: 10 * time.Second}) },
			timeout: 300 * time.Millisecond, wantReason: provisioner.ReasonTimeout},
		{name: "a request runs out", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Path: "/version", Delay: 10 * time.Second})
			e.be.c.budgets.Request = 200 * time.Millisecond
		}, wantReason: provisioner.ReasonTimeout},
		{name: "storage missing (400 No such storage.)", setup: func(t *testing.T, e *env) { e.fake.RemoveStorage("pv1-1", "proxy-seeds") },
			wantReason: provisioner.ReasonStorageNotFound, wantMsg: "No such storage."},
		{name: "storage answering 500", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Path: "/storage/proxy-seeds/status", Status: 500, Message: "storage 'proxy-seeds' is not online"})
		}, wantReason: provisioner.ReasonStorageNotFound, wantMsg: "is not online"},
		{name: "storage inactive", setup: func(t *testing.T, e *env) { e.fake.SetStorage("pv1-1", "proxy-seeds", false, "iso") },
			wantReason: provisioner.ReasonStorageNotFound, wantMsg: "is not active", wantDetails: []string{"isoStorageAvailGiB"}},
		{name: "storage without iso content", setup: func(t *testing.T, e *env) { e.fake.SetStorage("pv1-1", "proxy-seeds", true, "images,rootdir") },
			wantReason: provisioner.ReasonStorageNotFound, wantMsg: "holds no iso content"},
		{name: "template missing", setup: func(t *testing.T, e *env) { e.be.cfg.Templates["other"] = Template{VMID: 9009} },
			wantReason: provisioner.ReasonTemplateNotFound, wantMsg: "other (VM 9009 does not exist)"},
		{name: "template not a template", setup: func(t *testing.T, e *env) { e.fake.AddTemplate(templateID, "pv1-1", pvefake.DebianTemplate(), true) },
			wantReason: provisioner.ReasonTemplateNotFound, wantMsg: "is not a template"},
		{name: "any other failure", setup: func(t *testing.T, e *env) {
			e.fake.Inject(pvefake.Fault{Path: "/version", Status: 500, Message: "Internal Server Error: something broke"})
		}, wantReason: provisioner.ReasonAPIError, wantMsg: "something broke"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, nil)
			if tc.setup != nil {
				tc.setup(t, e)
			}
			ctx := context.Background()
			if tc.timeout > 0 {
				var cancel context.CancelFunc
				ctx, cancel = context.WithTimeout(ctx, tc.timeout)
				defer cancel()
			}
			got := e.be.Check(ctx)
			if len(got) != 1 {
				t.Fatalf("%d targets", len(got))
			}
			ts := got[0]
			if ts.GetReason() != tc.wantReason || ts.GetReady() != (tc.wantReason == provisioner.ReasonReachable) {
				t.Fatalf("reason %s ready %v (%s), want %s", ts.GetReason(), ts.GetReady(), ts.GetMessage(), tc.wantReason)
			}
			if !strings.Contains(ts.GetMessage(), tc.wantMsg) {
				t.Errorf("message %q lacks %q", ts.GetMessage(), tc.wantMsg)
			}
			if ts.GetName() != "pv1-1" || ts.GetAddress() != e.cfg.URL || ts.GetLatency() == nil || ts.GetDetails()["isoStorage"] != "proxy-seeds" {
				t.Errorf("target = %v", ts)
			}
			for _, k := range tc.wantDetails {
				if ts.GetDetails()[k] == "" {
					t.Errorf("details lack %s: %v", k, ts.GetDetails())
				}
			}
			if id, ok := ts.GetDetails()["tokenID"]; ok && id != tokenUser {
				t.Errorf("tokenID = %q", id)
			}
			for k, v := range ts.GetDetails() {
				if strings.Contains(v, tokenSecret) {
					t.Errorf("details[%s] carries the secret", k)
				}
			}
			if tc.noRequest && e.fake.TotalCalls() != 0 {
				t.Errorf("%d requests without credentials", e.fake.TotalCalls())
			}
			if tc.wantReason == provisioner.ReasonReachable {
				d := ts.GetDetails()
				if d["pveVersion"] != pvefake.Version || d["templates"] != "1/1" || d["isoStorageAvailGiB"] != "90.0" {
					t.Errorf("details = %v", d)
				}
				if n := e.fake.TotalCalls(); n != 4 {
					t.Errorf("a check made %d requests, want 4", n)
				}
			}
		})
	}
}

// All nodes are checked concurrently, one target each, in config order.
func TestCheckEveryNode(t *testing.T) {
	t.Parallel()
	nodes := []string{"pv1-1", "pv1-2", "pv1-3"}
	e := newEnv(t, func(c *Config) { c.Nodes = nodes }, func(o *pvefake.Options) { o.Nodes = nodes })
	e.fake.SetNodeDown("pv1-2", 595)
	// Each node's status answer is held 1s: concurrent checks take about
	// that long in all, sequential ones at least three times as long (the
	// margin between is wide for a loaded machine).
	e.fake.Inject(pvefake.Fault{Path: "/status", Delay: time.Second})
	start := time.Now()
	got := e.be.Check(context.Background())
	took := time.Since(start)
	if len(got) != 3 {
		t.Fatalf("%d targets", len(got))
	}
	for i, ts := range got {
		if ts.GetName() != nodes[i] {
			t.Errorf("target %d = %s, want %s", i, ts.GetName(), nodes[i])
		}
	}
	if got[0].GetReason() != provisioner.ReasonReachable || got[1].GetReason() != provisioner.ReasonUnreachable || got[2].GetReason() != provisioner.ReasonReachable {
		t.Errorf("reasons = %s %s %s", got[0].GetReason(), got[1].GetReason(), got[2].GetReason())
	}
	if took >= 2500*time.Millisecond {
		t.Errorf("checking three nodes took %s; they are not checked concurrently", took)
	}
}

// A template on a node that does not answer is listed as status unknown
// without the template flag: the healthy node's check reports the
// template's node unreachable, not the template missing.
func TestCheckTemplateOnUnreachableNode(t *testing.T) {
	t.Parallel()
	nodes := []string{"pv1-1", "pv1-2"}
	e := newEnv(t, func(c *Config) {
		c.Nodes = nodes
		c.Templates["debian-13-b"] = Template{VMID: 9002}
	}, func(o *pvefake.Options) { o.Nodes = nodes })
	e.fake.AddTemplate(9002, "pv1-2", pvefake.DebianTemplate(), false)
	e.fake.SetNodeDown("pv1-2", 595)
	got := e.be.Check(ctxT(t))
	if len(got) != 2 {
		t.Fatalf("%d targets", len(got))
	}
	for _, ts := range got {
		if ts.GetReason() != provisioner.ReasonUnreachable {
			t.Errorf("%s: reason %s (%s), want %s", ts.GetName(), ts.GetReason(), ts.GetMessage(), provisioner.ReasonUnreachable)
		}
	}
	if want := "debian-13-b (VM 9002 is on node pv1-2, which does not answer)"; !strings.Contains(got[0].GetMessage(), want) {
		t.Errorf("pv1-1 message %q lacks %q", got[0].GetMessage(), want)
	}
	if got[0].GetDetails()["templates"] != "1/2" {
		t.Errorf("pv1-1 templates %q, want 1/2", got[0].GetDetails()["templates"])
	}
}

// Never logged at any level: the token, the CA content, the cloud-init,
// the upload body.
func TestSecretsNeverLogged(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	in, _ := e.created(t, "5ec2e700-0000-4000-8000-000000000001")
	ctx := ctxT(t)
	if _, err := e.be.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}); err != nil {
		t.Fatal(err)
	}
	e.be.Check(ctx)
	if _, err := e.be.List(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := e.be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: in.GetProxyUid()}); err != nil {
		t.Fatal(err)
	}
	writeFile(t, e.tokenFile, tokenUser+"=wrong-"+tokenSecret)
	e.be.Check(ctx)
	out := e.logs.String()
	caLine := strings.Split(string(e.fake.CAPEM), "\n")[1]
	for what, s := range map[string]string{"token secret": tokenSecret, "CA content": caLine, "cloud-init": "cl0ud-1n1t-s3cr3t", "seed body": "instance-id:"} {
		if strings.Contains(out, s) {
			t.Errorf("the %s reached the log", what)
		}
	}
	// The documented log lines are there.
	for _, msg := range []string{"proxmox api call", "proxmox vm ensured running", "proxmox vm fetched", "proxmox vm deleted", "proxmox vms listed", "proxmox node checked", "proxmox create resolved", "proxmox guest agent answered", "proxmox listed instance"} {
		if !strings.Contains(out, `"msg":"`+msg+`"`) {
			t.Errorf("no %q line", msg)
		}
	}
	if !strings.Contains(out, `"filename":"proxy-5ec2e700-0000-4000-8000-000000000001-seed.iso"`) || !strings.Contains(out, `"bytes":`) {
		t.Error("the upload's api call line lacks filename or byte count")
	}
}
