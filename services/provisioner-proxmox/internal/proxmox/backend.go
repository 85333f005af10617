package proxmox

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"time"

	"go.opentelemetry.io/otel/trace"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
)

// Backend is the Proxmox backend.
type Backend struct {
	name string // provider name
	cfg  Config
	b    Budgets
	c    *client
	log  *slog.Logger
	now  func() time.Time
}

// Options adjust a Backend (tests shorten the budgets).
type Options struct {
	Budgets *Budgets
	Now     func() time.Time
	// TracerProvider traces the API requests (the global one by default).
	TracerProvider trace.TracerProvider
}

// FromProvider decodes the provider's proxmox block and builds the backend.
func FromProvider(p providers.Provider, log *slog.Logger, opts Options) (*Backend, error) {
	var cfg Config
	if err := p.DecodeBackend(&cfg); err != nil {
		return nil, err
	}
	return New(p.Name, cfg, log, opts)
}

// New validates cfg and builds the backend. It makes no request; it logs a
// WARNING when the token file is not readable and when TLS verification is
// off.
func New(provider string, cfg Config, log *slog.Logger, opts Options) (*Backend, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("proxmox: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("backend", "proxmox")
	b := DefaultBudgets(time.Duration(cfg.RequestTimeoutSeconds) * time.Second)
	if opts.Budgets != nil {
		b = *opts.Budgets
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	be := &Backend{name: provider, cfg: cfg, b: b, log: log, now: now,
		c: &client{base: cfg.URL + "/api2/json", tokenFile: cfg.TokenFile, caFile: cfg.CAFile, insecure: cfg.InsecureSkipTLSVerify, budgets: b, log: log, tp: opts.TracerProvider}}
	if f, err := os.Open(cfg.TokenFile); err == nil {
		_ = f.Close()
	} else {
		reason := err.Error()
		var pe *fs.PathError
		if errors.As(err, &pe) {
			reason = pe.Err.Error()
		}
		log.Warn("WARNING: token file is not readable; every call fails until it is", "path", cfg.TokenFile, "reason", reason)
	}
	if cfg.InsecureSkipTLSVerify {
		log.Warn("WARNING: insecureSkipTLSVerify is set", "url", cfg.URL)
	}
	return be, nil
}

// ---- names, VMIDs and the mark ----

const (
	markManaged   = "proxy-operator-managed"
	markUID       = "proxy-operator-uid"
	markCreatedAt = "proxy-operator-created-at"
	// markInstallation names the installation (pkg/installation); a mark
	// written before installations has none.
	markInstallation = "proxy-operator-installation"
	tag              = "proxy_operator"
	namePrefix       = "proxy-"
)

var nonName = regexp.MustCompile(`[^a-z0-9-]+`)

// instanceName is the proxy's deterministic VM name: proxy-<uid>, a DNS
// label.
func instanceName(uid string) (string, error) {
	n := namePrefix + strings.Trim(nonName.ReplaceAllString(strings.ToLower(uid), "-"), "-")
	if len(n) > 63 {
		n = strings.TrimRight(n[:63], "-")
	}
	if n == namePrefix {
		return "", errclass.New(errclass.Permanent, "proxy UID %q yields no VM name", uid)
	}
	return n, nil
}

// vmidFor is the probe-th candidate VMID of uid: an FNV-1a hash of the UID
// placed in the range, moving forward one at a time.
func vmidFor(uid string, r VMIDRange, probe int) int {
	h := fnv.New32a()
	_, _ = h.Write([]byte(uid))
	size := uint64(r.Max - r.Min + 1)
	return r.Min + int((uint64(h.Sum32())+uint64(probe))%size)
}

// maxProbes bounds the VMID search.
const maxProbes = 32

type mark struct {
	managed      bool
	uid          string
	createdAt    time.Time
	installation string
}

func markLines(uid, installation string, created time.Time) string {
	s := fmt.Sprintf("%s=true\n%s=%s\n%s=%s\n", markManaged, markUID, uid, markCreatedAt, created.UTC().Format(time.RFC3339))
	if installation != "" {
		s += markInstallation + "=" + installation + "\n"
	}
	return s
}

// foreignInstallation reports whether a mark names an installation other
// than the request's: such a VM is another installation's and is left
// alone. A mark naming none is the proxy's to claim.
func (m mark) foreignInstallation(installation string) bool {
	return m.installation != "" && m.installation != installation
}

// parseMark reads the mark from a description; other lines are ignored.
func parseMark(desc string) mark {
	var m mark
	for _, line := range strings.Split(desc, "\n") {
		k, v, ok := strings.Cut(strings.TrimSpace(line), "=")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case markManaged:
			m.managed = strings.TrimSpace(v) == "true"
		case markUID:
			m.uid = strings.TrimSpace(v)
		case markCreatedAt:
			m.createdAt, _ = time.Parse(time.RFC3339, strings.TrimSpace(v))
		case markInstallation:
			m.installation = strings.TrimSpace(v)
		}
	}
	return m
}

// providerID is vms/<vmid>/<name>.
func providerID(vmid int, name string) string { return fmt.Sprintf("vms/%d/%s", vmid, name) }

func parseProviderID(id string) (int, string, error) {
	parts := strings.Split(id, "/")
	if len(parts) == 3 && parts[0] == "vms" && parts[2] != "" {
		if n, err := strconv.Atoi(parts[1]); err == nil && n >= 100 {
			return n, parts[2], nil
		}
	}
	return 0, "", errclass.New(errclass.Permanent, "providerID %q is not vms/<vmid>/<name>", id)
}

// ---- the API seam ----

type resource struct {
	VMID     int
	Name     string
	Node     string
	Status   string
	Template bool
	Lock     string
	Tags     string
}

func (be *Backend) resources(ctx context.Context) ([]resource, error) {
	var raw []map[string]any
	err := be.c.do(ctx, call{name: "Resources", method: http.MethodGet, path: "/cluster/resources", form: url.Values{"type": {"vm"}}}, &raw)
	if err != nil {
		return nil, err
	}
	out := make([]resource, 0, len(raw))
	for _, r := range raw {
		if t := str(r["type"]); t != "" && t != "qemu" {
			continue
		}
		out = append(out, resource{
			VMID: int(num(r["vmid"])), Name: str(r["name"]), Node: str(r["node"]), Status: str(r["status"]),
			Template: num(r["template"]) == 1, Lock: str(r["lock"]), Tags: str(r["tags"]),
		})
	}
	return out, nil
}

func vmPath(node string, vmid int) string {
	return "/nodes/" + url.PathEscape(node) + "/qemu/" + strconv.Itoa(vmid)
}

func (be *Backend) config(ctx context.Context, node string, vmid int) (map[string]string, error) {
	var raw map[string]any
	err := be.c.do(ctx, call{name: "Config", method: http.MethodGet, path: vmPath(node, vmid) + "/config", attrs: []any{"node", node, "vmid", vmid}}, &raw)
	if err != nil {
		return nil, err
	}
	out := make(map[string]string, len(raw))
	for k, v := range raw {
		out[k] = str(v)
	}
	if be.log.Enabled(ctx, LevelTrace) {
		be.log.Log(ctx, LevelTrace, "proxmox api call", "call", "Config", "node", node, "vmid", vmid,
			"name", out["name"], "lock", out["lock"], "template", out["template"], "net0", out["net0"], "boot", out["boot"])
	}
	return out, nil
}

type vmStatus struct {
	Status, QMP, Lock string
}

func (be *Backend) status(ctx context.Context, node string, vmid int) (vmStatus, error) {
	var raw map[string]any
	err := be.c.do(ctx, call{name: "Status", method: http.MethodGet, path: vmPath(node, vmid) + "/status/current", attrs: []any{"node", node, "vmid", vmid}}, &raw)
	if err != nil {
		return vmStatus{}, err
	}
	st := vmStatus{Status: str(raw["status"]), QMP: str(raw["qmpstatus"]), Lock: str(raw["lock"])}
	be.log.Log(ctx, LevelTrace, "proxmox api call", "call", "Status", "node", node, "vmid", vmid, "status", st.Status, "qmpstatus", st.QMP, "lock", st.Lock)
	return st, nil
}

// task starts a task with one request and waits for it within budget.
func (be *Backend) task(ctx context.Context, cl call, node string, budget time.Duration) error {
	var upid string
	if err := be.c.do(ctx, cl, &upid); err != nil {
		return err
	}
	return be.waitTask(ctx, node, upid, budget)
}

// waitTask polls a task until it stops. OK and WARNINGS: <n> are success;
// any other exitstatus, or the budget running out, is a TaskError.
func (be *Backend) waitTask(ctx context.Context, node, upid string, budget time.Duration) error {
	parent := ctx
	ctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	timedOut := func() error {
		if err := parent.Err(); err != nil {
			return fmt.Errorf("waiting for task %s: %w", upid, err)
		}
		return &TaskError{UPID: upid, TimedOut: true}
	}
	for {
		var st map[string]any
		err := be.c.do(ctx, call{name: "TaskStatus", method: http.MethodGet, path: "/nodes/" + url.PathEscape(node) + "/tasks/" + url.PathEscape(upid) + "/status",
			attrs: []any{"node", node, "upid", upid}}, &st)
		if err == nil {
			be.log.Log(ctx, LevelTrace, "proxmox api call", "call", "TaskStatus", "node", node, "upid", upid, "status", str(st["status"]), "exitstatus", str(st["exitstatus"]))
		}
		switch {
		case err == nil && str(st["status"]) == "stopped":
			exit := str(st["exitstatus"])
			if exit == "OK" {
				return nil
			}
			if strings.HasPrefix(exit, "WARNINGS") {
				be.log.DebugContext(ctx, "proxmox task finished with warnings", "upid", upid, "exitstatus", exit)
				return nil
			}
			be.log.DebugContext(ctx, "proxmox task failed", "upid", upid, "exitstatus", exit)
			return &TaskError{UPID: upid, ExitStatus: exit}
		case err == nil:
		case apiStatus(err) == 400 && strings.Contains(errorsText(err), "no such task"):
			// Right after a task starts its status may not exist yet.
		case ctx.Err() != nil:
			return timedOut()
		default:
			return err
		}
		t := time.NewTimer(be.b.Poll)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return timedOut()
		}
	}
}

func errorsText(err error) string {
	var ae *APIError
	if errors.As(err, &ae) {
		var parts []string
		for k, v := range ae.Errors {
			parts = append(parts, k+": "+v)
		}
		sort.Strings(parts)
		return strings.Join(parts, "; ")
	}
	return ""
}

// Close releases idle connections.
func (be *Backend) Close() { be.c.closeIdle() }
