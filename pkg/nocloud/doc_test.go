package nocloud

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

// documented returns the fenced block that follows the line marker in
// the doc file (under docs/), failing when there is none.
func documented(t *testing.T, doc, marker string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "docs", doc))
	if err != nil {
		t.Fatal(err)
	}
	_, after, ok := strings.Cut(string(b), marker+"\n```yaml\n")
	if !ok {
		t.Fatalf("docs/%s has no ```yaml block after %s", doc, marker)
	}
	block, _, ok := strings.Cut(after, "```\n")
	if !ok {
		t.Fatalf("docs/%s: the block after %s does not end", doc, marker)
	}
	return block
}

// renderScript renders stdin's "template" with "meta-data" as cloud-init
// does a user-data (cloudinit/templater.py): the first line selects jinja
// and is dropped, the rest is a jinja2 Template with trim_blocks and the
// do extension, undefined variables rendered as CI_MISSING_JINJA_VAR/…,
// the trailing newline kept; the variables are the instance data, where
// the NoCloud datasource's meta-data (read with yaml.safe_load) is
// ds.meta_data.
const renderScript = `
import json, re, sys
import jinja2, yaml
req = json.load(sys.stdin)
ident, rest = req["template"].split("\n", 1)
assert re.match(r"##\s*template:\s*jinja\s*$", ident, re.I), ident
class Undefined(jinja2.DebugUndefined):
    def __str__(self):
        return "CI_MISSING_JINJA_VAR/" + self._undefined_name
md = yaml.safe_load(req["meta-data"])
add = "\n" if rest.endswith("\n") else ""
out = jinja2.Template(rest, undefined=Undefined, trim_blocks=True, extensions=["jinja2.ext.do"]).render(ds={"meta_data": md}, v1={}) + add
sys.stdout.write(json.dumps({"rendered": out, "parsed": yaml.safe_load(out)}))
`

// TestDocumentedCloudInitRenders: the cloud-init the Proxmox and KVM docs
// give for Squid with basic auth, taken out of the docs, rendered as
// cloud-init renders a jinja user-data against the meta-data of a seed
// built with credentials, is the template with the credentials in place
// byte for byte, and YAML whose files hold them exactly.
func TestDocumentedCloudInitRenders(t *testing.T) {
	t.Parallel()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Fatal("python3 with jinja2 and yaml is needed (apt-get install python3-jinja2 python3-yaml; scripts/ensure-deps.sh installs them)")
	}
	const user = "egress-0a1b2c3d4e5f"
	// Every character YAML, jinja or a shell treats specially that the
	// API admits in a password ([!-9;-~]).
	const password = `Zq9-_'"#$\` + "`" + `{{ x }}{%%}!&|;<>*?[]()~^=,.@/`
	for _, doc := range []string{"provisioner-proxmox.md", "provisioner-kvm.md"} {
		t.Run(doc, func(t *testing.T) {
			t.Parallel()
			tmpl := documented(t, doc, "<!-- cloud-init-squid-basic-auth -->")
			img, err := BuildSeedISO(Seed{InstanceID: "proxy-x", Hostname: "proxy-x", UserData: []byte(tmpl), ProxyUser: user, ProxyPassword: password})
			if err != nil {
				t.Fatal(err)
			}
			_, files, err := ReadSeedISO(img)
			if err != nil {
				t.Fatal(err)
			}
			in, _ := json.Marshal(map[string]string{"template": string(files["user-data"]), "meta-data": string(files["meta-data"])})
			cmd := exec.Command(py, "-c", renderScript)
			cmd.Stdin = bytes.NewReader(in)
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			out, err := cmd.Output()
			if err != nil {
				t.Fatalf("rendering with python3's jinja2: %v\n%s", err, stderr.String())
			}
			var res struct {
				Rendered string
				Parsed   map[string]any
			}
			if err := json.Unmarshal(out, &res); err != nil {
				t.Fatal(err)
			}
			_, body, _ := strings.Cut(tmpl, "\n")
			want := strings.NewReplacer("{{ ds.meta_data.egress_proxy_user }}", user, "{{ ds.meta_data.egress_proxy_password }}", password).Replace(body)
			if res.Rendered != want {
				t.Errorf("rendered\n%s\nwant\n%s", res.Rendered, want)
			}
			if !strings.HasPrefix(res.Rendered, "#cloud-config\n") {
				t.Errorf("the rendered user-data does not start with #cloud-config")
			}
			got := map[string]string{}
			wf, _ := res.Parsed["write_files"].([]any)
			for _, f := range wf {
				m, _ := f.(map[string]any)
				p, _ := m["path"].(string)
				c, _ := m["content"].(string)
				got[p] = c
			}
			if got["/run/egress-proxy/user"] != user+"\n" || got["/run/egress-proxy/password"] != password+"\n" {
				t.Errorf("the rendered files hold %q and %q", got["/run/egress-proxy/user"], got["/run/egress-proxy/password"])
			}
			if !strings.Contains(got["/etc/squid/conf.d/00-egress-auth.conf"], "auth_param basic program /usr/lib/squid/basic_ncsa_auth /etc/squid/egress-htpasswd\n") {
				t.Errorf("the squid rules: %q", got["/etc/squid/conf.d/00-egress-auth.conf"])
			}
		})
	}
}

// TestDocumentedGCECloudInit: the GCE doc's cloud-init, taken out of the
// doc, is cloud-config YAML that reads the metadata keys the GCE backend
// sets.
func TestDocumentedGCECloudInit(t *testing.T) {
	t.Parallel()
	block := documented(t, "provisioner-gcp.md", "<!-- cloud-init-squid-basic-auth-gce -->")
	var doc map[string]any
	if err := yaml.Unmarshal([]byte(block), &doc); err != nil || !strings.HasPrefix(block, "#cloud-config\n") {
		t.Fatalf("not cloud-config YAML: %v", err)
	}
	for _, k := range []string{MetaKeyProxyUser, MetaKeyProxyPassword, "basic_ncsa_auth", "htpasswd -iBc"} {
		if !strings.Contains(block, k) {
			t.Errorf("the GCE cloud-init does not name %s", k)
		}
	}
}
