package proxmox

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
)

// Check checks every configured node concurrently; one target per node,
// in config order.
func (be *Backend) Check(ctx context.Context) []*provisionerv1.TargetStatus {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, be.b.Check)
		defer cancel()
	}
	out := make([]*provisionerv1.TargetStatus, len(be.cfg.Nodes))
	var wg sync.WaitGroup
	for i, n := range be.cfg.Nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i] = be.checkNode(ctx, n)
		}()
	}
	wg.Wait()
	return out
}

type checkFailure struct {
	reason string
	err    error
}

func (f *checkFailure) Error() string { return f.err.Error() }

func (be *Backend) checkNode(ctx context.Context, node string) *provisionerv1.TargetStatus {
	start := time.Now()
	ts := &provisionerv1.TargetStatus{Name: node, Address: be.cfg.URL, Details: map[string]string{"isoStorage": be.cfg.ISOStorage}}
	err := be.checkSteps(ctx, node, ts.Details)
	ts.Latency = durationpb.New(time.Since(start))
	if err == nil {
		ts.Ready, ts.Reason = true, provisioner.ReasonReachable
	} else {
		ts.Reason = reasonOf(ctx, err)
		ts.Message = err.Error()
	}
	be.log.DebugContext(ctx, "proxmox node checked", "node", node, "ready", ts.Ready, "reason", ts.Reason, "latency", time.Since(start))
	return ts
}

func (be *Backend) checkSteps(ctx context.Context, node string, details map[string]string) error {
	tok, err := be.c.token()
	if err != nil {
		return &checkFailure{provisioner.ReasonCredentialsUnavailable, err}
	}
	details["tokenID"] = tokenID(tok)

	var version map[string]any
	if err := be.c.do(ctx, call{name: "Version", method: http.MethodGet, path: "/version"}, &version); err != nil {
		return err
	}
	details["pveVersion"] = str(version["version"])

	var ns map[string]any
	if err := be.c.do(ctx, call{name: "NodeStatus", method: http.MethodGet, path: "/nodes/" + url.PathEscape(node) + "/status", attrs: []any{"node", node}}, &ns); err != nil {
		return err
	}
	details["kernel"] = str(ns["kversion"])

	var ss map[string]any
	err = be.c.do(ctx, call{name: "StorageStatus", method: http.MethodGet, path: "/nodes/" + url.PathEscape(node) + "/storage/" + url.PathEscape(be.cfg.ISOStorage) + "/status",
		attrs: []any{"node", node, "storage", be.cfg.ISOStorage}}, &ss)
	if err != nil {
		// Proxmox VE has answered 500 for a missing storage, and its
		// sources give 400 `No such storage.`: both mean the same here.
		if s := apiStatus(err); s == 500 || (s == 400 && strings.Contains(errorsText(err), "storage")) {
			return &checkFailure{provisioner.ReasonStorageNotFound, err}
		}
		return err
	}
	avail := num(ss["avail"])
	details["isoStorageAvailGiB"] = strconv.FormatFloat(float64(avail)/(1<<30), 'f', 1, 64)
	if num(ss["active"]) != 1 {
		return &checkFailure{provisioner.ReasonStorageNotFound, fmt.Errorf("storage %s on node %s is not active", be.cfg.ISOStorage, node)}
	}
	if !hasContent(str(ss["content"]), "iso") {
		return &checkFailure{provisioner.ReasonStorageNotFound, fmt.Errorf("storage %s on node %s holds no iso content (content: %s)", be.cfg.ISOStorage, node, str(ss["content"]))}
	}

	res, err := be.resources(ctx)
	if err != nil {
		return err
	}
	byID := map[int]resource{}
	for _, r := range res {
		byID[r.VMID] = r
	}
	found := 0
	var missing, unreadable []string
	for _, k := range sortedKeys(be.cfg.Templates) {
		t := be.cfg.Templates[k]
		// A node that does not answer lists its VMs as status unknown
		// without the template flag: that says nothing about the
		// template, only that its node cannot be reached.
		if r, ok := byID[t.VMID]; ok && r.Status == "unknown" {
			unreadable = append(unreadable, fmt.Sprintf("%s (VM %d is on node %s, which does not answer)", k, t.VMID, r.Node))
		} else if ok && r.Template {
			found++
		} else if ok {
			missing = append(missing, fmt.Sprintf("%s (VM %d is not a template)", k, t.VMID))
		} else {
			missing = append(missing, fmt.Sprintf("%s (VM %d does not exist)", k, t.VMID))
		}
	}
	details["templates"] = fmt.Sprintf("%d/%d", found, len(be.cfg.Templates))
	if len(missing) > 0 {
		if len(unreadable) > 0 {
			missing = append(missing, unreadable...)
		}
		return &checkFailure{provisioner.ReasonTemplateNotFound, fmt.Errorf("templates not found: %s", strings.Join(missing, ", "))}
	}
	if len(unreadable) > 0 {
		return &checkFailure{provisioner.ReasonUnreachable, fmt.Errorf("templates unreachable: %s", strings.Join(unreadable, ", "))}
	}
	return nil
}

// reasonOf maps a check failure to the health table.
func reasonOf(ctx context.Context, err error) string {
	var cf *checkFailure
	if errors.As(err, &cf) {
		return cf.reason
	}
	if errors.Is(err, errCA) {
		return provisioner.ReasonCertificateInvalid
	}
	if errors.Is(err, errCredentials) {
		return provisioner.ReasonCredentialsUnavailable
	}
	if isTLSVerify(err) {
		return provisioner.ReasonCertificateInvalid
	}
	switch s := apiStatus(err); {
	case s == 401:
		return provisioner.ReasonUnauthorized
	case s == 403:
		return provisioner.ReasonForbidden
	case s == 595 || s == 596:
		return provisioner.ReasonUnreachable
	case s != 0:
		return provisioner.ReasonAPIError
	}
	if ctx.Err() != nil || isTimeout(err) {
		return provisioner.ReasonTimeout
	}
	var te *transportError
	if errors.As(err, &te) {
		return provisioner.ReasonUnreachable
	}
	if errclass.Of(err) == errclass.Transient && strings.Contains(err.Error(), "connection") {
		return provisioner.ReasonUnreachable
	}
	return provisioner.ReasonAPIError
}

func hasContent(content, want string) bool {
	for _, c := range strings.Split(content, ",") {
		if strings.TrimSpace(c) == want {
			return true
		}
	}
	return false
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sortStrings(out)
	return out
}
