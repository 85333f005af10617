package store_test

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/pkg/reload"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/orchtest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// secret is the cloud-init every test stores: a marker that must never
// appear in a column, an error or a change snapshot.
const secret = "#cloud-config\nchpasswd: {list: 'root:marker-7f3a9c-secret'}\n"

func keyring(t *testing.T, active string, keys map[string]byte) *atrest.Keyring {
	t.Helper()
	var b strings.Builder
	b.WriteString("active: " + active + "\nkeys:\n")
	for id, k := range keys {
		b.WriteString("  " + id + ": " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{k}, atrest.KeySize)) + "\n")
	}
	k, err := atrest.Parse([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func pool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	p, err := postgres.Connect(context.Background(), orchtest.Database(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	return p
}

// insert stores a new MANAGED proxy carrying secret.
func insert(t *testing.T, st *store.Store, name string) *lifecycle.Proxy {
	t.Helper()
	var r *lifecycle.Proxy
	err := st.Write(context.Background(), func(tx *store.Tx) error {
		r = lifecycle.New(name, nil, &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", CloudInit: secret, Port: 3128}, false, tx.Now())
		tx.Insert(r)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// stored reads a proxy's columns as PostgreSQL holds them.
func stored(t *testing.T, p *pgxpool.Pool, uid string) (spec, sealed []byte, keyID *string) {
	t.Helper()
	if err := p.QueryRow(context.Background(), "SELECT spec, cloud_init, cloud_init_key FROM orchestrator.proxies WHERE uid = $1", uid).
		Scan(&spec, &sealed, &keyID); err != nil {
		t.Fatal(err)
	}
	return spec, sealed, keyID
}

// noSecret fails when b holds the marker of secret, raw or hex-encoded (as
// PostgreSQL prints bytea).
func noSecret(t *testing.T, what string, b []byte) {
	t.Helper()
	if bytes.Contains(b, []byte("marker-7f3a9c")) || bytes.Contains(b, []byte(hex.EncodeToString([]byte("marker-7f3a9c")))) {
		t.Errorf("%s holds the cloud-init in plaintext", what)
	}
}

func TestCloudInitIsEncryptedAtRest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	st := store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1})))
	r := insert(t, st, "p1")

	spec, sealed, keyID := stored(t, p, r.UID)
	noSecret(t, "column spec", spec)
	noSecret(t, "column cloud_init", sealed)
	if keyID == nil || *keyID != "k1" || len(sealed) == 0 {
		t.Fatalf("cloud_init_key = %v, %d sealed bytes; want k1", keyID, len(sealed))
	}
	// The whole table and the change log, as text.
	var dump string
	if err := p.QueryRow(ctx, `SELECT string_agg(t::text, ' ') FROM (
		SELECT p::text AS t FROM orchestrator.proxies p UNION ALL SELECT c::text FROM orchestrator.changes c) x`).Scan(&dump); err != nil {
		t.Fatal(err)
	}
	noSecret(t, "the proxies and changes tables", []byte(dump))
	if !strings.Contains(dump, "\\x") {
		t.Fatalf("the dump holds no bytea at all; the query is broken: %.200s", dump)
	}

	got, err := st.Get(ctx, "p1")
	if err != nil || got.Spec.GetCloudInit() != secret {
		t.Fatalf("Get: cloud-init %q, %v", got.Spec.GetCloudInit(), err)
	}
	// Moved to another row, the ciphertext does not open.
	other := insert(t, st, "p2")
	if _, err := p.Exec(ctx, "UPDATE orchestrator.proxies SET cloud_init = $1 WHERE uid = $2", sealed, other.UID); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get(ctx, "p2"); err == nil || !strings.Contains(err.Error(), "does not decrypt") {
		t.Errorf("a ciphertext copied to another proxy: %v, want does not decrypt", err)
	}
}

func TestCloudInitKeyRotation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	old := store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1})))
	a, b := insert(t, old, "a"), insert(t, old, "b")
	revBefore, err := old.Revision(ctx)
	if err != nil {
		t.Fatal(err)
	}

	// Step 1: the new key is added and made active; the old one stays.
	both := store.New(p, store.WithKeyring(keyring(t, "k2", map[string]byte{"k1": 1, "k2": 2})))
	if err := both.CheckCloudInitKeys(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := both.Get(ctx, "a"); err != nil || got.Spec.GetCloudInit() != secret {
		t.Fatalf("old key must still decrypt: %v", err)
	}
	// Step 2: re-encrypt.
	n, err := both.ReencryptCloudInit(ctx, 1) // batch of 1: the loop must go on
	if err != nil || n != 2 {
		t.Fatalf("ReencryptCloudInit = %d, %v; want 2", n, err)
	}
	for _, r := range []*lifecycle.Proxy{a, b} {
		_, sealed, keyID := stored(t, p, r.UID)
		noSecret(t, "cloud_init after re-encryption", sealed)
		if keyID == nil || *keyID != "k2" {
			t.Errorf("%s sealed with %v after re-encryption, want k2", r.Name, keyID)
		}
	}
	if n, err := both.ReencryptCloudInit(ctx, 10); err != nil || n != 0 {
		t.Errorf("second pass rewrote %d rows (%v); want 0", n, err)
	}
	if rev, _ := both.Revision(ctx); rev != revBefore {
		t.Errorf("re-encryption changed the revision %d -> %d: watchers would see a change that is none", revBefore, rev)
	}
	// Step 3: the old key is removed.
	newOnly := store.New(p, store.WithKeyring(keyring(t, "k2", map[string]byte{"k2": 2})))
	if err := newOnly.CheckCloudInitKeys(ctx); err != nil {
		t.Fatal(err)
	}
	if got, err := newOnly.Get(ctx, "b"); err != nil || got.Spec.GetCloudInit() != secret {
		t.Fatalf("after rotation: %v", err)
	}

	// An orchestrator started with only the retired key, or with none,
	// refuses to start; the error names keys, never content.
	for name, st := range map[string]*store.Store{
		"retired key only": store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1}))),
		"no keyring":       store.New(p),
	} {
		err := st.CheckCloudInitKeys(ctx)
		if err == nil || !strings.Contains(err.Error(), "[k2]") {
			t.Errorf("%s: CheckCloudInitKeys = %v, want an error naming k2", name, err)
		}
		_, err = st.Get(ctx, "a")
		if err == nil || !strings.Contains(err.Error(), `"k2"`) {
			t.Errorf("%s: Get = %v, want an error naming k2", name, err)
		} else {
			noSecret(t, name+" error", []byte(err.Error()))
		}
	}
	// A different key under the same id: a clear error, no content.
	wrong := store.New(p, store.WithKeyring(keyring(t, "k2", map[string]byte{"k2": 7})))
	if _, err := wrong.Get(ctx, "a"); err == nil || !strings.Contains(err.Error(), "does not decrypt") {
		t.Errorf("wrong key: %v", err)
	}
}

