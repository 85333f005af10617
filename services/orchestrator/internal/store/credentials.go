package store

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/atrest"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
)

// sealedCredentials is the plaintext a proxy's credentials are sealed as.
type sealedCredentials struct {
	Username string `json:"u"`
	Password string `json:"p"`
}

// credentialsBinding binds sealed credentials to their proxy, apart from
// its cloud-init: neither opens in the other's column.
func credentialsBinding(uid string) string { return "credentials/" + uid }

// sealCredentials seals r's credentials with the active key: the sealed
// value, the key id (” without credentials) and their time.
func sealCredentials(keys *atrest.Keyring, r *lifecycle.Proxy) (sealed []byte, keyID string, at *time.Time, err error) {
	c := r.Credentials
	if c == nil {
		return nil, "", nil, nil
	}
	if keys == nil {
		return nil, "", nil, fmt.Errorf("storing the credentials of proxy %s: %w", r.String(), ErrNoKeyring)
	}
	plain, err := json.Marshal(sealedCredentials{Username: c.Username, Password: c.Password})
	if err != nil {
		return nil, "", nil, err
	}
	sealed, keyID, err = keys.Seal(plain, credentialsBinding(r.UID))
	if err != nil {
		return nil, "", nil, err
	}
	t := c.Time
	return sealed, keyID, &t, nil
}

// openCredentials opens the credentials of proxy r sealed with key keyID.
// Errors name the proxy and the key, never content.
func openCredentials(keys *atrest.Keyring, sealed []byte, keyID string, at *time.Time, r *lifecycle.Proxy) (*lifecycle.Credentials, error) {
	if keys == nil {
		return nil, fmt.Errorf("credentials of proxy %s are encrypted with key %q: %w", r.String(), keyID, ErrNoKeyring)
	}
	plain, err := keys.Open(sealed, keyID, credentialsBinding(r.UID))
	if err != nil {
		return nil, fmt.Errorf("credentials of proxy %s: %w", r.String(), err)
	}
	var c sealedCredentials
	if err := json.Unmarshal(plain, &c); err != nil {
		return nil, fmt.Errorf("credentials of proxy %s: not a value this version wrote", r.String())
	}
	out := &lifecycle.Credentials{Username: c.Username, Password: c.Password}
	if at != nil {
		out.Time = *at
	}
	return out, nil
}
