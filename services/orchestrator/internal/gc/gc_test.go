package gc_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
)

// The true-orphan matrix: only an instance whose mark names an unknown
// proxy and that is older than the grace age is deleted; a provider whose
// list fails is skipped.
func TestOrphanGCTrueOrphanMatrix(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	cloud := orchtest.NewCloud()
	var instances []*provisionerv1.Instance
	ready := make(chan struct{})
	var silent atomic.Value // the UID of a proxy whose commands are never answered
	silent.Store("")
	fake := h.StartProvisioner("fake", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_LIST {
			<-ready
			return &busv1.CommandResult{Outcome: &busv1.CommandResult_List{List: &provisionerv1.ListInstancesResponse{Instances: instances}}}
		}
		if cmd.GetPurpose() == busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC {
			return &busv1.CommandResult{Outcome: &busv1.CommandResult_Delete{Delete: &provisionerv1.DeleteInstanceResponse{Deleted: true}}}
		}
		if cmd.GetCreate().GetProxyName() == "deleting" || cmd.GetProxyUid() == silent.Load().(string) {
			return nil
		}
		return cloud.Answer(cmd)
	})
	other := h.StartProvisioner("other", func(cmd *busv1.Command) *busv1.CommandResult {
		if cmd.GetOperation() == busv1.Operation_OPERATION_LIST {
			return orchtest.Failure(errclass.Transient, "connection refused")
		}
		return cloud.Answer(cmd)
	})
	h.StartReplica()

	live := h.Create(orchtest.Managed("live"))
	h.WaitFor("live", "Running", orchtest.Phase(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING))
	deleting := h.Create(orchtest.Managed("deleting"))
	silent.Store(deleting.GetUid())
	h.WaitFor("deleting", "with its create in flight", func(r *lifecycle.Proxy) bool { return r.CommandID != "" })
	if _, err := h.API.DeleteProxy(context.Background(), &proxyv1.DeleteProxyRequest{Name: "deleting"}); err != nil {
		t.Fatal(err)
	}

	old := timestamppb.New(time.Now().Add(-time.Hour))
	orphan := uuid.NewString()
	young := uuid.NewString()
	ours := orchtest.Installation
	instances = []*provisionerv1.Instance{
		{ProviderId: "vm/live", ProxyUid: live.GetUid(), CreateTime: old, Installation: ours},
		{ProviderId: "vm/deleting", ProxyUid: deleting.GetUid(), CreateTime: old, Installation: ours},
		{ProviderId: "vm/orphan", ProxyUid: orphan, CreateTime: old, Installation: ours},
		{ProviderId: "vm/young", ProxyUid: young, CreateTime: timestamppb.New(time.Now().Add(-10 * time.Second)), Installation: ours},
		{ProviderId: "vm/unmarked", CreateTime: old, Installation: ours},
		{ProviderId: "vm/ageless", ProxyUid: uuid.NewString(), Installation: ours},
		// Another installation's orphan, which its List would never
		// answer: GC checks again.
		{ProviderId: "vm/theirs", ProxyUid: uuid.NewString(), CreateTime: old, Installation: "staging"},
		// Marked before installations: its proxy is ours (claimed by its
		// Get), or perhaps another installation's: left alone.
		{ProviderId: "vm/legacy-live", ProxyUid: live.GetUid(), CreateTime: old},
		{ProviderId: "vm/legacy-unknown", ProxyUid: uuid.NewString(), CreateTime: old},
	}
	close(ready)
	if err := h.GC.Sweep(context.Background()); err != nil {
		t.Fatal(err)
	}
	waittest.For(t, orchtest.Wait, "the sweep's lists handled", func() bool {
		return testutil.ToFloat64(h.GC.Metrics.OrphansDeleted.WithLabelValues("fake")) >= 1 &&
			testutil.ToFloat64(h.GC.Metrics.ListFailures.WithLabelValues("other")) >= 1
	})
	h.WaitResultsDrained()

	var deleted []string
	for _, c := range fake.Received() {
		if c.GetOperation() == busv1.Operation_OPERATION_LIST || c.GetPurpose() == busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC {
			if c.GetPurpose() != busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC || c.GetSpecHash() != "" {
				t.Errorf("GC command %s: purpose %v, spec hash %q; want ORPHAN_GC and none", c.GetOperation(), c.GetPurpose(), c.GetSpecHash())
			}
		} else if c.GetPurpose() != busv1.CommandPurpose_COMMAND_PURPOSE_RECONCILE {
			t.Errorf("reconcile command %s for %s: purpose %v", c.GetOperation(), c.GetProxyUid(), c.GetPurpose())
		}
		if c.GetOperation() == busv1.Operation_OPERATION_DELETE && c.GetPurpose() == busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC {
			deleted = append(deleted, c.GetDelete().GetProviderId())
		}
	}
	if len(deleted) != 1 || deleted[0] != "vm/orphan" {
		t.Errorf("orphan deletes = %v, want only vm/orphan", deleted)
	}
	for _, c := range fake.Received() {
		if inst := c.GetList().GetInstallation() + c.GetDelete().GetInstallation(); c.GetPurpose() == busv1.CommandPurpose_COMMAND_PURPOSE_ORPHAN_GC && inst != orchtest.Installation {
			t.Errorf("GC command %s names installation %q, want %q", c.GetOperation(), inst, orchtest.Installation)
		}
	}
	if n := strings.Count(h.Logs.String(), "leaving alone an instance whose mark names no installation"); n != 1 || !strings.Contains(h.Logs.String(), "vm/legacy-unknown") {
		t.Errorf("%d INFO lines for the legacy instance of an unknown proxy, want 1 naming vm/legacy-unknown:\n%s", n, h.Logs.String())
	}
	if n := other.Count(busv1.Operation_OPERATION_DELETE, ""); n != 0 {
		t.Errorf("a provider whose list failed got %d deletes", n)
	}
	if _, err := h.Store.Get(context.Background(), "live"); err != nil {
		t.Errorf("live proxy: %v", err)
	}
}
