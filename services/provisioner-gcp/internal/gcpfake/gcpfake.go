// Package gcpfake is a fake of the Compute Engine REST API (v1) for the
// calls provisioner-gcp makes: instance insert, get and delete, the
// aggregated instance list and zone operations. It answers with the real
// JSON shapes (protojson of the API's own messages, so camelCase and
// quoted int64s) and the real error bodies, runs inserts and deletes as
// asynchronous operations, and can fail the way Compute fails: quota and
// zone capacity inside an operation, synchronous errors, unreachable zones
// in aggregated lists.
//
// Time does not move anything: an operation advances one step
// (PENDING → RUNNING → DONE) each time it or its instance is read, and an
// instance one status (PROVISIONING → STAGING → RUNNING) each time it is
// read, so tests are deterministic.
package gcpfake

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"cloud.google.com/go/compute/apiv1/computepb"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// Options configure a fake.
type Options struct {
	// Project is the only project that exists.
	Project string
	// Zones exist (the aggregated list carries a scope for each).
	Zones []string
	// QuotaZones fail every insert asynchronously with QUOTA_EXCEEDED.
	QuotaZones []string
	// ExhaustedZones fail every insert asynchronously with
	// ZONE_RESOURCE_POOL_EXHAUSTED.
	ExhaustedZones []string
	// UnreachableZones do not answer aggregated lists.
	UnreachableZones []string
}

// Request is one request the fake received.
type Request struct {
	Method, Path string
	Query        map[string][]string
	Body         []byte
	Header       http.Header
}

// Fault makes matching requests fail synchronously.
type Fault struct {
	Method       string // empty: any
	PathContains string
	Code         int
	Reason       string
	Message      string
	// Times is how many requests fail; 0 means every one.
	Times int
}

// Fake is the fake API; it is an http.Handler.
type Fake struct {
	opts Options

	mu        sync.Mutex
	instances map[string]*computepb.Instance // zone/name
	ops       map[string]*op                 // zone/opname
	pending   map[string]string              // zone/name → zone/opname of its running operation
	faults    []*Fault
	requests  []Request
	seq       int
}

type op struct {
	proto *computepb.Operation
	// apply runs when the operation reaches DONE.
	apply func()
}

// New returns a fake.
func New(opts Options) *Fake {
	return &Fake{opts: opts, instances: map[string]*computepb.Instance{}, ops: map[string]*op{}, pending: map[string]string{}}
}

// Inject adds a fault.
func (f *Fake) Inject(fl Fault) {
	f.mu.Lock()
	defer f.mu.Unlock()
	c := fl
	f.faults = append(f.faults, &c)
}

// Requests returns the requests received so far.
func (f *Fake) Requests() []Request {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]Request(nil), f.requests...)
}

// Put stores an instance as it is (for tests that need one in place).
func (f *Fake) Put(zone string, inst *computepb.Instance) {
	f.mu.Lock()
	defer f.mu.Unlock()
	inst = proto.Clone(inst).(*computepb.Instance)
	inst.Zone = proto.String(f.zoneURL(zone))
	inst.SelfLink = proto.String(f.zoneURL(zone) + "/instances/" + inst.GetName())
	if inst.LabelFingerprint == nil {
		inst.LabelFingerprint = proto.String(labelFingerprint(inst.GetLabels()))
	}
	f.instances[zone+"/"+inst.GetName()] = inst
}

// Instance returns a copy of the instance, or nil.
func (f *Fake) Instance(zone, name string) *computepb.Instance {
	f.mu.Lock()
	defer f.mu.Unlock()
	if in, ok := f.instances[zone+"/"+name]; ok {
		return proto.Clone(in).(*computepb.Instance)
	}
	return nil
}

// Instances counts the instances that exist.
func (f *Fake) Instances() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.instances)
}

const apiBase = "https://www.googleapis.com/compute/v1"

func (f *Fake) zoneURL(zone string) string {
	return apiBase + "/projects/" + f.opts.Project + "/zones/" + zone
}

var (
	instancesRE  = regexp.MustCompile(`^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances$`)
	instanceRE   = regexp.MustCompile(`^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)$`)
	startRE      = regexp.MustCompile(`^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)/start$`)
	setLabelsRE  = regexp.MustCompile(`^/compute/v1/projects/([^/]+)/zones/([^/]+)/instances/([^/]+)/setLabels$`)
	operationRE  = regexp.MustCompile(`^/compute/v1/projects/([^/]+)/zones/([^/]+)/operations/([^/]+)$`)
	aggregatedRE = regexp.MustCompile(`^/compute/v1/projects/([^/]+)/aggregated/instances$`)
	nameRE       = regexp.MustCompile(`^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$`)
	filterRE     = regexp.MustCompile(`^labels\.([a-z][a-z0-9_-]*)\s*=\s*"?([a-z0-9_-]*)"?$`)
)

