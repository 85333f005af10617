package auth

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The token file and the Authorization header are the inputs of this
// package: whatever they hold, parsing never panics, an accepted line
// yields a client with known roles, and no error repeats a token.
func FuzzParseTokens(f *testing.F) {
	f.Add("ops s3cret admin\n")
	f.Add("# c\n\na s3cret crawler,viewer\nb other service\n")
	f.Add("a s3cret\n")
	f.Add("a s3cret root\n")
	f.Add("a s3cret admin,\n")
	f.Add("a s3cret admin\nb s3cret viewer\n")
	f.Add("a\x00 s3cret\tadmin\r\n")
	f.Fuzz(func(t *testing.T, data string) {
		tokens, err := parseTokens([]byte(data))
		if err != nil {
			// Tokens of the fuzz corpus (f.Add) carry "s3cret"; client ids may be named
			// in errors, tokens never.
			inClientID := false
			for _, line := range strings.Split(data, "\n") {
				if f := strings.Fields(line); len(f) > 0 && strings.Contains(f[0], "s3cret") {
					inClientID = true
				}
			}
			if strings.Contains(err.Error(), "s3cret") && !inClientID {
				t.Fatalf("the error %q shows a token", err)
			}
			return
		}
		for _, id := range tokens {
			if id.ClientID == "" || len(id.Roles) == 0 {
				t.Fatalf("accepted an identity without a client or roles: %+v", id)
			}
			for _, r := range id.Roles {
				if _, err := ParseRoles(string(r)); err != nil {
					t.Fatalf("accepted an unknown role %q", r)
				}
			}
		}
	})
}

func FuzzAuthenticateHeader(f *testing.F) {
	path := filepath.Join(f.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("ops tok-admin-0123 admin\nfleet tok-crawler-0123 crawler\n"), 0o600); err != nil {
		f.Fatal(err)
	}
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		f.Fatal(err)
	}
	f.Add("Bearer tok-admin-0123")
	f.Add("bearer  tok-crawler-0123 ")
	f.Add("Basic tok-admin-0123")
	f.Add("")
	f.Add("Bearer \x00tok-admin-0123")
	f.Add("Bearer tok-admin-0123 extra")
	f.Fuzz(func(t *testing.T, header string) {
		id, err := a.Authenticate(header)
		if err != nil {
			if _, tok, _ := strings.Cut(header, " "); len(strings.TrimSpace(tok)) >= 4 && strings.Contains(err.Error(), strings.TrimSpace(tok)) {
				t.Fatalf("the error %q repeats the presented token", err)
			}
			return
		}
		switch id.ClientID {
		case "ops", "fleet":
		default:
			t.Fatalf("header %q authenticated as %+v", header, id)
		}
	})
}
