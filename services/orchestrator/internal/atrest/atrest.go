// Package atrest encrypts the secrets the orchestrator keeps in PostgreSQL
// (a proxy's cloud-init) with AES-256-GCM under keys from a keyring file.
// Each ciphertext is stored with the id of the key that sealed it, so keys
// rotate: the keyring holds several keys, one active; the active key seals,
// every key in the ring opens. Errors name keys and proxies, never content.
package atrest

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"

	"go.yaml.in/yaml/v3"
)

// KeySize is the size of a key: AES-256.
const KeySize = 32

// version is the first byte of every sealed value, so the format can change.
const version byte = 1

var keyIDRE = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// ErrUnknownKey is returned by Open for a value sealed with a key the ring
// does not hold.
var ErrUnknownKey = errors.New("key is not in the keyring")

// Keyring holds the keys; safe for concurrent use (it never changes).
type Keyring struct {
	active string
	aeads  map[string]cipher.AEAD
}

// file is the keyring file:
//
//	active: 2026-12
//	keys:
//	  2026-12: <base64 of 32 random bytes>
//	  2026-06: <base64 of 32 random bytes>
type file struct {
	Active string            `yaml:"active"`
	Keys   map[string]string `yaml:"keys"`
}

// Load reads a keyring file. The error names the file and what is wrong
// with it, never key material.
func Load(path string) (*Keyring, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("cloud-init keyring: %w", err)
	}
	k, err := Parse(raw)
	if err != nil {
		return nil, fmt.Errorf("cloud-init keyring %s: %w", path, err)
	}
	return k, nil
}

// Parse parses keyring file content.
func Parse(raw []byte) (*Keyring, error) {
	var f file
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	dec.KnownFields(true)
	if err := dec.Decode(&f); err != nil {
		// yaml errors quote the offending line, which may hold a key.
		return nil, errors.New("not a keyring: want YAML with 'active: <id>' and 'keys: {<id>: <base64 of 32 bytes>}'")
	}
	if len(f.Keys) == 0 {
		return nil, errors.New("no keys")
	}
	k := &Keyring{active: f.Active, aeads: map[string]cipher.AEAD{}}
	for id, b64 := range f.Keys {
		if !keyIDRE.MatchString(id) {
			return nil, fmt.Errorf("key id %q: use 1 to 64 letters, digits, '.', '_' or '-'", id)
		}
		key, err := base64.StdEncoding.DecodeString(b64)
		if err != nil || len(key) != KeySize {
			return nil, fmt.Errorf("key %q: must be the base64 of %d random bytes (head -c %d /dev/urandom | base64)", id, KeySize, KeySize)
		}
		block, err := aes.NewCipher(key)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", id, err)
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, fmt.Errorf("key %q: %w", id, err)
		}
		k.aeads[id] = aead
	}
	if _, ok := k.aeads[f.Active]; !ok {
		return nil, fmt.Errorf("active key %q is not among the keys (%v)", f.Active, k.IDs())
	}
	return k, nil
}

// Active is the id of the key that seals.
func (k *Keyring) Active() string { return k.active }

// Has reports whether the ring holds key id.
func (k *Keyring) Has(id string) bool {
	_, ok := k.aeads[id]
	return ok
}

// IDs lists the key ids, sorted.
func (k *Keyring) IDs() []string {
	ids := make([]string, 0, len(k.aeads))
	for id := range k.aeads {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// additional binds a ciphertext to the record it belongs to and the key id
// stored beside it: moved to another row or relabelled, it no longer opens.
func additional(keyID, bindTo string) []byte {
	return []byte("egress-proxies/atrest/v1\x00" + keyID + "\x00" + bindTo)
}

// Seal encrypts plaintext with the active key for the record bindTo (a
// proxy UID) and returns the sealed value and the key id to store with it.
func (k *Keyring) Seal(plaintext []byte, bindTo string) (sealed []byte, keyID string, err error) {
	aead := k.aeads[k.active]
	nonce := make([]byte, aead.NonceSize())
	if _, err := rand.Read(nonce); err != nil {
		return nil, "", fmt.Errorf("cloud-init encryption: %w", err)
	}
	out := make([]byte, 0, 1+len(nonce)+len(plaintext)+aead.Overhead())
	out = append(out, version)
	out = append(out, nonce...)
	out = aead.Seal(out, nonce, plaintext, additional(k.active, bindTo))
	return out, k.active, nil
}

// Open decrypts a value Seal made with key keyID for bindTo.
func (k *Keyring) Open(sealed []byte, keyID, bindTo string) ([]byte, error) {
	aead, ok := k.aeads[keyID]
	if !ok {
		return nil, fmt.Errorf("key %q: %w (keys held: %v)", keyID, ErrUnknownKey, k.IDs())
	}
	ns := aead.NonceSize()
	if len(sealed) < 1+ns+aead.Overhead() || sealed[0] != version {
		return nil, fmt.Errorf("sealed with key %q: not a value this version wrote", keyID)
	}
	plain, err := aead.Open(nil, sealed[1:1+ns], sealed[1+ns:], additional(keyID, bindTo))
	if err != nil {
		return nil, fmt.Errorf("sealed with key %q: does not decrypt (a different key under the same id, or altered data)", keyID)
	}
	return plain, nil
}
