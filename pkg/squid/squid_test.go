package squid

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestServiceName(t *testing.T) {
	t.Parallel()
	a, b := ServiceName("43b1b4e6-40e9-4788-a936-acc79461769a"), ServiceName("43b1b4e6-40e9-4788-a936-acc79461769b")
	if a == b || a != ServiceName("43b1b4e6-40e9-4788-a936-acc79461769a") {
		t.Errorf("names %q and %q: want one per id, the same each time", a, b)
	}
	for _, n := range []string{a, ServiceName("squid-test-123/x.y")} {
		if len(n) > 32 || strings.Trim(n, "abcdefghijklmnopqrstuvwxyz0123456789") != "" {
			t.Errorf("name %q: squid takes at most 32 letters and digits", n)
		}
	}
}

func TestRemoveStaleSegments(t *testing.T) {
	t.Parallel()
	if _, err := os.Stat("/dev/shm"); err != nil {
		t.Skip("no /dev/shm here")
	}
	name := ServiceName(t.Name() + filepath.Base(t.TempDir()))
	mine := filepath.Join("/dev/shm", name+"-cf__queues.shm")
	other := filepath.Join("/dev/shm", name+"x-cf__queues.shm")
	for _, f := range []string{mine, other} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.Remove(f) })
	}
	RemoveStaleSegments(name)
	if _, err := os.Stat(mine); !os.IsNotExist(err) {
		t.Errorf("%s is still there: %v", mine, err)
	}
	if _, err := os.Stat(other); err != nil {
		t.Errorf("another name's segment went: %v", err)
	}
}

func TestHTPasswd(t *testing.T) {
	t.Parallel()
	const pass = "s3cret-Pass_word"
	file, err := HTPasswd("egress-0a1b2c3d4e5f", pass)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(file), pass) || !strings.HasPrefix(string(file), "egress-0a1b2c3d4e5f:$2a$") || !strings.HasSuffix(string(file), "\n") {
		t.Errorf("htpasswd %q: want one line user:bcrypt-hash, never the password", file)
	}
	if !HTPasswdAdmits(file, "egress-0a1b2c3d4e5f", pass) {
		t.Error("the file does not admit its own credentials")
	}
	for _, c := range [][2]string{{"egress-0a1b2c3d4e5f", pass + "x"}, {"other", pass}, {"egress-0a1b2c3d4e5f", ""}} {
		if HTPasswdAdmits(file, c[0], c[1]) {
			t.Errorf("the file admits %q", c)
		}
	}
	if _, err := HTPasswd("a:b", pass); err == nil {
		t.Error("a user name with ':' was accepted")
	}
	long := strings.Repeat("p", 73)
	if _, err := HTPasswd("u", long); err == nil || strings.Contains(err.Error(), long) {
		t.Errorf("a 73-byte password: %v", err)
	}
}

func TestBasicAuth(t *testing.T) {
	t.Parallel()
	got := BasicAuth("/usr/lib/squid/basic_ncsa_auth", "/etc/egress-proxy-auth/htpasswd")
	want := "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/egress-proxy-auth/htpasswd\n" +
		"auth_param basic realm egress-proxies\n" +
		"auth_param basic children 2 startup=1 idle=1\n" +
		"auth_param basic credentialsttl 1 minute\n" +
		"acl authenticated proxy_auth REQUIRED\n"
	if got != want {
		t.Errorf("BasicAuth =\n%s\nwant\n%s", got, want)
	}
}
