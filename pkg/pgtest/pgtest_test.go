package pgtest_test

import (
	"context"
	"net/url"
	"strings"
	"sync"
	"testing"
	"testing/fstest"

	"github.com/jackc/pgx/v5"

	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
)

var migrations = fstest.MapFS{
	"00001_items.sql": {Data: []byte(`-- +goose Up
CREATE TABLE demo.items (id bigserial PRIMARY KEY, owner text NOT NULL);
-- +goose Down
DROP TABLE demo.items;
`)},
	"00002_seed.sql": {Data: []byte(`-- +goose Up
INSERT INTO demo.items (owner) VALUES ('template');
-- +goose Down
DELETE FROM demo.items WHERE owner = 'template';
`)},
}

var demo = pgtest.Template{
	Name:        "pgtest_demo",
	Fingerprint: pgtest.Fingerprint(migrations),
	Migrate: func(ctx context.Context, dsn string) error {
		return postgres.Migrate(ctx, dsn, "demo", migrations, nil)
	},
}

func connect(t *testing.T, dsn string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

func owners(t *testing.T, conn *pgx.Conn) []string {
	t.Helper()
	rows, err := conn.Query(context.Background(), "SELECT owner FROM demo.items ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return got
}

// Two tests running at the same time each see the migrated template and
// only their own writes.
func TestParallelDatabasesAreIsolated(t *testing.T) {
	var inserted sync.WaitGroup
	inserted.Add(2)
	for _, name := range []string{"alpha", "beta"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			conn := connect(t, pgtest.NewDatabase(t, demo))
			if _, err := conn.Exec(context.Background(), "INSERT INTO demo.items (owner) VALUES ($1)", name); err != nil {
				t.Fatal(err)
			}
			inserted.Done()
			inserted.Wait() // both databases now hold a row of their own
			got := owners(t, conn)
			if strings.Join(got, ",") != "template,"+name {
				t.Errorf("rows = %v, want [template %s]", got, name)
			}
		})
	}
}

func TestDatabaseDroppedAfterTest(t *testing.T) {
	var name string
	t.Run("user", func(t *testing.T) {
		u, err := url.Parse(pgtest.NewDatabase(t, demo))
		if err != nil {
			t.Fatal(err)
		}
		name = strings.TrimPrefix(u.Path, "/")
	})
	if !strings.HasPrefix(name, "egress_test_") {
		t.Fatalf("database name %q", name)
	}
	admin := connect(t, pgtest.ServerURL())
	var exists bool
	if err := admin.QueryRow(context.Background(),
		"SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		t.Fatal(err)
	}
	if exists {
		t.Errorf("database %s still exists after its test ended", name)
	}
}

func TestMigrateIsIdempotent(t *testing.T) {
	t.Parallel()
	dsn := pgtest.NewDatabase(t, demo)
	if err := postgres.Migrate(context.Background(), dsn, "demo", migrations, nil); err != nil {
		t.Fatalf("second migrate: %v", err)
	}
	var version int64
	conn := connect(t, dsn)
	if err := conn.QueryRow(context.Background(),
		"SELECT max(version_id) FROM demo.goose_db_version WHERE is_applied").Scan(&version); err != nil {
		t.Fatal(err)
	}
	if version != 2 {
		t.Errorf("schema version = %d, want 2", version)
	}
	if got := owners(t, conn); len(got) != 1 {
		t.Errorf("rows after re-migrate = %v, want the one seeded row", got)
	}
}

func TestFingerprintTracksContent(t *testing.T) {
	t.Parallel()
	changed := fstest.MapFS{}
	for k, v := range migrations {
		changed[k] = v
	}
	changed["00003_more.sql"] = &fstest.MapFile{Data: []byte("-- +goose Up\nSELECT 1;\n")}
	if pgtest.Fingerprint(migrations) == pgtest.Fingerprint(changed) {
		t.Error("adding a migration did not change the fingerprint")
	}
	if pgtest.Fingerprint(migrations) != demo.Fingerprint {
		t.Error("fingerprint is not deterministic")
	}
}
