package gcp

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

const secretInCloudInit = "cl0ud-1n1t-s3cr3t"

// TestWirePayloads: bodies are logged only with the flag, and user-data
// never, in the insert body nor in the instance read back.
func TestWirePayloads(t *testing.T) {
	t.Parallel()
	for _, payloads := range []bool{false, true} {
		e := newEnv(t, nil, func(o *Options) { o.WirePayloads = payloads })
		in, err := e.be.Create(ctxT(t), createReq("wire-1", zoneA))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := e.be.Get(ctxT(t), &provisionerv1.GetInstanceRequest{ProviderId: in.GetProviderId(), ProxyUid: "wire-1"}); err != nil {
			t.Fatal(err)
		}
		logs := e.logs.String()
		if strings.Contains(logs, secretInCloudInit) || strings.Contains(logs, "#cloud-config") {
			t.Fatalf("payloads=%v: the cloud-init reached the log:\n%s", payloads, logs)
		}
		hasBodies := strings.Contains(logs, `"requestBody"`) && strings.Contains(logs, `"responseBody"`)
		if hasBodies != payloads {
			t.Errorf("payloads=%v: bodies logged %v", payloads, hasBodies)
		}
		if payloads && strings.Count(logs, "[redacted ") < 2 {
			t.Errorf("want user-data redacted in the insert and in the instance read:\n%s", logs)
		}
		if !strings.Contains(logs, `"msg":"gcp api call"`) {
			t.Errorf("no per-call line")
		}
	}
}

func TestRedactedBody(t *testing.T) {
	t.Parallel()
	body := `{"name":"x","metadata":{"items":[{"key":"user-data","value":"` + secretInCloudInit + `"},{"key":"other","value":"keep"}]}}`
	got := redactedBody([]byte(body))
	if strings.Contains(got, secretInCloudInit) || !strings.Contains(got, "[redacted 17 bytes]") || !strings.Contains(got, "keep") {
		t.Errorf("redactedBody = %s", got)
	}
	if got := redactedBody([]byte("user-data: " + secretInCloudInit)); strings.Contains(got, secretInCloudInit) {
		t.Errorf("non-JSON body shown: %s", got)
	}
}

func FuzzRedactedBody(f *testing.F) {
	f.Add([]byte(`{"metadata":{"items":[{"key":"user-data","value":"` + secretInCloudInit + `"}]}}`))
	f.Add([]byte(`[{"key":"user-data","value":"` + secretInCloudInit + `"}]`))
	f.Add([]byte(`not json ` + secretInCloudInit))
	f.Fuzz(func(t *testing.T, body []byte) {
		got := redactedBody(body)
		if strings.Contains(got, secretInCloudInit) && !strings.Contains(string(body), `"key"`) {
			t.Errorf("secret shown for %q: %s", body, got)
		}
	})
}

func FuzzParseProviderID(f *testing.F) {
	for _, s := range []string{"zones/europe-west1-b/instances/proxy-1", "zones//instances/", "vms/1/x", "zones/a/instances/b/c"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		zone, name, err := parseProviderID(id)
		if err != nil {
			if !errclass.Is(err, errclass.Permanent) {
				t.Errorf("%q: %v is not Permanent", id, err)
			}
			return
		}
		if providerID(zone, name) != id {
			t.Errorf("%q does not round-trip: %s %s", id, zone, name)
		}
	})
}

// TestServiceAccountCredentials: a real service-account key file; the auth
// library signs a JWT, fetches a token from token_uri and the fake Compute
// API receives it as a bearer token.
func TestServiceAccountCredentials(t *testing.T) {
	t.Parallel()
	var tokens atomic.Int32
	tokenSrv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = r.ParseForm()
		if r.Form.Get("grant_type") != "urn:ietf:params:oauth:grant-type:jwt-bearer" || r.Form.Get("assertion") == "" {
			http.Error(w, `{"error":"invalid_grant"}`, http.StatusBadRequest)
			return
		}
		tokens.Add(1)
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"access_token":"ya29.fake-token","token_type":"Bearer","expires_in":3600}`))
	}))
	t.Cleanup(tokenSrv.Close)
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	der, _ := x509.MarshalPKCS8PrivateKey(key)
	sa, _ := json.Marshal(map[string]string{
		"type": "service_account", "project_id": project, "private_key_id": "k1",
		"private_key":  string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der})),
		"client_email": "provisioner@" + project + ".iam.gserviceaccount.com", "client_id": "1",
		"token_uri": tokenSrv.URL,
	})
	dir := t.TempDir()
	path := filepath.Join(dir, "sa.json")
	e := newEnv(t, func(c *Config) { c.WithoutAuthentication = false; c.CredentialsFile = path })
	// Missing at first: Transient, and the start-up WARNING was logged.
	_, err = e.be.Create(ctxT(t), createReq("sa-1", zoneA))
	if !errclass.Is(err, errclass.Transient) || !strings.Contains(e.logs.String(), "WARNING: credentials file is not readable") {
		t.Fatalf("Create without the file = %v", err)
	}
	// Unparseable: Permanent, without quoting it.
	if err := os.WriteFile(path, []byte(`{"type":"service_account","private_key":"s3cr3t"`), 0o600); err != nil {
		t.Fatal(err)
	}
	_, err = e.be.Create(ctxT(t), createReq("sa-1", zoneA))
	if !errclass.Is(err, errclass.Permanent) || strings.Contains(err.Error(), "s3cr3t") {
		t.Fatalf("Create with a broken file = %v", err)
	}
	// Loaded lazily once it is right.
	if err := os.WriteFile(path, sa, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := e.be.Create(ctxT(t), createReq("sa-1", zoneA)); err != nil {
		t.Fatal(err)
	}
	posts := e.requests("POST", "/instances")
	if len(posts) != 1 || posts[0].Header.Get("Authorization") != "Bearer ya29.fake-token" || tokens.Load() == 0 {
		t.Errorf("insert Authorization %q after %d token fetches", posts[0].Header.Get("Authorization"), tokens.Load())
	}
}
