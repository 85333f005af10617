package nocloud

import (
	"bytes"
	"mime"
	"mime/multipart"
	"net/mail"
	"strings"
	"testing"

	"go.yaml.in/yaml/v3"
)

func TestBuildSeedISOReadsBack(t *testing.T) {
	t.Parallel()
	userData := []byte("#cloud-config\n# keep: UPPER case, trailing spaces   \r\npackages: [squid]\n\x00binary\xff")
	extra := []byte("#cloud-config\nntp: {enabled: true}\n")
	cases := []struct {
		name       string
		agent      bool
		extra      []byte
		wantVendor func(t *testing.T, v []byte)
	}{
		{"no vendor-data", false, nil, func(t *testing.T, v []byte) {
			if v != nil {
				t.Errorf("vendor-data present: %q", v)
			}
		}},
		{"agent script only", true, nil, func(t *testing.T, v []byte) {
			if string(v) != GuestAgentScript {
				t.Errorf("vendor-data = %q, want the agent script", v)
			}
		}},
		{"extra only", false, extra, func(t *testing.T, v []byte) {
			if !bytes.Equal(v, extra) {
				t.Errorf("vendor-data = %q, want %q", v, extra)
			}
		}},
		{"both as multipart", true, extra, func(t *testing.T, v []byte) {
			parts := readMultipart(t, v)
			if len(parts) != 2 {
				t.Fatalf("%d parts, want 2", len(parts))
			}
			if parts[0].ctype != "text/x-shellscript" || parts[0].body != GuestAgentScript {
				t.Errorf("part 1 = %s %q", parts[0].ctype, parts[0].body)
			}
			if parts[1].ctype != "text/cloud-config" || parts[1].body != string(extra) {
				t.Errorf("part 2 = %s %q", parts[1].ctype, parts[1].body)
			}
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			img, err := BuildSeedISO(Seed{InstanceID: "proxy-abc", Hostname: "proxy-abc", UserData: userData, InstallGuestAgent: tc.agent, VendorData: tc.extra})
			if err != nil {
				t.Fatal(err)
			}
			label, files, err := ReadSeedISO(img)
			if err != nil {
				t.Fatal(err)
			}
			if label != "cidata" {
				t.Errorf("label = %q, want cidata", label)
			}
			if !bytes.Equal(files["user-data"], userData) {
				t.Errorf("user-data = %q, want it byte for byte", files["user-data"])
			}
			if got := string(files["meta-data"]); got != "instance-id: proxy-abc\nlocal-hostname: proxy-abc\n" {
				t.Errorf("meta-data = %q", got)
			}
			tc.wantVendor(t, files["vendor-data"])
			for name := range files {
				switch name {
				case "user-data", "meta-data", "vendor-data":
				default:
					t.Errorf("unexpected file %q on the seed", name)
				}
			}
		})
	}
}

func TestBuildSeedISONeedsInstanceID(t *testing.T) {
	t.Parallel()
	if _, err := BuildSeedISO(Seed{UserData: []byte("x")}); err == nil {
		t.Fatal("no error for an empty instance id")
	}
}

func TestGuestAgentScriptCoversPackageManagersAndInits(t *testing.T) {
	t.Parallel()
	for _, want := range []string{"#!/bin/sh", "apt-get install -y qemu-guest-agent", "dnf install", "yum install", "zypper", "apk add", "systemctl start qemu-guest-agent", "rc-service qemu-guest-agent start", "command -v qemu-ga"} {
		if !strings.Contains(GuestAgentScript, want) {
			t.Errorf("script lacks %q", want)
		}
	}
}

type part struct{ ctype, body string }

func readMultipart(t *testing.T, v []byte) []part {
	t.Helper()
	msg, err := mail.ReadMessage(bytes.NewReader(v))
	if err != nil {
		t.Fatal(err)
	}
	mt, params, err := mime.ParseMediaType(msg.Header.Get("Content-Type"))
	if err != nil || mt != "multipart/mixed" {
		t.Fatalf("content type %q: %v", mt, err)
	}
	r := multipart.NewReader(msg.Body, params["boundary"])
	var out []part
	for {
		p, err := r.NextPart()
		if err != nil {
			break
		}
		var b bytes.Buffer
		_, _ = b.ReadFrom(p)
		ct, _, _ := mime.ParseMediaType(p.Header.Get("Content-Type"))
		out = append(out, part{ct, b.String()})
	}
	return out
}

// A proxy's credentials are meta-data keys that read back as themselves,
// whatever characters the password has; without credentials the keys are
// absent.
func TestMetaDataCredentials(t *testing.T) {
	t.Parallel()
	for _, pass := range []string{"Zq9-xY_0aBcDeFgHiJkLmNoPqRsTuVwX", `a"b\c#{{ x }}'%-: ~!`, "-leading", "null", "123"} {
		img, err := BuildSeedISO(Seed{InstanceID: "proxy-abc", Hostname: "proxy-abc", ProxyUser: "egress-0a1b2c3d4e5f", ProxyPassword: pass})
		if err != nil {
			t.Fatal(err)
		}
		_, files, err := ReadSeedISO(img)
		if err != nil {
			t.Fatal(err)
		}
		var md map[string]any
		if err := yaml.Unmarshal(files["meta-data"], &md); err != nil {
			t.Fatalf("meta-data %q is not YAML: %v", files["meta-data"], err)
		}
		if md["instance-id"] != "proxy-abc" || md[MetaKeyProxyUser] != "egress-0a1b2c3d4e5f" || md[MetaKeyProxyPassword] != pass {
			t.Errorf("meta-data %q reads back as %v", files["meta-data"], md)
		}
	}
	if got := string(MetaData(Seed{InstanceID: "i", Hostname: "h"})); got != "instance-id: i\nlocal-hostname: h\n" {
		t.Errorf("meta-data without credentials = %q", got)
	}
	want := "instance-id: i\nlocal-hostname: h\negress_proxy_user: \"u\"\negress_proxy_password: \"p\\\"q\"\n"
	if got := string(MetaData(Seed{InstanceID: "i", Hostname: "h", ProxyUser: "u", ProxyPassword: `p"q`})); got != want {
		t.Errorf("meta-data = %q, want %q", got, want)
	}
}