func (f *Fake) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, Request{Method: r.Method, Path: r.URL.Path, Query: r.URL.Query(), Body: body, Header: r.Header.Clone()})
	for i, fl := range f.faults {
		if (fl.Method == "" || fl.Method == r.Method) && strings.Contains(r.URL.Path, fl.PathContains) {
			if fl.Times > 0 {
				fl.Times--
				if fl.Times == 0 {
					f.faults = append(f.faults[:i:i], f.faults[i+1:]...)
				}
			}
			writeError(w, fl.Code, fl.Reason, fl.Message)
			return
		}
	}
	p := r.URL.Path
	switch m := instancesRE.FindStringSubmatch(p); {
	case m != nil && r.Method == http.MethodPost:
		if f.project(w, m[1]) && f.zone(w, m[2]) {
			f.insert(w, m[2], body)
		}
		return
	}
	if m := instanceRE.FindStringSubmatch(p); m != nil {
		if !f.project(w, m[1]) || !f.zone(w, m[2]) {
			return
		}
		switch r.Method {
		case http.MethodGet:
			f.get(w, m[2], m[3])
		case http.MethodDelete:
			f.delete(w, m[2], m[3])
		default:
			writeError(w, http.StatusMethodNotAllowed, "methodNotAllowed", "Method not allowed")
		}
		return
	}
	if m := startRE.FindStringSubmatch(p); m != nil && r.Method == http.MethodPost {
		if f.project(w, m[1]) && f.zone(w, m[2]) {
			f.start(w, m[2], m[3])
		}
		return
	}
	if m := setLabelsRE.FindStringSubmatch(p); m != nil && r.Method == http.MethodPost {
		if f.project(w, m[1]) && f.zone(w, m[2]) {
			f.setLabels(w, m[2], m[3], body)
		}
		return
	}
	if m := operationRE.FindStringSubmatch(p); m != nil && r.Method == http.MethodGet {
		if f.project(w, m[1]) && f.zone(w, m[2]) {
			f.getOperation(w, m[2], m[3])
		}
		return
	}
	if m := aggregatedRE.FindStringSubmatch(p); m != nil && r.Method == http.MethodGet {
		if f.project(w, m[1]) {
			f.aggregated(w, r)
		}
		return
	}
	writeError(w, http.StatusNotFound, "notFound", "The requested URL "+p+" was not found on this server.")
}

func (f *Fake) project(w http.ResponseWriter, p string) bool {
	if p != f.opts.Project {
		writeError(w, http.StatusNotFound, "notFound", fmt.Sprintf("The resource 'projects/%s' was not found", p))
		return false
	}
	return true
}

func (f *Fake) zone(w http.ResponseWriter, z string) bool {
	for _, x := range f.opts.Zones {
		if x == z {
			return true
		}
	}
	writeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("Invalid value for field 'zone': '%s'. Unknown zone.", z))
	return false
}