func TestPlaintextFromBeforeEncryptionIsEncrypted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	st := store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1})))
	r := insert(t, st, "legacy")
	plain := insert(t, st, "no-cloud-init")
	// Make them rows as written before migration 00005: cloud-init inside
	// spec, the new columns NULL, and no credentials (00009).
	full, _ := proto.Marshal(r.Spec)
	bare, _ := proto.Marshal(&proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve"})
	for uid, spec := range map[string][]byte{r.UID: full, plain.UID: bare} {
		if _, err := p.Exec(ctx, "UPDATE orchestrator.proxies SET spec = $1, cloud_init = NULL, cloud_init_key = NULL, credentials = NULL, credentials_key = '' WHERE uid = $2", spec, uid); err != nil {
			t.Fatal(err)
		}
	}

	// Without a keyring the orchestrator must not start.
	if err := store.New(p).CheckCloudInitKeys(ctx); err == nil || !strings.Contains(err.Error(), "1 proxies hold cloud-init stored in plaintext") {
		t.Errorf("no keyring with plaintext rows: %v", err)
	}
	// Legacy rows read as before.
	if got, err := st.Get(ctx, "legacy"); err != nil || got.Spec.GetCloudInit() != secret {
		t.Fatalf("legacy read: %v", err)
	}
	n, err := st.ReencryptCloudInit(ctx, 100)
	if err != nil || n != 2 {
		t.Fatalf("ReencryptCloudInit = %d, %v; want 2", n, err)
	}
	spec, sealed, keyID := stored(t, p, r.UID)
	noSecret(t, "spec after encryption", spec)
	if keyID == nil || *keyID != "k1" || len(sealed) == 0 {
		t.Errorf("legacy row: key %v, %d sealed bytes", keyID, len(sealed))
	}
	if _, _, keyID := stored(t, p, plain.UID); keyID == nil || *keyID != "" {
		t.Errorf("row without cloud-init: key %v, want ''", keyID)
	}
	if got, err := st.Get(ctx, "legacy"); err != nil || got.Spec.GetCloudInit() != secret {
		t.Fatalf("after encryption: %v", err)
	}
	if err := store.New(p).CheckCloudInitKeys(ctx); err == nil {
		t.Error("no keyring after encryption: want an error naming k1")
	}
}

func TestNoKeyringRefusesCloudInit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	st := store.New(pool(t))
	r := &lifecycle.Proxy{UID: uuid.NewString(), Name: "p", Generation: 1,
		Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", CloudInit: secret}}
	err := st.Write(ctx, func(tx *store.Tx) error {
		r.CreateTime = tx.Now()
		tx.Insert(r)
		return nil
	})
	if !errors.Is(err, store.ErrNoKeyring) {
		t.Fatalf("Write = %v, want ErrNoKeyring", err)
	}
	noSecret(t, "the error", []byte(err.Error()))
	if _, err := st.Get(ctx, "p"); !errors.Is(err, store.ErrNotFound) {
		t.Errorf("half-applied: %v", err)
	}
	// Without cloud-init the store works without a keyring.
	r.Spec.CloudInit = ""
	if err := st.Write(ctx, func(tx *store.Tx) error { tx.Insert(r); return nil }); err != nil {
		t.Fatal(err)
	}
	if err := st.CheckCloudInitKeys(ctx); err != nil {
		t.Errorf("CheckCloudInitKeys without cloud-init: %v", err)
	}
}

