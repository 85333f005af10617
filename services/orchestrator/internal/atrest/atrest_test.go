package atrest_test

import (
	"bytes"
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
)

func key(b byte) string {
	return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{b}, atrest.KeySize))
}

func ring(t *testing.T, active string, keys map[string]string) *atrest.Keyring {
	t.Helper()
	var b strings.Builder
	b.WriteString("active: " + active + "\nkeys:\n")
	for id, k := range keys {
		b.WriteString("  " + id + ": " + k + "\n")
	}
	k, err := atrest.Parse([]byte(b.String()))
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func TestSealOpen(t *testing.T) {
	t.Parallel()
	k := ring(t, "k1", map[string]string{"k1": key(1)})
	plain := []byte("#cloud-config\npassword: s3cret\n")
	sealed, id, err := k.Seal(plain, "uid-1")
	if err != nil || id != "k1" {
		t.Fatalf("Seal: %q %v", id, err)
	}
	if bytes.Contains(sealed, []byte("s3cret")) {
		t.Fatal("the sealed value holds the plaintext")
	}
	again, _, _ := k.Seal(plain, "uid-1")
	if bytes.Equal(sealed, again) {
		t.Error("two seals of the same plaintext are equal: the nonce is not random")
	}
	got, err := k.Open(sealed, "k1", "uid-1")
	if err != nil || !bytes.Equal(got, plain) {
		t.Fatalf("Open = %q, %v", got, err)
	}
	// Bound to its record and key id: moved or relabelled, it does not open.
	for name, open := range map[string]func() ([]byte, error){
		"other record": func() ([]byte, error) { return k.Open(sealed, "k1", "uid-2") },
		"flipped bit":  func() ([]byte, error) { s := bytes.Clone(sealed); s[len(s)-1] ^= 1; return k.Open(s, "k1", "uid-1") },
		"truncated":    func() ([]byte, error) { return k.Open(sealed[:10], "k1", "uid-1") },
	} {
		if _, err := open(); err == nil {
			t.Errorf("%s: opened", name)
		} else if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("%s: error carries the plaintext: %v", name, err)
		}
	}
}

func TestRotation(t *testing.T) {
	t.Parallel()
	old := ring(t, "2026-06", map[string]string{"2026-06": key(1)})
	sealed, _, _ := old.Seal([]byte("x"), "u")
	both := ring(t, "2026-12", map[string]string{"2026-06": key(1), "2026-12": key(2)})
	if got, err := both.Open(sealed, "2026-06", "u"); err != nil || string(got) != "x" {
		t.Fatalf("an old key must still open: %q %v", got, err)
	}
	if _, id, _ := both.Seal([]byte("x"), "u"); id != "2026-12" {
		t.Errorf("sealed with %q, want the active key", id)
	}
	newOnly := ring(t, "2026-12", map[string]string{"2026-12": key(2)})
	if _, err := newOnly.Open(sealed, "2026-06", "u"); !errors.Is(err, atrest.ErrUnknownKey) || !strings.Contains(err.Error(), `"2026-06"`) {
		t.Errorf("retired key: %v, want ErrUnknownKey naming it", err)
	}
	wrong := ring(t, "2026-06", map[string]string{"2026-06": key(9)})
	if _, err := wrong.Open(sealed, "2026-06", "u"); err == nil || !strings.Contains(err.Error(), "does not decrypt") {
		t.Errorf("wrong key under the same id: %v", err)
	}
}

func TestParseErrorsNameTheProblemNotTheKey(t *testing.T) {
	t.Parallel()
	secretish := base64.StdEncoding.EncodeToString([]byte("sixteen byte key")) // 16 bytes: AES-128, refused
	for name, tc := range map[string]struct{ file, want string }{
		"not YAML":       {"::: " + secretish, "not a keyring"},
		"no keys":        {"active: a\n", "no keys"},
		"short key":      {"active: a\nkeys:\n  a: " + secretish + "\n", `key "a": must be the base64 of 32 random bytes`},
		"not base64":     {"active: a\nkeys:\n  a: '%%%" + secretish + "'\n", `key "a": must be the base64`},
		"active missing": {"active: b\nkeys:\n  a: " + key(1) + "\n", `active key "b" is not among the keys`},
		"bad id":         {"active: 'a b'\nkeys:\n  'a b': " + key(1) + "\n", `key id "a b"`},
		"unknown field":  {"active: a\nkeys:\n  a: " + key(1) + "\nextra: " + secretish + "\n", "not a keyring"},
	} {
		_, err := atrest.Parse([]byte(tc.file))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: err = %v, want %q", name, err, tc.want)
			continue
		}
		if strings.Contains(err.Error(), secretish) || strings.Contains(err.Error(), key(1)) {
			t.Errorf("%s: the error carries key material: %v", name, err)
		}
	}
}

func TestLoad(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "keys.yaml")
	if _, err := atrest.Load(path); err == nil || !strings.Contains(err.Error(), "cloud-init keyring") {
		t.Errorf("missing file: %v", err)
	}
	if err := os.WriteFile(path, []byte("active: a\nkeys:\n  a: "+key(1)+"\n  b: "+key(2)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	k, err := atrest.Load(path)
	if err != nil || k.Active() != "a" || strings.Join(k.IDs(), ",") != "a,b" || !k.Has("b") || k.Has("c") {
		t.Fatalf("Load = %v, %v", k, err)
	}
}
