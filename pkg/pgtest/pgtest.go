// Package pgtest gives each test its own PostgreSQL database. A template
// database is migrated once per migration set (and shared by every test
// process on the server), then each test gets `CREATE DATABASE … TEMPLATE`
// — a file copy, far cheaper than migrating — dropped when the test ends.
//
// The server comes from EGRESS_TEST_DATABASE_URL, by default the local one
// (postgres://postgres@127.0.0.1:5432/postgres). The role needs CREATEDB.
package pgtest

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// DefaultURL is the server used when EGRESS_TEST_DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// ServerURL is the URL of the test server's maintenance database.
func ServerURL() string {
	if u := os.Getenv("EGRESS_TEST_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// Template is a migrated database that test databases are copied from.
type Template struct {
	// Name identifies the migration set, such as the owning service.
	Name string
	// Fingerprint changes whenever the migrations change; a new fingerprint
	// builds a new template. Fingerprint(fsys) computes one.
	Fingerprint string
	// Migrate brings the empty database at dsn to the current schema.
	Migrate func(ctx context.Context, dsn string) error
}

// Fingerprint hashes every file in fsys, for Template.Fingerprint.
func Fingerprint(fsys fs.FS) string {
	var names []string
	_ = fs.WalkDir(fsys, ".", func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			names = append(names, p)
		}
		return nil
	})
	sort.Strings(names)
	h := sha256.New()
	for _, n := range names {
		b, _ := fs.ReadFile(fsys, n)
		fmt.Fprintf(h, "%s\x00%d\x00", n, len(b))
		h.Write(b)
	}
	return hex.EncodeToString(h.Sum(nil))
}

var (
	templatesMu sync.Mutex
	templates   = map[string]*templateOnce{}
)

type templateOnce struct {
	once sync.Once
	err  error
}

var unsafeChars = regexp.MustCompile(`[^a-z0-9_]`)

func (t Template) dbName() string {
	fp := t.Fingerprint
	if len(fp) > 12 {
		fp = fp[:12]
	}
	name := unsafeChars.ReplaceAllString(t.Name, "_")
	if len(name) > 30 {
		name = name[:30]
	}
	return "egress_tmpl_" + name + "_" + fp
}

// NewDatabase creates a database from tmpl for the test and returns its
// URL. The database is dropped when the test ends. A test that cannot reach
// the server fails, naming EGRESS_TEST_DATABASE_URL.
func NewDatabase(t testing.TB, tmpl Template) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	tmplName := tmpl.dbName()
	if err := ensureTemplate(ctx, tmpl, tmplName); err != nil {
		t.Fatalf("pgtest: template %s: %v", tmplName, err)
	}
	admin, err := pgx.Connect(ctx, ServerURL())
	if err != nil {
		t.Fatalf("pgtest: connecting to %s (set EGRESS_TEST_DATABASE_URL): %v", redact(ServerURL()), err)
	}
	defer admin.Close(context.Background())

	name := "egress_test_" + randomHex(8)
	create := fmt.Sprintf("CREATE DATABASE %s TEMPLATE %s",
		pgx.Identifier{name}.Sanitize(), pgx.Identifier{tmplName}.Sanitize())
	for attempt := 0; ; attempt++ {
		_, err = admin.Exec(ctx, create)
		var pgErr *pgconn.PgError
		if err == nil || !errors.As(err, &pgErr) || attempt == 20 {
			break
		}
		if pgErr.Code == "55006" { // the template is briefly in use (another process just finished building it)
			time.Sleep(50 * time.Millisecond)
			continue
		}
		if pgErr.Code != "3D000" {
			break
		}
		// The template is gone: a run from another checkout, whose
		// migrations differ, built its own and dropped this one as older.
		// Build it again.
		if err := buildTemplate(ctx, tmpl, tmplName); err != nil {
			t.Fatalf("pgtest: template %s: %v", tmplName, err)
		}
	}
	if err != nil {
		t.Fatalf("pgtest: creating database: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := dropDatabase(ctx, name); err != nil {
			t.Errorf("pgtest: dropping %s: %v", name, err)
		}
	})
	return databaseURL(t, name)
}

// ensureTemplate builds the template once per process, and once per server
// across processes (under an advisory lock; a half-built template from a
// crashed run is rebuilt).
func ensureTemplate(ctx context.Context, tmpl Template, name string) error {
	templatesMu.Lock()
	o, ok := templates[name]
	if !ok {
		o = &templateOnce{}
		templates[name] = o
	}
	templatesMu.Unlock()
	o.once.Do(func() { o.err = buildTemplate(ctx, tmpl, name) })
	return o.err
}

func buildTemplate(ctx context.Context, tmpl Template, name string) error {
	admin, err := pgx.Connect(ctx, ServerURL())
	if err != nil {
		return fmt.Errorf("connecting to %s (set EGRESS_TEST_DATABASE_URL): %w", redact(ServerURL()), err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, "SELECT pg_advisory_lock(hashtext($1))", name); err != nil {
		return err
	}
	defer func() { _, _ = admin.Exec(context.Background(), "SELECT pg_advisory_unlock(hashtext($1))", name) }()

	var exists bool
	if err := admin.QueryRow(ctx, "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)", name).Scan(&exists); err != nil {
		return err
	}
	if exists {
		return nil
	}
	building := name + "_building"
	if err := dropDatabase(ctx, building); err != nil {
		return err
	}
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{building}.Sanitize()); err != nil {
		return err
	}
	if err := tmpl.Migrate(ctx, urlFor(building)); err != nil {
		return fmt.Errorf("migrating: %w", err)
	}
	if _, err := admin.Exec(ctx, fmt.Sprintf("ALTER DATABASE %s RENAME TO %s",
		pgx.Identifier{building}.Sanitize(), pgx.Identifier{name}.Sanitize())); err != nil {
		return err
	}
	dropOlderTemplates(ctx, admin, tmpl, name)
	return nil
}

// dropOlderTemplates removes templates of the same migration set built from
// earlier migrations, so they do not pile up on a developer's server. One
// still in use by an older checkout's test run is left alone.
func dropOlderTemplates(ctx context.Context, admin *pgx.Conn, tmpl Template, keep string) {
	prefix := strings.TrimSuffix(keep, tmpl.Fingerprint[:min(12, len(tmpl.Fingerprint))])
	rows, err := admin.Query(ctx, `SELECT datname FROM pg_database
		WHERE starts_with(datname, $1) AND datname <> $2 AND NOT datname LIKE '%\_building'`, prefix, keep)
	if err != nil {
		return
	}
	old, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return
	}
	for _, n := range old {
		_, _ = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{n}.Sanitize())
	}
}

func dropDatabase(ctx context.Context, name string) error {
	admin, err := pgx.Connect(ctx, ServerURL())
	if err != nil {
		return err
	}
	defer admin.Close(context.Background())
	_, err = admin.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
	return err
}

func databaseURL(t testing.TB, name string) string {
	t.Helper()
	u := urlFor(name)
	if u == "" {
		t.Fatalf("pgtest: EGRESS_TEST_DATABASE_URL must be a postgres:// URL")
	}
	return u
}

func urlFor(name string) string {
	u, err := url.Parse(ServerURL())
	if err != nil || (u.Scheme != "postgres" && u.Scheme != "postgresql") {
		return ""
	}
	u.Path = "/" + name
	return u.String()
}

func redact(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