func (f *Fake) insert(w http.ResponseWriter, zone string, body []byte) {
	var in computepb.Instance
	if err := protojson.Unmarshal(body, &in); err != nil {
		writeError(w, http.StatusBadRequest, "parseError", "Invalid JSON payload received. "+err.Error())
		return
	}
	name := in.GetName()
	res := fmt.Sprintf("projects/%s/zones/%s/instances/%s", f.opts.Project, zone, name)
	if msg := f.invalidInstance(zone, &in); msg != "" {
		writeError(w, http.StatusBadRequest, "invalid", msg)
		return
	}
	key := zone + "/" + name
	if _, ok := f.instances[key]; ok {
		writeError(w, http.StatusConflict, "alreadyExists", fmt.Sprintf("The resource '%s' already exists", res))
		return
	}
	o := f.newOp(zone, "insert", name)
	switch {
	case contains(f.opts.QuotaZones, zone):
		region := zone[:strings.LastIndexByte(zone, '-')]
		o.apply = func() {
			o.proto.HttpErrorStatusCode = proto.Int32(403)
			o.proto.HttpErrorMessage = proto.String("FORBIDDEN")
			o.proto.Error = &computepb.Error{Errors: []*computepb.Errors{{
				Code:    proto.String("QUOTA_EXCEEDED"),
				Message: proto.String(fmt.Sprintf("Quota 'CPUS' exceeded.  Limit: 24.0 in region %s.", region)),
			}}}
		}
	case contains(f.opts.ExhaustedZones, zone):
		o.apply = func() {
			o.proto.HttpErrorStatusCode = proto.Int32(503)
			o.proto.HttpErrorMessage = proto.String("SERVICE UNAVAILABLE")
			o.proto.Error = &computepb.Error{Errors: []*computepb.Errors{{
				Code: proto.String("ZONE_RESOURCE_POOL_EXHAUSTED"),
				Message: proto.String(fmt.Sprintf("The zone 'projects/%s/zones/%s' does not have enough resources available to fulfill the request.  Try a different zone, or try again later.",
					f.opts.Project, zone)),
			}}}
		}
	default:
		f.seq++
		inst := proto.Clone(&in).(*computepb.Instance)
		inst.Kind = proto.String("compute#instance")
		inst.Id = proto.Uint64(uint64(4_000_000_000_000_000 + f.seq))
		inst.Status = proto.String("PROVISIONING")
		inst.Zone = proto.String(f.zoneURL(zone))
		inst.SelfLink = proto.String(f.zoneURL(zone) + "/instances/" + name)
		inst.CreationTimestamp = proto.String(time.Now().Format("2006-01-02T15:04:05.000-07:00"))
		inst.MachineType = proto.String(apiBase + "/projects/" + f.opts.Project + "/" + inst.GetMachineType())
		inst.Fingerprint = proto.String("x1Ef3bWcZ0E=")
		inst.LabelFingerprint = proto.String(labelFingerprint(inst.GetLabels()))
		for i, nic := range inst.GetNetworkInterfaces() {
			nic.Name = proto.String(fmt.Sprintf("nic%d", i))
			nic.NetworkIP = proto.String(fmt.Sprintf("10.128.%d.%d", f.seq/250, f.seq%250+2))
			for _, ac := range nic.GetAccessConfigs() {
				ac.Kind = proto.String("compute#accessConfig")
				ac.NatIP = proto.String(fmt.Sprintf("203.0.%d.%d", 113+f.seq/250, f.seq%250+2))
			}
		}
		f.instances[key] = inst
		f.pending[key] = zone + "/" + o.proto.GetName()
		o.apply = func() { delete(f.pending, key) }
	}
	writeProto(w, o.proto)
}

// invalidInstance checks what Compute checks before accepting an insert.
func (f *Fake) invalidInstance(zone string, in *computepb.Instance) string {
	switch {
	case !nameRE.MatchString(in.GetName()):
		return fmt.Sprintf("Invalid value for field 'resource.name': '%s'. Must be a match of regex '(?:[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)'", in.GetName())
	case !strings.HasPrefix(in.GetMachineType(), "zones/"+zone+"/machineTypes/"):
		return fmt.Sprintf("Invalid value for field 'resource.machineType': '%s'. Machine type must be in zone %s.", in.GetMachineType(), zone)
	case len(in.GetDisks()) == 0 || !in.GetDisks()[0].GetBoot():
		return "Invalid value for field 'resource.disks': ''. Boot disk must be specified."
	case len(in.GetNetworkInterfaces()) == 0:
		return "Invalid value for field 'resource.networkInterfaces': ''. At least one network interface is required."
	}
	for k, v := range in.GetLabels() {
		if len(k) > 63 || len(v) > 63 {
			return fmt.Sprintf("Invalid value for field 'resource.labels': '%s'. Label keys and values must be at most 63 characters.", k)
		}
	}
	return ""
}

func (f *Fake) newOp(zone, typ, target string) *op {
	f.seq++
	name := fmt.Sprintf("operation-%d-%08x-%08x", time.Now().UnixMilli(), f.seq, f.seq*2654435761%0xffffffff)
	o := &op{proto: &computepb.Operation{
		Kind:          proto.String("compute#operation"),
		Id:            proto.Uint64(uint64(7_000_000_000_000_000 + f.seq)),
		Name:          proto.String(name),
		Zone:          proto.String(f.zoneURL(zone)),
		OperationType: proto.String(typ),
		TargetLink:    proto.String(f.zoneURL(zone) + "/instances/" + target),
		Status:        computepb.Operation_PENDING.Enum(),
		Progress:      proto.Int32(0),
		InsertTime:    proto.String(time.Now().Format("2006-01-02T15:04:05.000-07:00")),
		User:          proto.String("provisioner@" + f.opts.Project + ".iam.gserviceaccount.com"),
		SelfLink:      proto.String(f.zoneURL(zone) + "/operations/" + name),
	}}
	f.ops[zone+"/"+name] = o
	return o
}

