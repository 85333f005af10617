package web

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"time"
)

// session is what the console keeps of a signed-in user, sealed into the
// session cookie: the token it calls the APIs with, who the token is, and
// the secret that every action must echo (CSRF). The cookie is httpOnly
// and encrypted, so neither page scripts nor anyone holding the cookie
// jar's file without the key can read the token; nothing is kept on the
// server, so any replica serves any user.
type session struct {
	Token    string   `json:"t"`
	ClientID string   `json:"c"`
	Roles    []string `json:"r"`
	CSRF     string   `json:"x"`
	Expires  int64    `json:"e"`
}

func (s *session) has(role string) bool {
	for _, r := range s.Roles {
		if r == role {
			return true
		}
	}
	return false
}

// sealer seals sessions with AES-256-GCM under the first key and opens
// them under any key, so keys rotate: add the new key first, wait for the
// sessions under the old one to end (the session lifetime), remove it.
type sealer struct {
	aeads []cipher.AEAD
}

func newSealer(keys [][]byte) (*sealer, error) {
	if len(keys) == 0 {
		return nil, errors.New("no session key")
	}
	s := &sealer{}
	for i, k := range keys {
		if len(k) != 32 {
			return nil, fmt.Errorf("session key %d: %d bytes, want 32", i+1, len(k))
		}
		block, err := aes.NewCipher(k)
		if err != nil {
			return nil, err
		}
		aead, err := cipher.NewGCM(block)
		if err != nil {
			return nil, err
		}
		s.aeads = append(s.aeads, aead)
	}
	return s, nil
}

// ReadSessionKeys reads a session key file: one base64 key of 32 bytes a
// line (`head -c 32 /dev/urandom | base64`), the first sealing, all
// opening; blank lines and # comments are ignored. Errors name the line,
// never a key.
func ReadSessionKeys(path string) ([][]byte, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("session key file: %w", err)
	}
	var keys [][]byte
	for n, line := range strings.Split(string(raw), "\n") {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, err := base64.StdEncoding.DecodeString(line)
		if err != nil || len(k) != 32 {
			return nil, fmt.Errorf("session key file %s, line %d: want the base64 of 32 random bytes", path, n+1)
		}
		keys = append(keys, k)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("session key file %s: no key", path)
	}
	return keys, nil
}

// RandomSessionKey is a key for a replica without a key file.
func RandomSessionKey() []byte {
	k := make([]byte, 32)
	_, _ = rand.Read(k)
	return k
}

func (s *sealer) seal(name string, sess *session) (string, error) {
	plain, err := json.Marshal(sess)
	if err != nil {
		return "", err
	}
	aead := s.aeads[0]
	nonce := make([]byte, aead.NonceSize())
	_, _ = rand.Read(nonce)
	// The cookie's name is authenticated with it: a value moved to
	// another cookie does not open.
	return base64.RawURLEncoding.EncodeToString(aead.Seal(nonce, nonce, plain, []byte(name))), nil
}

func (s *sealer) open(name, value string, now time.Time) (*session, error) {
	raw, err := base64.RawURLEncoding.DecodeString(value)
	if err != nil {
		return nil, errors.New("the session cookie is not ours")
	}
	for _, aead := range s.aeads {
		if len(raw) < aead.NonceSize() {
			break
		}
		plain, err := aead.Open(nil, raw[:aead.NonceSize()], raw[aead.NonceSize():], []byte(name))
		if err != nil {
			continue
		}
		var sess session
		if err := json.Unmarshal(plain, &sess); err != nil {
			return nil, errors.New("the session cookie is not ours")
		}
		if now.Unix() >= sess.Expires {
			return nil, errors.New("the session has expired")
		}
		return &sess, nil
	}
	return nil, errors.New("the session cookie is not ours")
}

// cookies makes and reads the session cookie.
type cookies struct {
	sealer *sealer
	secure bool
	ttl    time.Duration
}

// name is the cookie's name: with Secure, the __Host- prefix makes the
// browser refuse it unless it is Secure, for the whole host, from this
// host.
func (c *cookies) name() string {
	if c.secure {
		return "__Host-egress-console"
	}
	return "egress-console"
}

func (c *cookies) set(w http.ResponseWriter, sess *session) error {
	v, err := c.sealer.seal(c.name(), sess)
	if err != nil {
		return err
	}
	http.SetCookie(w, &http.Cookie{
		Name: c.name(), Value: v, Path: "/", MaxAge: int(c.ttl.Seconds()),
		HttpOnly: true, Secure: c.secure, SameSite: http.SameSiteLaxMode,
	})
	return nil
}

func (c *cookies) clear(w http.ResponseWriter) {
	http.SetCookie(w, &http.Cookie{
		Name: c.name(), Value: "", Path: "/", MaxAge: -1,
		HttpOnly: true, Secure: c.secure, SameSite: http.SameSiteLaxMode,
	})
}

// get returns the request's session, or nil and why there is none.
func (c *cookies) get(r *http.Request, now time.Time) (*session, error) {
	ck, err := r.Cookie(c.name())
	if err != nil {
		return nil, errors.New("not signed in")
	}
	return c.sealer.open(c.name(), ck.Value, now)
}

func newCSRFSecret() string {
	b := make([]byte, 24)
	_, _ = rand.Read(b)
	return base64.RawURLEncoding.EncodeToString(b)
}
