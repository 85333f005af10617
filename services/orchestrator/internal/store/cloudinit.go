package store

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
)

// CloudInitKeysInUse lists the ids of the keys that sealed stored
// cloud-init.
func (s *Store) CloudInitKeysInUse(ctx context.Context) ([]string, error) {
	rows, err := s.pool.Query(ctx, `SELECT cloud_init_key FROM orchestrator.proxies
		WHERE cloud_init_key IS NOT NULL AND cloud_init_key <> ''
		UNION SELECT credentials_key FROM orchestrator.proxies WHERE credentials_key <> ''
		UNION SELECT cloud_init_key FROM orchestrator.pools WHERE cloud_init_key <> '' ORDER BY 1`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// CheckCloudInitKeys fails when stored cloud-init was sealed with a key the
// keyring does not hold (or there is no keyring), or when rows from before
// encryption at rest still hold plaintext cloud-init and there is no
// keyring to encrypt them: the orchestrator must not start then. The error
// names the keys, never content.
func (s *Store) CheckCloudInitKeys(ctx context.Context) error {
	ids, err := s.CloudInitKeysInUse(ctx)
	if err != nil {
		return fmt.Errorf("reading cloud-init key ids: %w", err)
	}
	keys := s.keyring()
	if err := KeysCover(keys, ids); err != nil {
		return fmt.Errorf("stored cloud-init is encrypted with %w: add them to --cloud-init-key-file", err)
	}
	if keys != nil {
		return nil
	}
	n, err := s.legacyCloudInitRows(ctx)
	if err != nil {
		return err
	}
	if n > 0 {
		return fmt.Errorf("%d proxies hold cloud-init stored in plaintext before encryption at rest: start with --cloud-init-key-file to encrypt them", n)
	}
	return nil
}

// KeysCover fails when keys (nil: no keyring) lacks any of the key ids
// inUse, naming the missing ids and the ids held.
func KeysCover(keys *atrest.Keyring, inUse []string) error {
	var missing []string
	for _, id := range inUse {
		if keys == nil || !keys.Has(id) {
			missing = append(missing, id)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	held := []string{}
	if keys != nil {
		held = keys.IDs()
	}
	return fmt.Errorf("keys %v that the keyring does not hold (it holds %v)", missing, held)
}

// legacyCloudInitRows counts rows from before encryption at rest whose spec
// carries cloud-init.
func (s *Store) legacyCloudInitRows(ctx context.Context) (int, error) {
	rows, err := s.pool.Query(ctx, "SELECT "+columns+" FROM orchestrator.proxies WHERE cloud_init_key IS NULL")
	if err != nil {
		return 0, err
	}
	list, err := scanRows(nil, rows)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range list {
		if r.Spec.GetCloudInit() != "" {
			n++
		}
	}
	return n, nil
}

// ReencryptCloudInit seals, with the active key, every stored cloud-init
// that is not sealed with it: plaintext from before encryption at rest and
// values sealed with older keys. It works in batches of batchSize rows,
// skipping rows another transaction holds (they are sealed with the active
// key when that transaction writes them), and returns how many rows it
// rewrote. The rows' revisions do not change: their content did not.
func (s *Store) ReencryptCloudInit(ctx context.Context, batchSize int) (int, error) {
	total := 0
	for {
		keys := s.keyring()
		if keys == nil {
			return total, ErrNoKeyring
		}
		n := 0
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, "SELECT "+columns+` FROM orchestrator.proxies
				WHERE cloud_init_key IS NULL OR (cloud_init_key <> '' AND cloud_init_key <> $1)
				   OR (credentials_key <> '' AND credentials_key <> $1)
				ORDER BY uid LIMIT $2 FOR UPDATE SKIP LOCKED`, keys.Active(), batchSize)
			if err != nil {
				return err
			}
			list, err := scanRows(keys, rows)
			if err != nil {
				return err
			}
			batch := &pgx.Batch{}
			for _, r := range list {
				spec, sealed, keyID, err := sealCloudInit(keys, r)
				if err != nil {
					return err
				}
				credSealed, credKey, _, err := sealCredentials(keys, r)
				if err != nil {
					return err
				}
				batch.Queue(`UPDATE orchestrator.proxies SET spec = $2, cloud_init = $3, cloud_init_key = $4,
					credentials = $5, credentials_key = $6 WHERE uid = $1`,
					r.UID, spec, sealed, keyID, credSealed, credKey)
			}
			n = len(list)
			return tx.SendBatch(ctx, batch).Close()
		})
		if err != nil {
			return total, fmt.Errorf("re-encrypting cloud-init: %w", err)
		}
		total += n
		if n < batchSize {
			pools, err := s.reencryptPools(ctx, keys)
			return total + pools, err
		}
	}
}

// reencryptPools seals with the active key the template cloud-init of
// every pool sealed with another, keeping its revision (nothing a client
// sees changes).
func (s *Store) reencryptPools(ctx context.Context, keys *atrest.Keyring) (int, error) {
	n := 0
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, "SELECT "+poolSelect+` FROM orchestrator.pools
			WHERE cloud_init_key <> '' AND cloud_init_key <> $1 FOR UPDATE`, keys.Active())
		if err != nil {
			return err
		}
		list, err := scanPools(keys, rows)
		if err != nil {
			return err
		}
		for _, p := range list {
			sealed, keyID, err := keys.Seal([]byte(p.Spec.GetTemplate().GetSpec().GetCloudInit()), p.UID)
			if err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, "UPDATE orchestrator.pools SET cloud_init = $2, cloud_init_key = $3 WHERE uid = $1", p.UID, sealed, keyID); err != nil {
				return err
			}
		}
		n = len(list)
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("re-encrypting the cloud-init of pool templates: %w", err)
	}
	return n, nil
}
