package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// LockByNames and LockMany lock a batch's proxies in one query and return
// those that exist; the writes of the transaction (updates, a row written
// twice, an insert, a delete) end as made: each row as last written, one
// change each, in the order made.
func TestLockManyAndWriteInOneTransaction(t *testing.T) {
	t.Parallel()
	h := orchtest.New(t)
	ctx := context.Background()
	for i := range 3 {
		h.Create(orchtest.Managed(fmt.Sprintf("old-%d", i)))
	}
	start, err := h.Store.Revision(ctx)
	if err != nil {
		t.Fatal(err)
	}

	err = h.Store.Write(ctx, func(tx *store.Tx) error {
		byName, err := tx.LockByNames(ctx, []string{"old-2", "old-0", "old-1", "absent"})
		if err != nil {
			return err
		}
		if len(byName) != 3 {
			t.Errorf("LockByNames found %d proxies; want 3", len(byName))
		}
		byUID, err := tx.LockMany(ctx, []string{byName["old-0"].UID, byName["old-1"].UID, "00000000-0000-0000-0000-000000000001"})
		if err != nil {
			return err
		}
		if len(byUID) != 2 || byUID[byName["old-1"].UID].Name != "old-1" {
			t.Errorf("LockMany found %v; want old-0 and old-1", byUID)
		}
		a, b := byName["old-0"], byName["old-1"]
		a.Message = "first"
		tx.Update(a)
		b.Message = "b"
		tx.Update(b)
		a2 := *a
		a2.Message = "second"
		tx.Update(&a2)
		tx.Insert(lifecycle.New("new-0", map[string]string{"k": "v"}, orchtest.Managed("new-0").GetSpec(), false, tx.Now()))
		tx.Delete(byName["old-2"])
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}

	want := map[string]string{"old-0": "second", "old-1": "b", "new-0": ""}
	for name, msg := range want {
		r, err := h.Store.Get(ctx, name)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if r.Message != msg {
			t.Errorf("%s: message %q; want %q", name, r.Message, msg)
		}
	}
	if got, _ := h.Store.Get(ctx, "new-0"); got.Labels["k"] != "v" || got.Phase != proxyv1.ProxyPhase_PROXY_PHASE_PENDING {
		t.Errorf("new-0 stored as %v %v", got.Labels, got.Phase)
	}
	if _, err := h.Store.Get(ctx, "old-2"); err != store.ErrNotFound {
		t.Errorf("old-2 after its delete: %v", err)
	}
	changes, err := h.Store.Changes(ctx, start, 100)
	if err != nil {
		t.Fatal(err)
	}
	type entry struct {
		name string
		typ  proxyv1.ChangeType
		msg  string
	}
	wantChanges := []entry{
		{"old-0", proxyv1.ChangeType_CHANGE_TYPE_UPDATED, "first"},
		{"old-1", proxyv1.ChangeType_CHANGE_TYPE_UPDATED, "b"},
		{"old-0", proxyv1.ChangeType_CHANGE_TYPE_UPDATED, "second"},
		{"new-0", proxyv1.ChangeType_CHANGE_TYPE_CREATED, ""},
		{"old-2", proxyv1.ChangeType_CHANGE_TYPE_DELETED, ""},
	}
	if len(changes) != len(wantChanges) {
		t.Fatalf("%d changes; want %d", len(changes), len(wantChanges))
	}
	for i, c := range changes {
		w := wantChanges[i]
		if c.Revision != start+int64(i)+1 || c.Proxy.GetName() != w.name || c.Type != w.typ || c.Proxy.GetStatus().GetMessage() != w.msg {
			t.Errorf("change %d: r%d %s %v %q; want r%d %s %v %q", i, c.Revision, c.Proxy.GetName(), c.Type,
				c.Proxy.GetStatus().GetMessage(), start+int64(i)+1, w.name, w.typ, w.msg)
		}
	}
	if r, _ := h.Store.Get(ctx, "old-0"); r.Revision != start+3 || time.Since(r.UpdateTime) > time.Minute {
		t.Errorf("old-0 at r%d, updated %v; want r%d, now", r.Revision, r.UpdateTime, start+3)
	}
}
