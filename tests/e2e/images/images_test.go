//go:build images

// Package images runs every image `make images` built with podman, as the
// chart runs them: read-only root, no capabilities, uid 65532. A broken
// image (missing binary, CA bundle or user, a binary that cannot start)
// fails here rather than in a cluster. Run with `make images test-images`.
package images

import (
	"archive/tar"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/pgtest"
)

func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..", "..")
}

func podman(t *testing.T, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "podman", args...)
	cmd.Env = append(os.Environ(), "CONTAINERS_CONF="+filepath.Join(repoRoot(), "deploy", "images", "containers.conf"))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

var loadedRE = regexp.MustCompile(`Loaded image(?:\(s\))?: (\S+)`)

// load loads the image's OCI archive and returns the reference podman gave it.
func load(t *testing.T, name, version string) string {
	t.Helper()
	archive := filepath.Join(repoRoot(), "bin", "images", name+"-"+version+".oci.tar")
	if _, err := os.Stat(archive); err != nil {
		t.Fatalf("%v: run `make images` first", err)
	}
	out, err := podman(t, "load", "-i", archive)
	m := loadedRE.FindStringSubmatch(out)
	if err != nil || m == nil {
		t.Fatalf("podman load %s: %v\n%s", archive, err, out)
	}
	return m[1]
}

// hardened are the podman run flags matching the chart's securityContext.
var hardened = []string{"run", "--rm", "--read-only", "--read-only-tmpfs=false", "--tmpfs=/tmp:rw,size=64m",
	"--cap-drop=ALL", "--security-opt=no-new-privileges", "--user=65532:65532"}

func images(t *testing.T) (names []string, version string) {
	names = strings.Fields(os.Getenv("EGRESS_IMAGES"))
	version = os.Getenv("EGRESS_IMAGE_VERSION")
	if len(names) == 0 || version == "" {
		t.Fatal("EGRESS_IMAGES and EGRESS_IMAGE_VERSION must name the images (make test-images sets them)")
	}
	return names, version
}

// TestImages checks each image's config and files, and that its binary
// starts as the chart starts it.
func TestImages(t *testing.T) {
	names, version := images(t)
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			ref := load(t, name, version)
			if !strings.HasSuffix(ref, "egress-proxies/"+name+":"+version) {
				t.Errorf("loaded as %s, want egress-proxies/%s:%s", ref, name, version)
			}
			out, err := podman(t, "image", "inspect", "--format", "{{json .Config}}", ref)
			if err != nil {
				t.Fatalf("inspect: %v %s", err, out)
			}
			var cfg struct {
				User       string
				Entrypoint []string
				Labels     map[string]string
			}
			if err := json.Unmarshal([]byte(out), &cfg); err != nil {
				t.Fatalf("inspect output %q: %v", out, err)
			}
			if cfg.User != "65532:65532" || len(cfg.Entrypoint) != 1 || cfg.Entrypoint[0] != "/usr/local/bin/"+name ||
				cfg.Labels["org.opencontainers.image.version"] != version {
				t.Errorf("config user %q entrypoint %v labels %v, want 65532:65532, /usr/local/bin/%s, version %s", cfg.User, cfg.Entrypoint, cfg.Labels, name, version)
			}
			checkFiles(t, ref, name)

			out, err = podman(t, append(hardened, "--network=none", ref, "--help")...)
			want := "-grpc-listen"
			if name == "egressctl" {
				want = "egressctl"
			}
			if err != nil || !strings.Contains(out, want) {
				t.Errorf("%s --help: %v\n%s\nwant exit 0 and usage naming %s", name, err, out, want)
			}
		})
	}
}

