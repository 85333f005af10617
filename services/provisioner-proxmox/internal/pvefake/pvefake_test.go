package pvefake

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"
)

const (
	user   = "proxy-operator@pve!operator"
	secret = "s3cr3t"
)

func start(t *testing.T) *Server {
	t.Helper()
	s, err := Start(Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	s.AddToken(user, secret, s.OperatorACL())
	s.AddTemplate(9001, "pv1-1", DebianTemplate(), false)
	return s
}

func client(t *testing.T, s *Server) *http.Client {
	t.Helper()
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(s.CAPEM) {
		t.Fatal("CA PEM")
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr}
}

type answer struct {
	status int
	proto  string
	reason string
	body   map[string]any
	raw    []byte
	close  bool
}

func do(t *testing.T, s *Server, c *http.Client, method, path, auth string, form url.Values) answer {
	t.Helper()
	var body io.Reader
	u := s.URL + "/api2/json" + path
	if form != nil && (method == "GET" || method == "DELETE") {
		u += "?" + form.Encode()
	} else if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, _ := http.NewRequest(method, u, body)
	if form != nil && body != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	if auth != "" {
		req.Header.Set("Authorization", auth)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode, proto: resp.Proto, raw: raw, close: resp.Close}
	_, a.reason, _ = strings.Cut(resp.Status, " ")
	_ = json.Unmarshal(raw, &a.body)
	return a
}

const tok = "PVEAPIToken=" + user + "=" + secret

func TestTLSAndHTTP11(t *testing.T) {
	t.Parallel()
	s := start(t)
	a := do(t, s, client(t, s), "GET", "/version", tok, nil)
	if a.status != 200 || a.proto != "HTTP/1.1" {
		t.Fatalf("%d %s", a.status, a.proto)
	}
	if a.body["data"].(map[string]any)["version"] != Version {
		t.Errorf("version = %v", a.body)
	}
	// Another CA does not verify it.
	other, err := Start(Options{})
	if err != nil {
		t.Fatal(err)
	}
	other.Close()
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(other.CAPEM)
	_, err = (&http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}}).Get(s.URL + "/api2/json/version")
	if err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Errorf("a foreign CA verified the fake: %v", err)
	}
}

func TestAuthentication(t *testing.T) {
	t.Parallel()
	s := start(t)
	c := client(t, s)
	for _, tc := range []struct {
		auth, reason string
	}{
		{"", "No ticket"},
		{"PVEAPIToken=" + user + "=wrong", "Authentication failed!"},
		{"PVEAPIToken=nobody@pve!x=" + secret, "Authentication failed!"},
	} {
		a := do(t, s, c, "GET", "/version", tc.auth, nil)
		if a.status != 401 || a.reason != tc.reason || len(a.raw) != 0 || !a.close {
			t.Errorf("auth %q: %d %q body %q close %v", tc.auth, a.status, a.reason, a.raw, a.close)
		}
	}
}

func TestErrorFormatAndPermissions(t *testing.T) {
	t.Parallel()
	s := start(t)
	c := client(t, s)
	s.AddToken("auditor@pve!ro", "x", map[string][]string{"/": {"VM.Audit", "Sys.Audit"}, "/vms/9001": {"Sys.Audit"}})
	a := do(t, s, c, "GET", "/nodes/pv1-1/qemu/9001/config", "PVEAPIToken=auditor@pve!ro=x", nil)
	want := "Permission check failed (/vms/9001, VM.Audit)"
	if a.status != 403 || a.reason != want || a.body["message"] != want+"\n" || a.body["data"] != nil || !a.close {
		t.Errorf("403: %d %q %v close %v", a.status, a.reason, a.body, a.close)
	}
	a = do(t, s, c, "GET", "/nodes/pv1-1/qemu/117/config", tok, nil)
	want = "Configuration file 'nodes/pv1-1/qemu-server/117.conf' does not exist"
	if a.status != 500 || a.reason != want || a.body["message"] != want+"\n" {
		t.Errorf("500: %d %q %v", a.status, a.reason, a.body)
	}
	a = do(t, s, c, "GET", "/nodes/pv1-1/storage/nope/status", tok, nil)
	if a.status != 400 || a.reason != "Parameter verification failed." || a.body["errors"].(map[string]any)["storage"] != "No such storage." {
		t.Errorf("400: %d %q %v", a.status, a.reason, a.body)
	}
	// VMs the token may not audit are left out of the resources silently.
	s.AddVM(VM{VMID: 200, Node: "pv1-1", Config: map[string]string{"name": "hidden"}})
	s.AddToken("narrow@pve!t", "y", map[string][]string{"/vms/9001": {"VM.Audit"}})
	a = do(t, s, c, "GET", "/cluster/resources", "PVEAPIToken=narrow@pve!t=y", url.Values{"type": {"vm"}})
	if items := a.body["data"].([]any); len(items) != 1 {
		t.Errorf("resources = %v", items)
	}
}

