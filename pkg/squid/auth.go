package squid

import (
	"errors"
	"fmt"
	"strings"

	"golang.org/x/crypto/bcrypt"
)

// AuthACL is the acl that BasicAuth defines: a client that presented
// credentials the htpasswd file holds. A squid.conf allows its clients
// with "http_access allow <their network> " + AuthACL.
const AuthACL = "authenticated"

// Realm is the realm every proxy of this system names in its 407.
const Realm = "egress-proxies"

// BasicAuth is the part of a squid.conf that makes squid demand HTTP Basic
// Proxy-Authorization, checked by the basic_ncsa_auth helper at helper
// against the htpasswd file at htpasswd (lines "user:bcrypt-hash"), and
// defines AuthACL. The helper re-reads the file when it changes, and a
// verdict is cached for one minute, so new credentials in the file take
// over within a minute without a restart. It holds paths only, never a
// credential.
func BasicAuth(helper, htpasswd string) string {
	return fmt.Sprintf(`auth_param basic program %s %s
auth_param basic realm %s
auth_param basic children 2 startup=1 idle=1
auth_param basic credentialsttl 1 minute
acl %s proxy_auth REQUIRED
`, helper, htpasswd, Realm, AuthACL)
}

// HTPasswd is the htpasswd file that lets user in with password: one line
// "user:bcrypt-hash" (bcrypt's default cost), which basic_ncsa_auth checks
// through crypt(3). It never holds the password itself. Errors never show
// the password.
func HTPasswd(user, password string) ([]byte, error) {
	if user == "" || strings.ContainsAny(user, ":\n\r") {
		return nil, errors.New("the proxy's user name is empty or holds ':' or a line break, which an htpasswd line cannot")
	}
	hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.DefaultCost)
	if err != nil {
		return nil, errors.New("hashing the proxy's password failed (bcrypt takes at most 72 bytes)")
	}
	return []byte(user + ":" + string(hash) + "\n"), nil
}

// HTPasswdAdmits reports whether the htpasswd file content admits user
// with password, as basic_ncsa_auth would.
func HTPasswdAdmits(content []byte, user, password string) bool {
	for line := range strings.SplitSeq(string(content), "\n") {
		u, hash, ok := strings.Cut(strings.TrimRight(line, "\r"), ":")
		if ok && u == user && bcrypt.CompareHashAndPassword([]byte(hash), []byte(password)) == nil {
			return true
		}
	}
	return false
}
