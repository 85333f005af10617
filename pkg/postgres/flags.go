package postgres

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"

	"github.com/jackc/pgx/v5/pgxpool"
)

// DefaultMaxConns is the default of --database-max-conns: enough for a
// lease replica's commit rounds and an orchestrator's claim, result and
// API work at once, far below PostgreSQL's default 100 connections for a
// few replicas of every service.
const DefaultMaxConns = 16

// Flags are the PostgreSQL flags of every service that has a database
// (each also EGRESS_<NAME>): one place, so every binary spells, defaults
// and checks them the same way.
type Flags struct {
	// URL is the database (postgres://user@host:5432/db). It has no
	// default: a service pointed at a database by accident would create
	// its schema there.
	URL string
	// MaxConns is the most connections one replica opens.
	MaxConns int
	// Migrate applies the service's migrations at start; off where they
	// run elsewhere first (the chart's migration Job runs `<service>
	// migrate`).
	Migrate bool
}

// DefaultFlags are the flags' defaults.
func DefaultFlags() Flags { return Flags{MaxConns: DefaultMaxConns, Migrate: true} }

// Register adds --database-url, --database-max-conns and --migrate to fs,
// with f's current values as defaults (DefaultFlags when f is zero).
func (f *Flags) Register(fs *flag.FlagSet) {
	if *f == (Flags{}) {
		*f = DefaultFlags()
	}
	fs.StringVar(&f.URL, "database-url", f.URL, "PostgreSQL URL (postgres://user@host:5432/db); required")
	fs.IntVar(&f.MaxConns, "database-max-conns", f.MaxConns, "most connections this replica opens to PostgreSQL")
	fs.BoolVar(&f.Migrate, "migrate", f.Migrate, "apply the database migrations at start (off: run the `migrate` subcommand first)")
}

// Validate checks the flags, naming the one that is wrong.
func (f *Flags) Validate() error {
	switch {
	case f.URL == "":
		return errors.New("--database-url is required")
	case f.MaxConns < 1:
		return errors.New("--database-max-conns must be at least 1")
	}
	if _, err := f.config(); err != nil {
		return err
	}
	return nil
}

// Migrator applies one service's migrations to the database at dsn.
type Migrator func(ctx context.Context, dsn string, log *slog.Logger) error

// RunMigrations applies the migrations whatever --migrate says: the
// `migrate` subcommand.
func (f *Flags) RunMigrations(ctx context.Context, migrate Migrator, log *slog.Logger) error {
	if f.URL == "" {
		return errors.New("--database-url is required")
	}
	return migrate(ctx, f.URL, log)
}

// Open is how a service opens its database: it applies the migrations when
// --migrate is on, then opens a pool of at most --database-max-conns
// connections and checks that the server answers.
func (f *Flags) Open(ctx context.Context, migrate Migrator, log *slog.Logger) (*pgxpool.Pool, error) {
	if err := f.Validate(); err != nil {
		return nil, err
	}
	if f.Migrate {
		if err := migrate(ctx, f.URL, log); err != nil {
			return nil, err
		}
	}
	cfg, err := f.config()
	if err != nil {
		return nil, err
	}
	return open(ctx, cfg)
}

func (f *Flags) config() (*pgxpool.Config, error) {
	cfg, err := pgxpool.ParseConfig(f.URL)
	if err != nil {
		// pgx's message quotes the URL with the password redacted only
		// on a best-effort basis: say which flag, never what it holds.
		return nil, errors.New("--database-url: not a valid PostgreSQL URL (want postgres://user@host:5432/db)")
	}
	if f.MaxConns > 0 {
		cfg.MaxConns = int32(min(f.MaxConns, 1<<20))
	}
	return cfg, nil
}

func open(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("connecting to PostgreSQL at %s: %w", cfg.ConnConfig.Host, err)
	}
	return pool, nil
}