// advance moves an operation one step; at DONE its effect applies.
func (o *op) advance() {
	switch o.proto.GetStatus() {
	case computepb.Operation_PENDING:
		o.proto.Status = computepb.Operation_RUNNING.Enum()
		o.proto.StartTime = proto.String(time.Now().Format("2006-01-02T15:04:05.000-07:00"))
	case computepb.Operation_RUNNING:
		o.proto.Status = computepb.Operation_DONE.Enum()
		o.proto.Progress = proto.Int32(100)
		o.proto.EndTime = proto.String(time.Now().Format("2006-01-02T15:04:05.000-07:00"))
		if o.apply != nil {
			o.apply()
		}
	}
}

func (f *Fake) getOperation(w http.ResponseWriter, zone, name string) {
	o, ok := f.ops[zone+"/"+name]
	if !ok {
		writeError(w, http.StatusNotFound, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/operations/%s' was not found", f.opts.Project, zone, name))
		return
	}
	o.advance()
	writeProto(w, o.proto)
}

var nextStatus = map[string]string{"PROVISIONING": "STAGING", "STAGING": "RUNNING"}

func (f *Fake) get(w http.ResponseWriter, zone, name string) {
	key := zone + "/" + name
	if opKey, ok := f.pending[key]; ok {
		f.ops[opKey].advance()
	}
	in, ok := f.instances[key]
	if !ok {
		writeError(w, http.StatusNotFound, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.opts.Project, zone, name))
		return
	}
	writeProto(w, in)
	if n, ok := nextStatus[in.GetStatus()]; ok {
		in.Status = proto.String(n)
	}
}

func (f *Fake) delete(w http.ResponseWriter, zone, name string) {
	key := zone + "/" + name
	in, ok := f.instances[key]
	if !ok {
		writeError(w, http.StatusNotFound, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.opts.Project, zone, name))
		return
	}
	in.Status = proto.String("STOPPING")
	o := f.newOp(zone, "delete", name)
	f.pending[key] = zone + "/" + o.proto.GetName()
	o.apply = func() {
		delete(f.instances, key)
		delete(f.pending, key)
	}
	writeProto(w, o.proto)
}

// labelFingerprint is an instance's label fingerprint: it changes with
// its labels.
func labelFingerprint(labels map[string]string) string {
	keys := make([]string, 0, len(labels))
	for k := range labels {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	h := sha256.New()
	for _, k := range keys {
		fmt.Fprintf(h, "%s=%s;", k, labels[k])
	}
	return base64.StdEncoding.EncodeToString(h.Sum(nil)[:8])
}

// setLabels replaces an instance's labels, as Compute does: the request's
// labelFingerprint must be the instance's (else 412 conditionNotMet), and
// the labels apply when the operation is done.
func (f *Fake) setLabels(w http.ResponseWriter, zone, name string, body []byte) {
	key := zone + "/" + name
	in, ok := f.instances[key]
	if !ok {
		writeError(w, http.StatusNotFound, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.opts.Project, zone, name))
		return
	}
	var req computepb.InstancesSetLabelsRequest
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(body, &req); err != nil {
		writeError(w, http.StatusBadRequest, "parseError", "Parse Error")
		return
	}
	want := in.GetLabelFingerprint()
	if want == "" {
		want = labelFingerprint(in.GetLabels())
	}
	if req.GetLabelFingerprint() != want {
		writeError(w, http.StatusPreconditionFailed, "conditionNotMet",
			"Labels fingerprint either invalid or resource labels have changed")
		return
	}
	o := f.newOp(zone, "setLabels", name)
	labels := req.GetLabels()
	o.apply = func() {
		if cur, ok := f.instances[key]; ok {
			cur.Labels = labels
			cur.LabelFingerprint = proto.String(labelFingerprint(labels))
		}
	}
	writeProto(w, o.proto)
}

