// Package postgres is the suite's PostgreSQL plumbing: the database flags
// every service shares (Flags), pools, embedded migrations, advisory-lock
// singletons and their keys. Each service owns one schema and migrates
// only that.
package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx" for goose
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/database"
	"github.com/pressly/goose/v3/lock"
)

// Retryable reports a serialization failure or a deadlock: the transaction
// lost a race and running it again may succeed.
func Retryable(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

// MigrationsDir returns the "migrations" directory of an embedded tree, the
// place every service keeps its goose files.
func MigrationsDir(fsys fs.FS) fs.FS {
	sub, err := fs.Sub(fsys, "migrations")
	if err != nil {
		panic(err) // only for a malformed embed; fs.Sub accepts any valid name
	}
	return sub
}

// Connect opens a pool with pgx's defaults and checks that the server
// answers: for tests and tools; a service opens its database with
// Flags.Open.
func Connect(ctx context.Context, dsn string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	return open(ctx, cfg)
}

// Migrate applies the SQL migrations in fsys (goose format) to schema,
// creating the schema if needed and recording applied versions in
// <schema>.goose_db_version. A session advisory lock keyed on the schema
// lets replicas that start together apply each migration once.
func Migrate(ctx context.Context, dsn, schema string, fsys fs.FS, log *slog.Logger) error {
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		return err
	}
	defer db.Close()
	if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{schema}.Sanitize()); err != nil {
		return fmt.Errorf("creating schema %s: %w", schema, err)
	}
	locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(LockKey(schema, "migrate")))
	if err != nil {
		return err
	}
	store, err := database.NewStore(goose.DialectPostgres, schema+".goose_db_version")
	if err != nil {
		return err
	}
	p, err := goose.NewProvider("", db, fsys, goose.WithStore(store), goose.WithSessionLocker(locker))
	if err != nil {
		return fmt.Errorf("migrations of %s: %w", schema, err)
	}
	results, err := p.Up(ctx)
	if err != nil {
		return fmt.Errorf("migrating %s: %w", schema, err)
	}
	if log != nil {
		for _, r := range results {
			log.Info("migration applied", "schema", schema, "version", r.Source.Version, "file", r.Source.Path, "duration", r.Duration)
		}
	}
	return nil
}
