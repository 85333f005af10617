package postgres_test

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/service"
)

func parseFlags(t *testing.T, args []string, env map[string]string) (postgres.Flags, error) {
	t.Helper()
	for k, v := range env {
		t.Setenv(k, v)
	}
	var f postgres.Flags
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	f.Register(fs)
	if err := service.Parse(fs, args); err != nil {
		return f, err
	}
	return f, f.Validate()
}

// Every service shares these flags: their names, defaults, environment
// variables and the errors that name them.
func TestFlags(t *testing.T) {
	cases := []struct {
		name    string
		args    []string
		env     map[string]string
		want    postgres.Flags
		wantErr string
	}{
		{name: "defaults", args: []string{"--database-url=postgres://db/x"},
			want: postgres.Flags{URL: "postgres://db/x", MaxConns: postgres.DefaultMaxConns, Migrate: true}},
		{name: "from the environment", env: map[string]string{"EGRESS_DATABASE_URL": "postgres://env/y", "EGRESS_DATABASE_MAX_CONNS": "3", "EGRESS_MIGRATE": "false"},
			want: postgres.Flags{URL: "postgres://env/y", MaxConns: 3}},
		{name: "no URL: no default to fall back on", wantErr: "--database-url is required"},
		{name: "no connections", args: []string{"--database-url=postgres://db/x", "--database-max-conns=0"}, wantErr: "--database-max-conns must be at least 1"},
		{name: "not a URL", args: []string{"--database-url=postgres://u:s3cret@db:notaport/x"}, wantErr: "--database-url: not a valid PostgreSQL URL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := parseFlags(t, tc.args, tc.env)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one with %q", err, tc.wantErr)
				}
				if strings.Contains(err.Error(), "s3cret") {
					t.Fatalf("the error shows the password: %v", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got != tc.want {
				t.Fatalf("flags %+v, want %+v", got, tc.want)
			}
		})
	}
}

var testMigrations = fstest.MapFS{"00001_t.sql": {Data: []byte("-- +goose Up\nCREATE TABLE flagstest.t (id int);\n-- +goose Down\nDROP TABLE flagstest.t;\n")}}

func migrateTest(ctx context.Context, dsn string, log *slog.Logger) error {
	return postgres.Migrate(ctx, dsn, "flagstest", testMigrations, log)
}

// Open migrates only with --migrate, and caps the pool at
// --database-max-conns.
func TestFlagsOpen(t *testing.T) {
	ctx := context.Background()
	for _, migrate := range []bool{false, true} {
		dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "empty", Fingerprint: "0",
			Migrate: func(context.Context, string) error { return nil }})
		f := postgres.Flags{URL: dsn, MaxConns: 3, Migrate: migrate}
		pool, err := f.Open(ctx, migrateTest, slog.New(slog.DiscardHandler))
		if err != nil {
			t.Fatal(err)
		}
		if got := pool.Config().MaxConns; got != 3 {
			t.Errorf("MaxConns %d, want 3", got)
		}
		var exists bool
		if err := pool.QueryRow(ctx, `SELECT to_regclass('flagstest.t') IS NOT NULL`).Scan(&exists); err != nil {
			t.Fatal(err)
		}
		if exists != migrate {
			t.Errorf("--migrate=%v: table exists %v", migrate, exists)
		}
		pool.Close()
	}
	// The migrate subcommand migrates whatever --migrate says.
	dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "empty", Fingerprint: "0",
		Migrate: func(context.Context, string) error { return nil }})
	f := postgres.Flags{URL: dsn, Migrate: false}
	if err := f.RunMigrations(ctx, migrateTest, nil); err != nil {
		t.Fatal(err)
	}
	pool, err := postgres.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var exists bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('flagstest.t') IS NOT NULL`).Scan(&exists); err != nil || !exists {
		t.Fatalf("RunMigrations: table exists %v (%v)", exists, err)
	}
	if err := (&postgres.Flags{}).RunMigrations(ctx, migrateTest, nil); err == nil || !strings.Contains(err.Error(), "--database-url is required") {
		t.Fatalf("RunMigrations without a URL: %v", err)
	}
}