var upidRE = regexp.MustCompile(`^UPID:pv1-1:[0-9A-F]{8}:[0-9A-F]{8,9}:[0-9A-F]{8}:qmclone:9001:proxy-operator@pve!operator:$`)

func TestCloneTaskLockAndResources(t *testing.T) {
	t.Parallel()
	s := start(t)
	c := client(t, s)
	s.HoldClones()
	a := do(t, s, c, "POST", "/nodes/pv1-1/qemu/9001/clone", tok, url.Values{"newid": {"150000"}, "name": {"proxy-a"}, "full": {"1"}, "description": {"mark"}})
	upid, _ := a.body["data"].(string)
	if a.status != 200 || !upidRE.MatchString(upid) {
		t.Fatalf("clone: %d %q", a.status, upid)
	}
	st := do(t, s, c, "GET", "/nodes/pv1-1/tasks/"+url.PathEscape(upid)+"/status", tok, nil)
	if d := st.body["data"].(map[string]any); d["status"] != "running" || d["exitstatus"] != nil {
		t.Errorf("running task = %v", d)
	}
	cfg := do(t, s, c, "GET", "/nodes/pv1-1/qemu/150000/config", tok, nil).body["data"].(map[string]any)
	if len(cfg) != 1 || cfg["lock"] != "clone" {
		t.Errorf("config during the clone = %v", cfg)
	}
	res := do(t, s, c, "GET", "/cluster/resources", tok, url.Values{"type": {"vm"}}).body["data"].([]any)
	var found bool
	for _, r := range res {
		m := r.(map[string]any)
		if m["vmid"] == float64(150000) {
			found = m["name"] == "VM 150000" && m["lock"] == "clone" && m["id"] == "qemu/150000"
		}
	}
	if !found {
		t.Errorf("resources during the clone = %v", res)
	}
	if a := do(t, s, c, "PUT", "/nodes/pv1-1/qemu/150000/config", tok, url.Values{"cores": {"2"}}); a.status != 500 || a.reason != "VM is locked (clone)" {
		t.Errorf("config write on a locked VM: %d %q", a.status, a.reason)
	}
	if a := do(t, s, c, "POST", "/nodes/pv1-1/qemu/9001/clone", tok, url.Values{"newid": {"150000"}}); a.status != 500 || a.reason != "unable to create VM 150000: config file already exists" {
		t.Errorf("clone onto a taken VMID: %d %q", a.status, a.reason)
	}
	s.ReleaseClones()
	st = do(t, s, c, "GET", "/nodes/pv1-1/tasks/"+url.PathEscape(upid)+"/status", tok, nil)
	if d := st.body["data"].(map[string]any); d["status"] != "stopped" || d["exitstatus"] != "OK" {
		t.Errorf("finished task = %v", d)
	}
	cfg = do(t, s, c, "GET", "/nodes/pv1-1/qemu/150000/config", tok, nil).body["data"].(map[string]any)
	if cfg["name"] != "proxy-a" || cfg["description"] != "mark" || cfg["lock"] != nil || !strings.HasPrefix(cfg["scsi0"].(string), "local-lvm:vm-150000-disk-") || cfg["template"] != nil {
		t.Errorf("cloned config = %v", cfg)
	}
	if cfg["net0"] == DebianTemplate()["net0"] {
		t.Error("the clone kept the template's MAC")
	}
	// A failing task reports its text as exitstatus and removes the VM.
	s.FailNextTask("qmclone", "clone failed: disk full")
	a = do(t, s, c, "POST", "/nodes/pv1-1/qemu/9001/clone", tok, url.Values{"newid": {"150001"}, "name": {"proxy-b"}})
	upid = a.body["data"].(string)
	st = do(t, s, c, "GET", "/nodes/pv1-1/tasks/"+url.PathEscape(upid)+"/status", tok, nil)
	if d := st.body["data"].(map[string]any); d["exitstatus"] != "clone failed: disk full" {
		t.Errorf("failed task = %v", d)
	}
	if _, ok := s.VMs()[150001]; ok {
		t.Error("a failed clone left its VM")
	}
}