// checkFiles exports a created container and checks the files the
// binaries need: the CA bundle, the non-root user and a sticky /tmp.
func checkFiles(t *testing.T, ref, name string) {
	t.Helper()
	id, err := podman(t, "create", ref)
	if err != nil {
		t.Fatalf("create: %v %s", err, id)
	}
	id = strings.TrimSpace(id)
	defer podman(t, "rm", id)
	dir := t.TempDir()
	tarPath := filepath.Join(dir, "fs.tar")
	if out, err := podman(t, "export", "-o", tarPath, id); err != nil {
		t.Fatalf("export: %v %s", err, out)
	}
	f, err := os.Open(tarPath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	files := map[string]*tar.Header{}
	contents := map[string]string{}
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		p := strings.TrimPrefix(strings.TrimPrefix(h.Name, "./"), "/")
		files[strings.TrimSuffix(p, "/")] = h
		if p == "etc/passwd" || p == "etc/ssl/certs/ca-certificates.crt" {
			b, _ := io.ReadAll(tr)
			contents[p] = string(b)
		}
	}
	if !strings.Contains(contents["etc/passwd"], ":65532:65532:") {
		t.Errorf("etc/passwd has no user 65532: %q", contents["etc/passwd"])
	}
	if n := strings.Count(contents["etc/ssl/certs/ca-certificates.crt"], "BEGIN CERTIFICATE"); n < 50 {
		t.Errorf("CA bundle holds %d certificates, want the system's", n)
	}
	if h := files["tmp"]; h == nil || h.Typeflag != tar.TypeDir || h.Mode&0o1777 != 0o1777 {
		t.Errorf("/tmp: %+v, want a sticky world-writable directory", h)
	}
	if h := files["usr/local/bin/"+name]; h == nil || h.Mode&0o111 == 0 {
		t.Errorf("binary /usr/local/bin/%s missing or not executable", name)
	}
	for p := range files {
		if strings.HasPrefix(p, "bin/") || strings.HasPrefix(p, "usr/bin/") || p == "bin" {
			t.Errorf("unexpected %s: the image holds the binary alone", p)
		}
	}
}

// TestMigrateImages runs `migrate` of each database service's image
// against a real PostgreSQL, as the chart's hook does, and checks the
// schema appeared.
func TestMigrateImages(t *testing.T) {
	_, version := images(t)
	for _, name := range []string{"orchestrator", "lease", "health"} {
		t.Run(name, func(t *testing.T) {
			ref := load(t, name, version)
			dsn := pgtest.NewDatabase(t, pgtest.Template{Name: "empty", Fingerprint: "none",
				Migrate: func(context.Context, string) error { return nil }})
			out, err := podman(t, append(hardened, "--network=host", "-e", "EGRESS_DATABASE_URL="+dsn, ref, "migrate")...)
			if err != nil || !strings.Contains(out, "migrations applied") {
				t.Fatalf("%s migrate: %v\n%s", name, err, out)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			conn, err := pgx.Connect(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			var tables int
			if err := conn.QueryRow(ctx, "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1", name).Scan(&tables); err != nil || tables == 0 {
				t.Errorf("schema %s has %d tables after the image's migrate (%v)", name, tables, err)
			}
		})
	}
}

// TestProvisionerLocalReady runs the provisioner-local image as the chart
// does (read-only root, providers config mounted, /tmp an emptyDir) against
// a real NATS server and waits for /readyz to answer 200.
func TestProvisionerLocalReady(t *testing.T) {
	_, version := images(t)
	ref := load(t, "provisioner-local", version)
	ns := natstest.New(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "providers.yaml")
	if err := os.WriteFile(cfg, []byte("providers:\n  - name: local\n    type: local\n    local:\n      stateDir: /tmp/local\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	// Provisioners take calls only with a service token, as in the chart.
	tokens := filepath.Join(dir, "tokens")
	if err := os.WriteFile(tokens, []byte("suite image-test-token service\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	grpcPort, httpPort := freePort(t), freePort(t)
	name := fmt.Sprintf("egress-image-test-%d", time.Now().UnixNano())
	// Not --rm: the logs of a container that exits are what says why.
	args := slices.DeleteFunc(slices.Clone(hardened), func(a string) bool { return a == "--rm" })
	args = append(args, "-d", "--name", name, "--network=host", "-v", cfg+":/etc/egress/providers.yaml:ro",
		"-v", tokens+":/etc/egress/tokens:ro", "-e", "EGRESS_AUTH_TOKEN_FILE=/etc/egress/tokens",
		"-e", "EGRESS_PROVIDERS_CONFIG=/etc/egress/providers.yaml", "-e", "EGRESS_PROVIDER=local",
		"-e", "EGRESS_NATS_URL="+ns.URL(), "-e", fmt.Sprintf("EGRESS_GRPC_LISTEN=127.0.0.1:%d", grpcPort),
		"-e", fmt.Sprintf("EGRESS_HTTP_LISTEN=127.0.0.1:%d", httpPort), ref)
	if out, err := podman(t, args...); err != nil {
		t.Fatalf("run: %v %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := podman(t, "rm", "-f", "-t", "10", name); err != nil {
			t.Logf("rm: %v %s", err, out)
		}
	})
	url := fmt.Sprintf("http://127.0.0.1:%d/readyz", httpPort)
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return
			}
		}
		if time.Now().After(deadline) {
			logs, _ := podman(t, "logs", name)
			t.Fatalf("%s not 200 within 60s (last: %v)\n%s", url, err, logs)
		}
		time.Sleep(200 * time.Millisecond) // polling an external process; no event to wait on
	}
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
