package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// A batch's lock query run many times while the table was nearly empty
// still goes through the index once the table has grown: PostgreSQL does
// not keep a plan made for the small table (a sequential scan of the
// whole table for every batch), even when nothing analyzed the table
// since.
func TestLockManyUsesTheIndexAfterTheTableGrew(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(orchtest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	cfg.MaxConns = 1 // one connection: the one whose statements were planned small
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	st := store.New(pool, store.WithKeyring(orchtest.Keyring(t)))

	insert := func(from, n int) []string {
		var uids []string
		err := st.Write(ctx, func(tx *store.Tx) error {
			for i := from; i < from+n; i++ {
				req := orchtest.Managed(fmt.Sprintf("p-%05d", i))
				r := lifecycle.New(req.GetName(), nil, req.GetSpec(), false, time.Now())
				tx.Insert(r)
				uids = append(uids, r.UID)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return uids
	}
	lock := func(uids []string) {
		err := st.Write(ctx, func(tx *store.Tx) error {
			rows, err := tx.LockMany(ctx, uids)
			if err == nil && len(rows) != len(uids) {
				err = fmt.Errorf("locked %d of %d", len(rows), len(uids))
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	// The table's sequential scans so far, this connection's included.
	seqScans := func() int64 {
		var n int64
		if _, err := pool.Exec(ctx, "SELECT pg_stat_force_next_flush()"); err != nil {
			t.Fatal(err)
		}
		if err := pool.QueryRow(ctx, "SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'orchestrator.proxies'::regclass").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	few := insert(0, 2)
	for range 10 {
		lock(few)
	}
	many := insert(2, 5000)
	before := seqScans()
	lock(many[:32])
	if after := seqScans(); after != before {
		t.Errorf("locking 32 of 5,002 proxies scanned the table %d times", after-before)
	}
}