// A store reading its keyring from a reloaded file (WithKeyringFrom) uses
// a new version at once: the next write seals with the new active key, and
// what the old one sealed still decrypts, untouched until re-encrypted.
func TestKeyringReloadedWhileRunning(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	path := filepath.Join(t.TempDir(), "keys.yaml")
	write := func(active string, keys map[string]byte) {
		t.Helper()
		var b strings.Builder
		b.WriteString("active: " + active + "\nkeys:\n")
		for id, k := range keys {
			b.WriteString("  " + id + ": " + base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{k}, atrest.KeySize)) + "\n")
		}
		if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("k1", map[string]byte{"k1": 1})
	file, err := reload.Open(path, "the cloud-init keyring", atrest.Parse, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	st := store.New(p, store.WithKeyringFrom(file.Value))
	a := insert(t, st, "a")

	write("k2", map[string]byte{"k1": 1, "k2": 2})
	if !file.Refresh() {
		t.Fatal("the rewritten keyring was not taken")
	}
	b := insert(t, st, "b")
	for r, want := range map[*lifecycle.Proxy]string{a: "k1", b: "k2"} {
		if _, _, keyID := stored(t, p, r.UID); keyID == nil || *keyID != want {
			t.Errorf("%s sealed with %v, want %s", r.Name, keyID, want)
		}
		if got, err := st.Get(ctx, r.Name); err != nil || got.Spec.GetCloudInit() != secret {
			t.Errorf("%s does not read back: %v", r.Name, err)
		}
	}
}

// A pool template's cloud-init is sealed like a proxy's: never in the
// spec column, readable with the key, re-encrypted with a new active key,
// and its key counts for CheckCloudInitKeys.
func TestPoolTemplateCloudInitAtRest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	p := pool(t)
	old := store.New(p, store.WithKeyring(keyring(t, "k1", map[string]byte{"k1": 1})))
	row := &store.PoolRow{UID: "5a5a5a5a-0000-4000-8000-000000000001", Name: "web", Generation: 1, CreateTime: time.Now(),
		Spec: &proxyv1.ProxyPoolSpec{Template: &proxyv1.ProxyTemplate{Spec: &proxyv1.ProxySpec{
			Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "fake", CloudInit: secret}}}}
	if err := old.Write(ctx, func(tx *store.Tx) error { return tx.WritePool(ctx, row, proxyv1.ChangeType_CHANGE_TYPE_CREATED) }); err != nil {
		t.Fatal(err)
	}
	var spec, sealed []byte
	var keyID string
	read := func() {
		if err := p.QueryRow(ctx, "SELECT spec, cloud_init, cloud_init_key FROM orchestrator.pools WHERE uid = $1", row.UID).Scan(&spec, &sealed, &keyID); err != nil {
			t.Fatal(err)
		}
	}
	read()
	noSecret(t, "pool spec", spec)
	noSecret(t, "pool cloud_init", sealed)
	var snap []byte
	if err := p.QueryRow(ctx, "SELECT snapshot FROM orchestrator.pool_changes").Scan(&snap); err != nil {
		t.Fatal(err)
	}
	noSecret(t, "pool change log", snap)
	if got, err := old.GetPool(ctx, "web"); err != nil || got.Spec.GetTemplate().GetSpec().GetCloudInit() != secret || keyID != "k1" {
		t.Fatalf("GetPool: %v (key %q)", err, keyID)
	}
	newOnlyKeys := keyring(t, "k2", map[string]byte{"k2": 2})
	if err := store.New(p, store.WithKeyring(newOnlyKeys)).CheckCloudInitKeys(ctx); err == nil || !strings.Contains(err.Error(), "[k1]") {
		t.Fatalf("a keyring without the pool's key passes the check: %v", err)
	}
	both := store.New(p, store.WithKeyring(keyring(t, "k2", map[string]byte{"k1": 1, "k2": 2})))
	if n, err := both.ReencryptCloudInit(ctx, 10); err != nil || n != 1 {
		t.Fatalf("ReencryptCloudInit = %d, %v; want the pool", n, err)
	}
	read()
	noSecret(t, "pool cloud_init after re-encryption", sealed)
	if keyID != "k2" {
		t.Fatalf("pool sealed with %q after re-encryption, want k2", keyID)
	}
	if got, err := store.New(p, store.WithKeyring(newOnlyKeys)).GetPool(ctx, "web"); err != nil || got.Spec.GetTemplate().GetSpec().GetCloudInit() != secret {
		t.Fatalf("after rotation: %v", err)
	}
}
