package store_test

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// storedCredentials reads a proxy's credential columns as PostgreSQL
// holds them.
func storedCredentials(t *testing.T, st *store.Store, uid string) (sealed []byte, keyID string, stale bool) {
	t.Helper()
	if err := st.Pool().QueryRow(context.Background(),
		"SELECT credentials, credentials_key, credentials_stale FROM orchestrator.proxies WHERE uid = $1", uid).
		Scan(&sealed, &keyID, &stale); err != nil {
		t.Fatal(err)
	}
	return sealed, keyID, stale
}

func TestCredentialsAreEncryptedAtRest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	st := store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1})))
	r := insert(t, st, "p1")
	want := *r.Credentials
	if want.Password == "" {
		t.Fatal("a new managed proxy has no credentials")
	}

	sealed, keyID, _ := storedCredentials(t, st, r.UID)
	if keyID != "k1" || len(sealed) == 0 {
		t.Fatalf("credentials stored with key %q, %d sealed bytes", keyID, len(sealed))
	}
	var dump bytes.Buffer
	rows, err := p.Query(ctx, "SELECT t::text FROM orchestrator.proxies t UNION ALL SELECT c::text FROM orchestrator.changes c")
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		dump.WriteString(s)
	}
	rows.Close()
	if strings.Contains(dump.String(), want.Password) || strings.Contains(dump.String(), want.Username) {
		t.Error("the proxies or changes table holds the credentials in plaintext")
	}

	got, err := st.Get(ctx, "p1")
	if err != nil {
		t.Fatal(err)
	}
	if got.Credentials == nil || got.Credentials.Username != want.Username || got.Credentials.Password != want.Password ||
		!got.Credentials.Time.Equal(want.Time.Truncate(time.Microsecond)) {
		t.Errorf("read back %v, want the stored credentials", got.Credentials)
	}
	if got.Proto(true).GetStatus().GetCredentialsTime() == nil {
		t.Error("status.credentials_time unset for a proxy with credentials")
	}

	// Sealed for this proxy only: moved to another row, they do not open.
	other := insert(t, st, "p2")
	if _, err := p.Exec(ctx, "UPDATE orchestrator.proxies SET credentials = $1 WHERE uid = $2", sealed, other.UID); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get(ctx, "p2"); err == nil || !strings.Contains(err.Error(), "does not decrypt") {
		t.Errorf("credentials moved to another proxy: %v, want a decrypt error", err)
	} else if strings.Contains(err.Error(), want.Password) {
		t.Error("the error shows the credentials")
	}

	// Without a keyring they cannot be read, and a new proxy with
	// credentials cannot be stored.
	bare := store.New(p)
	if _, err := bare.Get(ctx, "p1"); err == nil || !strings.Contains(err.Error(), `"k1"`) {
		t.Errorf("read without a keyring: %v, want an error naming k1", err)
	}
	err = bare.Write(ctx, func(tx *store.Tx) error {
		tx.Insert(lifecycle.New("p3", nil, &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128}, false, tx.Now()))
		return nil
	})
	if err == nil || !strings.Contains(err.Error(), "no cloud-init keyring") {
		t.Errorf("storing credentials without a keyring: %v", err)
	}
	// A proxy whose spec says NONE needs no keyring.
	err = bare.Write(ctx, func(tx *store.Tx) error {
		tx.Insert(lifecycle.New("p4", nil, &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128,
			Credentials: proxyv1.CredentialsPolicy_CREDENTIALS_POLICY_NONE}, false, tx.Now()))
		return nil
	})
	if err != nil {
		t.Errorf("storing an open proxy without a keyring: %v", err)
	}
}

func TestCredentialsFollowKeyRotation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	old := store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1})))
	var r *lifecycle.Proxy
	err := old.Write(ctx, func(tx *store.Tx) error {
		r = lifecycle.New("p1", nil, &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3128}, false, tx.Now())
		tx.Insert(r)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	both := store.New(p, store.WithKeyring(keyring(t, "k2", map[string]byte{"k1": 1, "k2": 2})))
	if ids, err := both.CloudInitKeysInUse(ctx); err != nil || strings.Join(ids, ",") != "k1" {
		t.Errorf("keys in use = %v, %v; want the credentials' k1", ids, err)
	}
	if _, err := both.ReencryptCloudInit(ctx, 10); err != nil {
		t.Fatal(err)
	}
	if _, keyID, _ := storedCredentials(t, both, r.UID); keyID != "k2" {
		t.Errorf("after re-encryption the credentials are sealed with %q, want k2", keyID)
	}
	newOnly := store.New(p, store.WithKeyring(keyring(t, "k2", map[string]byte{"k2": 2})))
	got, err := newOnly.Get(ctx, "p1")
	if err != nil || got.Credentials == nil || got.Credentials.Password != r.Credentials.Password {
		t.Fatalf("read with the new key only: %v", err)
	}
}