func TestUploadAndAgent(t *testing.T) {
	t.Parallel()
	s := start(t)
	c := client(t, s)
	upload := func(name string) answer {
		var buf bytes.Buffer
		mw := multipart.NewWriter(&buf)
		_ = mw.WriteField("content", "iso")
		fw, _ := mw.CreateFormFile("filename", name)
		_, _ = fw.Write([]byte("ISO"))
		_ = mw.Close()
		req, _ := http.NewRequest("POST", s.URL+"/api2/json/nodes/pv1-1/storage/proxy-seeds/upload", &buf)
		req.Header.Set("Content-Type", mw.FormDataContentType())
		req.Header.Set("Authorization", tok)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		a := answer{status: resp.StatusCode, raw: raw}
		_, a.reason, _ = strings.Cut(resp.Status, " ")
		_ = json.Unmarshal(raw, &a.body)
		return a
	}
	a := upload("my seed!.iso")
	if a.status != 200 || !strings.Contains(a.body["data"].(string), ":imgcopy::") {
		t.Fatalf("upload: %d %v", a.status, a.body)
	}
	do(t, s, c, "GET", "/nodes/pv1-1/tasks/"+url.PathEscape(a.body["data"].(string))+"/status", tok, nil)
	if got := s.File("pv1-1", "proxy-seeds", "iso/my_seed_.iso"); string(got) != "ISO" {
		t.Errorf("stored = %q (%v)", got, s.Files("pv1-1", "proxy-seeds"))
	}
	// The content listing reports the upload with its ctime.
	s.PutFile("pv1-1", "proxy-seeds", "vztmpl/t.tar.zst", []byte("T"))
	a = do(t, s, c, "GET", "/nodes/pv1-1/storage/proxy-seeds/content", tok, url.Values{"content": {"iso"}})
	items, _ := a.body["data"].([]any)
	if a.status != 200 || len(items) != 1 {
		t.Fatalf("content: %d %v", a.status, a.body)
	}
	it := items[0].(map[string]any)
	if it["volid"] != "proxy-seeds:iso/my_seed_.iso" || it["format"] != "iso" || it["content"] != "iso" || it["size"] != float64(3) ||
		time.Since(time.Unix(int64(it["ctime"].(float64)), 0)) > time.Minute {
		t.Errorf("content item = %v", it)
	}
	s.SetStorage("pv1-1", "local", false, "iso")
	if a := do(t, s, c, "GET", "/nodes/pv1-1/storage/local/content", tok, nil); a.status != 500 || a.reason != "storage 'local' is not online" {
		t.Errorf("inactive storage: %d %q", a.status, a.reason)
	}
	if a := upload("seed.txt"); a.status != 400 || a.body["errors"].(map[string]any)["filename"] != "wrong file extension" {
		t.Errorf("wrong extension: %d %v", a.status, a.body)
	}
	// Guest agent answers.
	s.AddVM(VM{VMID: 300, Node: "pv1-1", Status: "stopped", Config: map[string]string{"name": "x", "agent": "1"}})
	for _, tc := range []struct {
		setup func()
		want  string
	}{
		{func() {}, "VM 300 is not running"},
		{func() {
			s.SetVM(300, func(v *VM) { v.Status, v.QMP = "running", "running" })
			s.SetAgent(300, AgentNotRunning)
		}, "QEMU guest agent is not running"},
		{func() { s.SetVM(300, func(v *VM) { delete(v.Config, "agent") }) }, "No QEMU guest agent configured"},
	} {
		tc.setup()
		a := do(t, s, c, "GET", "/nodes/pv1-1/qemu/300/agent/network-get-interfaces", tok, nil)
		if a.status != 500 || a.reason != tc.want {
			t.Errorf("agent: %d %q, want %q", a.status, a.reason, tc.want)
		}
	}
	// 595 for a node pveproxy cannot reach, and unknown status in resources.
	s.SetNodeDown("pv1-1", 595)
	if a := do(t, s, c, "GET", "/nodes/pv1-1/status", tok, nil); a.status != 595 {
		t.Errorf("down node: %d %q", a.status, a.reason)
	}
	for _, r := range do(t, s, c, "GET", "/cluster/resources", tok, url.Values{"type": {"vm"}}).body["data"].([]any) {
		if m := r.(map[string]any); m["status"] != "unknown" || m["name"] != nil {
			t.Errorf("resource on a down node = %v", m)
		}
	}
}

// pveproxy closes the connection after an error: the raw wire shows it.
func TestRawErrorAnswer(t *testing.T) {
	t.Parallel()
	s := start(t)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(s.CAPEM)
	conn, err := tls.Dial("tcp", strings.TrimPrefix(s.URL, "https://"), &tls.Config{RootCAs: pool, ServerName: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(conn, "GET /api2/json/nodes/pv1-1/qemu/117/status/current HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n\r\n", tok)
	raw, _ := io.ReadAll(bufio.NewReader(conn)) // ends because the server closes
	if !strings.HasPrefix(string(raw), "HTTP/1.1 500 Configuration file 'nodes/pv1-1/qemu-server/117.conf' does not exist\r\n") || !strings.Contains(string(raw), "Connection: close") {
		t.Errorf("raw answer:\n%s", raw)
	}
}
