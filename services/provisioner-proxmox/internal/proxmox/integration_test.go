//go:build proxmox_integration

// The integration test against a real Proxmox VE host. It is opt-in:
//
//	PROXMOX_URL=https://192.168.0.8:8006 \
//	PROXMOX_TOKEN_FILE=$HOME/.config/proxmox-token \
//	PROXMOX_CA_FILE=$HOME/.config/proxmox-ca.pem \
//	PROXMOX_NODE=pv1-1 PROXMOX_ISO_STORAGE=proxy-seeds PROXMOX_TEMPLATE_VMID=9001 \
//	go test -tags=proxmox_integration -count=1 -v -run TestRealHost ./services/provisioner-proxmox/internal/proxmox/
//
// Optional: PROXMOX_BRIDGE, PROXMOX_VLAN_TAG, PROXMOX_VMID_MIN and
// PROXMOX_VMID_MAX (default 190000-190999, away from the production range),
// PROXMOX_STORAGE, PROXMOX_INSECURE=1. TestRealHostCheck creates nothing;
// TestRealHostLifecycle creates one VM, waits for its address (the guest
// agent is installed at first boot, so the proxy network needs internet),
// deletes it and checks nothing is left.
package proxmox

import (
	"context"
	"log/slog"
	"os"
	"strconv"
	"testing"
	"time"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

func realHost(t *testing.T) *Backend {
	t.Helper()
	need := func(k string) string {
		v := os.Getenv(k)
		if v == "" {
			t.Skipf("%s is not set", k)
		}
		return v
	}
	atoi := func(k string, def int) int {
		if v := os.Getenv(k); v != "" {
			n, err := strconv.Atoi(v)
			if err != nil {
				t.Fatalf("%s: %v", k, err)
			}
			return n
		}
		return def
	}
	tmpl := atoi("PROXMOX_TEMPLATE_VMID", 0)
	if tmpl == 0 {
		t.Skip("PROXMOX_TEMPLATE_VMID is not set")
	}
	cfg := Config{
		URL: need("PROXMOX_URL"), TokenFile: need("PROXMOX_TOKEN_FILE"), CAFile: os.Getenv("PROXMOX_CA_FILE"),
		InsecureSkipTLSVerify: os.Getenv("PROXMOX_INSECURE") == "1",
		Nodes:                 []string{need("PROXMOX_NODE")}, ISOStorage: need("PROXMOX_ISO_STORAGE"), Storage: os.Getenv("PROXMOX_STORAGE"),
		Bridge: os.Getenv("PROXMOX_BRIDGE"), VLANTag: atoi("PROXMOX_VLAN_TAG", 0),
		VMIDRange:    VMIDRange{Min: atoi("PROXMOX_VMID_MIN", 190000), Max: atoi("PROXMOX_VMID_MAX", 190999)},
		Templates:    map[string]Template{"it": {VMID: tmpl}},
		MachineTypes: map[string]MachineType{"it": {Cores: 1, MemoryMiB: 1024}},
	}
	be, err := New("pve-it", cfg, slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug})), Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(be.Close)
	return be
}

func TestRealHostCheck(t *testing.T) {
	be := realHost(t)
	for _, ts := range be.Check(context.Background()) {
		t.Logf("%s: ready=%v reason=%s message=%q details=%v latency=%s", ts.GetName(), ts.GetReady(), ts.GetReason(), ts.GetMessage(), ts.GetDetails(), ts.GetLatency().AsDuration())
		if !ts.GetReady() {
			t.Errorf("node %s: %s %s", ts.GetName(), ts.GetReason(), ts.GetMessage())
		}
	}
}

func TestRealHostLifecycle(t *testing.T) {
	be := realHost(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	uid := "it-" + strconv.FormatInt(time.Now().Unix(), 36)
	req := &provisionerv1.CreateInstanceRequest{
		Provider: "pve-it", ProxyUid: uid, ProxyName: "integration", Port: 3128,
		CloudInit: "#cloud-config\npackages: [squid]\n",
		Placement: &proxyv1.Placement{MachineType: "it", Image: "it"},
	}
	in, err := be.Create(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("created %s", in.GetProviderId())
	defer func() {
		dctx, dcancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer dcancel()
		if _, err := be.Delete(dctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid}); err != nil {
			t.Errorf("cleanup delete: %v", err)
		}
	}()
	// A repeated Create adopts the running VM.
	again, err := be.Create(ctx, req)
	if err != nil || again.GetProviderId() != in.GetProviderId() {
		t.Fatalf("repeated Create = %v, %v", again, err)
	}
	deadline := time.Now().Add(5 * time.Minute)
	for {
		got, err := be.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid})
		if err != nil {
			t.Fatal(err)
		}
		if got.GetState() == provisionerv1.InstanceState_INSTANCE_STATE_RUNNING && got.GetIp() != "" {
			t.Logf("running at %s", got.GetIp())
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no address within 5m: %v", got)
		}
		time.Sleep(5 * time.Second) // a real VM booting: poll as the orchestrator does
	}
	list, err := be.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var listed bool
	for _, l := range list {
		listed = listed || l.GetProviderId() == in.GetProviderId()
	}
	if !listed {
		t.Error("the VM is not in List")
	}
	deleted, err := be.Delete(ctx, &provisionerv1.DeleteInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid})
	if err != nil || !deleted {
		t.Fatalf("Delete = %v, %v", deleted, err)
	}
	if _, err := be.Get(ctx, &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: uid}); !errclass.Is(err, errclass.NotFound) {
		t.Errorf("Get after Delete = %v, want NotFound", err)
	}
}
