package proxmox

import (
	"net/http"
	"os"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// The token file is read on every request: a rotated token works at once.
func TestTokenRotatesWithoutRestart(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	if _, err := e.be.resources(ctx); err != nil {
		t.Fatal(err)
	}
	e.fake.AddToken(tokenUser, "rotated-secret", e.fake.OperatorACL())
	if _, err := e.be.resources(ctx); errclass.Of(classify(err)) != errclass.Permanent {
		t.Fatalf("old token after rotation: %v", err)
	}
	writeFile(t, e.tokenFile, tokenUser+"=rotated-secret\n")
	if _, err := e.be.resources(ctx); err != nil {
		t.Fatalf("new token: %v", err)
	}
}

// The CA is loaded on first use and cached; a missing one is retried.
func TestCALoadedOnFirstUseAndCached(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	ctx := ctxT(t)
	ca, _ := os.ReadFile(e.caFile)
	_ = os.Remove(e.caFile)
	if _, err := e.be.resources(ctx); errclass.Of(err) != errclass.Transient {
		t.Fatalf("missing CA: %v", err)
	}
	writeFile(t, e.caFile, string(ca))
	if _, err := e.be.resources(ctx); err != nil {
		t.Fatalf("CA landed: %v", err)
	}
	writeFile(t, e.caFile, "garbage")
	if _, err := e.be.resources(ctx); err != nil {
		t.Fatalf("the cached CA was reloaded: %v", err)
	}
}

func TestInsecureSkipTLSVerify(t *testing.T) {
	t.Parallel()
	e := newEnv(t, func(c *Config) { c.CAFile = "" })
	if _, err := e.be.resources(ctxT(t)); errclass.Of(classify(err)) != errclass.Permanent {
		t.Fatalf("system roots accepted the fake's CA: %v", err)
	}
	e2 := newEnv(t, func(c *Config) { c.CAFile, c.InsecureSkipTLSVerify = "", true })
	if _, err := e2.be.resources(ctxT(t)); err != nil {
		t.Fatal(err)
	}
}

func TestTransportSettings(t *testing.T) {
	t.Parallel()
	e := newEnv(t, nil)
	hc, err := e.be.c.httpClient()
	if err != nil {
		t.Fatal(err)
	}
	tr := hc.Transport.(parentGated).plain.(*http.Transport)
	if tr.MaxIdleConnsPerHost != 4 || tr.TLSNextProto == nil || len(tr.TLSNextProto) != 0 || tr.ForceAttemptHTTP2 || tr.TLSHandshakeTimeout != e.be.b.TLSHandshake || tr.IdleConnTimeout.Seconds() != 90 {
		t.Errorf("transport = %+v", tr)
	}
	again, _ := e.be.c.httpClient()
	if again != hc {
		t.Error("the client is not shared")
	}
}
