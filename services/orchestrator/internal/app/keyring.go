package app

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/egress-proxies/egress-proxies/pkg/reload"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// reencryptBatch is how many rows one re-encryption transaction rewrites.
const reencryptBatch = 100

// watchKeyring re-reads the cloud-init keyring file when it changes
// (looking every reload.Every), so keys rotate without a restart, as the
// token file's tokens do. A new version is taken only if it parses and
// holds every key that sealed stored cloud-init; otherwise the keyring in
// use stays, with a WARNING naming the key ids (never key material), and
// the file is tried again. When the active key changed, what is stored
// under other keys is re-encrypted with it, as at start.
func watchKeyring(ctx context.Context, keys *reload.File[*atrest.Keyring], st *store.Store, log *slog.Logger) error {
	keys.Accept = func(k *atrest.Keyring) error {
		inUse, err := st.CloudInitKeysInUse(ctx)
		if err != nil {
			return err
		}
		if err := store.KeysCover(k, inUse); err != nil {
			return fmt.Errorf("stored cloud-init is encrypted with %w", err)
		}
		return nil
	}
	sealedWith := keys.Value().Active() // what the start's re-encryption sealed with
	t := time.NewTicker(reload.Every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if keys.Refresh() {
			k := keys.Value()
			log.Info("the cloud-init keyring changed; its new version is in use", "activeKey", k.Active(), "keys", k.IDs())
		}
		active := keys.Value().Active()
		if active == sealedWith {
			continue
		}
		// Retried at the next look when it fails (the database is away).
		n, err := st.ReencryptCloudInit(ctx, reencryptBatch)
		if err != nil {
			if ctx.Err() == nil {
				log.Warn("WARNING: re-encrypting stored cloud-init with the new active key failed; trying again", "activeKey", active, "error", err)
			}
			continue
		}
		sealedWith = active
		log.Info("re-encrypted stored cloud-init with the active key", "proxies", n, "activeKey", active)
	}
}