// start starts a TERMINATED instance (STAGING, then RUNNING as Get
// reads it); a running one is left as it is, with a done operation, and
// one in transition is refused resourceNotReady, as Compute does.
func (f *Fake) start(w http.ResponseWriter, zone, name string) {
	key := zone + "/" + name
	in, ok := f.instances[key]
	if !ok {
		writeError(w, http.StatusNotFound, "notFound", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' was not found", f.opts.Project, zone, name))
		return
	}
	switch in.GetStatus() {
	case "TERMINATED", "RUNNING", "STAGING", "PROVISIONING":
	default:
		writeError(w, http.StatusBadRequest, "resourceNotReady", fmt.Sprintf("The resource 'projects/%s/zones/%s/instances/%s' is not ready", f.opts.Project, zone, name))
		return
	}
	o := f.newOp(zone, "start", name)
	if in.GetStatus() == "TERMINATED" {
		in.Status = proto.String("STAGING")
	} else {
		o.advance()
		o.advance()
	}
	writeProto(w, o.proto)
}

// aggregated answers an aggregated list: one scope per zone, the matching
// instances paged in (zone, name) order, NO_RESULTS_ON_PAGE for a scope
// with none on the page, and unreachable zones as warnings plus
// "unreachables" with returnPartialSuccess, or a 503 without it.
func (f *Fake) aggregated(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	partial := q.Get("returnPartialSuccess") == "true"
	if len(f.opts.UnreachableZones) > 0 && !partial {
		writeError(w, http.StatusServiceUnavailable, "backendError", "Internal error. Please try again or contact Google Support.")
		return
	}
	var match func(*computepb.Instance) bool
	switch filter := strings.TrimSpace(q.Get("filter")); {
	case filter == "":
		match = func(*computepb.Instance) bool { return true }
	default:
		m := filterRE.FindStringSubmatch(filter)
		if m == nil {
			writeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("Invalid value for field 'filter': '%s'. Invalid list filter expression.", filter))
			return
		}
		match = func(in *computepb.Instance) bool { return in.GetLabels()[m[1]] == m[2] }
	}
	max := 500
	if s := q.Get("maxResults"); s != "" {
		n, err := strconv.Atoi(s)
		if err != nil || n < 0 || n > 500 {
			writeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("Invalid value for field 'maxResults': '%s'. Must be less than or equal to 500", s))
			return
		}
		if n > 0 {
			max = n
		}
	}
	offset := 0
	if t := q.Get("pageToken"); t != "" {
		n, err := strconv.Atoi(strings.TrimPrefix(t, "page-"))
		if err != nil || !strings.HasPrefix(t, "page-") {
			writeError(w, http.StatusBadRequest, "invalid", fmt.Sprintf("Invalid value for field 'pageToken': '%s'.", t))
			return
		}
		offset = n
	}
	keys := make([]string, 0, len(f.instances))
	for k, in := range f.instances {
		zone := k[:strings.IndexByte(k, '/')]
		if !contains(f.opts.UnreachableZones, zone) && match(in) {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	end := min(offset+max, len(keys))
	if offset > len(keys) {
		offset = end
	}
	resp := &computepb.InstanceAggregatedList{
		Kind:     proto.String("compute#instanceAggregatedList"),
		Id:       proto.String("projects/" + f.opts.Project + "/aggregated/instances"),
		Items:    map[string]*computepb.InstancesScopedList{},
		SelfLink: proto.String(apiBase + "/projects/" + f.opts.Project + "/aggregated/instances"),
	}
	for _, k := range keys[offset:end] {
		zone := k[:strings.IndexByte(k, '/')]
		sl := resp.Items["zones/"+zone]
		if sl == nil {
			sl = &computepb.InstancesScopedList{}
			resp.Items["zones/"+zone] = sl
		}
		sl.Instances = append(sl.Instances, f.instances[k])
	}
	for _, z := range f.opts.Zones {
		scope := "zones/" + z
		switch {
		case contains(f.opts.UnreachableZones, z):
			resp.Items[scope] = &computepb.InstancesScopedList{Warning: &computepb.Warning{
				Code:    proto.String("UNREACHABLE"),
				Message: proto.String(fmt.Sprintf("Scope '%s' is unreachable.", scope)),
				Data:    []*computepb.Data{{Key: proto.String("scope"), Value: proto.String(scope)}},
			}}
			resp.Unreachables = append(resp.Unreachables, scope)
		case resp.Items[scope] == nil:
			resp.Items[scope] = &computepb.InstancesScopedList{Warning: &computepb.Warning{
				Code:    proto.String("NO_RESULTS_ON_PAGE"),
				Message: proto.String(fmt.Sprintf("There are no results for scope '%s' on this page.", scope)),
				Data:    []*computepb.Data{{Key: proto.String("scope"), Value: proto.String(scope)}},
			}}
		}
	}
	if end < len(keys) {
		resp.NextPageToken = proto.String(fmt.Sprintf("page-%d", end))
	}
	writeProto(w, resp)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func writeProto(w http.ResponseWriter, m proto.Message) {
	b, err := protojson.Marshal(m)
	if err != nil {
		writeError(w, http.StatusInternalServerError, "backendError", err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	_, _ = w.Write(b)
}

// writeError writes Compute's error body.
func writeError(w http.ResponseWriter, code int, reason, message string) {
	body := map[string]any{"error": map[string]any{
		"code":    code,
		"message": message,
		"errors":  []map[string]string{{"message": message, "domain": "global", "reason": reason}},
	}}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(body)
}
