// Package pvefake is a fake Proxmox VE API server, faithful to the real one
// on the wire for everything the provisioner uses (status codes, bodies and
// error texts as a real Proxmox VE answers them):
//
//   - real TLS with its own CA and a certificate naming 127.0.0.1,
//     localhost and the first node; HTTP/1.1 only;
//   - PVEAPIToken authentication with privileges per token and ACL path
//     (the most specific path with an entry replaces what is inherited);
//     401 `Authentication failed!` / `No ticket` with an empty body, 403
//     `Permission check failed (<path>, <privilege>)`;
//   - errors as pveproxy sends them: the reason phrase is the message, the
//     body {"message":"<text>\n","data":null} (400 carries "errors"), and
//     the connection is closed after an error;
//   - asynchronous tasks with real-format UPIDs and exitstatus, `lock:
//     clone` on the new VM while a clone runs (listed as `VM <vmid>`),
//     cluster/resources, multipart ISO upload, the storage content
//     listing with ctimes, guest-agent answers, 595
//     for a node pveproxy cannot reach;
//   - switches to inject each failure (Inject, FailNextTask, HoldClones,
//     SetNodeDown, SetAgent, ...) and counters of every call.
package pvefake

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"log"
	"math/big"
	"mime"
	"mime/multipart"
	"net"
	"net/http"
	"net/url"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Version is what GET /version answers.
const Version = "9.2.20"

// Options configure a fake.
type Options struct {
	// Nodes are the cluster's node names (default pv1-1).
	Nodes []string
	// ISOStorage is a storage holding iso content on every node (default
	// proxy-seeds).
	ISOStorage string
	// AuthFailDelay delays 401 answers as pveproxy does (about 3s there;
	// zero by default to keep tests fast).
	AuthFailDelay time.Duration
	// Addr is the listen address (default 127.0.0.1:0).
	Addr string
}

// Server is a running fake.
type Server struct {
	// URL is https://127.0.0.1:<port>, without the /api2/json path.
	URL string
	// CAPEM is the PEM of the CA that signed the server's certificate.
	CAPEM []byte

	srv  *http.Server
	lis  net.Listener
	opts Options

	mu        sync.Mutex
	tokens    map[string]*token // by "user@realm!tokenid"
	nodes     map[string]*node
	nodeOrder []string
	vms       map[int]*vm
	tasks     map[string]*task
	taskSeq   int
	faults    []*Fault
	taskFails []taskFail
	holdClone bool
	holdCh    chan struct{}
	calls     map[string]int
	lastForm  map[string]url.Values
	macSeq    int
	ipSeq     int
	cloneWait []chan int
	bodies    int64 // bytes of upload bodies received

	stopOnStart map[int]bool
	taskUnknown int // new tasks answer "no such task" this many times
	taskRunning int // new tasks answer running this many times
}

type token struct {
	secret string
	acl    map[string][]string // path → privileges
}

type node struct {
	name     string
	down     int // 0 up, 595 or 596
	storages map[string]*storage
	kernel   string
}

type storage struct {
	content string
	active  bool
	avail   int64
	files   map[string][]byte // "iso/<name>" → content
	ctimes  map[string]int64  // "iso/<name>" → when it was last written (Unix seconds)
}

// put writes a file, stamping its ctime as a directory storage reports it.
func (st *storage) put(volume string, data []byte, at time.Time) {
	if st.ctimes == nil {
		st.ctimes = map[string]int64{}
	}
	st.files[volume] = data
	st.ctimes[volume] = at.Unix()
}

// VM is a snapshot of one fake VM.
type VM struct {
	VMID     int
	Node     string
	Status   string // running, stopped
	QMP      string // running, paused, stopped, prelaunch
	Template bool
	Config   map[string]string
}

type vm struct {
	VM
	agent    AgentMode
	ip       string
	startsOK bool
}

// AgentMode is how a VM's guest agent answers.
type AgentMode int

// The agent modes.
const (
	// AgentReady answers with an eth0 IPv4 address once the VM runs.
	AgentReady AgentMode = iota
	// AgentNotRunning answers 500 `QEMU guest agent is not running`.
	AgentNotRunning
	// AgentNoAddress answers with lo and a link-local IPv6 only.
	AgentNoAddress
)

type task struct {
	upid       string
	node       string
	kind       string
	user       string
	running    bool
	exit       string
	finish     func() string // runs once when the task ends; returns exitstatus
	held       chan struct{} // the task ends only once this is closed
	unknownFor int           // status answers 400 "no such task" this many times first
	pollsLeft  int           // status answers running this many times first
}

type taskFail struct {
	kind string
	exit string
}

// Fault makes matching requests fail. Zero fields match anything.
type Fault struct {
	Method string
	// Path is a substring of the path after /api2/json.
	Path string
	// Status and Message are the answer (reason phrase = Message). For 400
	// Errors, if set, becomes the "errors" object.
	Status  int
	Message string
	Errors  map[string]string
	// EmptyBody sends no body, as 401s and authentication 403s do.
	EmptyBody bool
	// Delay holds the answer (until the client gives up or Delay passes).
	Delay time.Duration
	// Cut closes the connection without an answer.
	Cut bool
	// Times is how many requests it hits (0: every one).
	Times int
}

// Start runs a fake on a loopback port.
func Start(opts Options) (*Server, error) {
	if len(opts.Nodes) == 0 {
		opts.Nodes = []string{"pv1-1"}
	}
	if opts.ISOStorage == "" {
		opts.ISOStorage = "proxy-seeds"
	}
	s := &Server{
		opts:     opts,
		tokens:   map[string]*token{},
		nodes:    map[string]*node{},
		vms:      map[int]*vm{},
		tasks:    map[string]*task{},
		calls:    map[string]int{},
		lastForm: map[string]url.Values{},
		taskSeq:  0x1a2b0,
	}
	for _, n := range opts.Nodes {
		s.nodeOrder = append(s.nodeOrder, n)
		s.nodes[n] = &node{name: n, kernel: "Linux 6.14.8-2-pve #1 SMP PREEMPT_DYNAMIC PMX 6.14.8-2", storages: map[string]*storage{
			opts.ISOStorage: {content: "iso", active: true, avail: 90 << 30, files: map[string][]byte{}},
			"local":         {content: "iso,vztmpl,backup", active: true, avail: 40 << 30, files: map[string][]byte{}},
			"local-lvm":     {content: "images,rootdir", active: true, avail: 300 << 30, files: map[string][]byte{}},
		}}
	}
	caPEM, cert, err := makeCert(opts.Nodes[0])
	if err != nil {
		return nil, err
	}
	s.CAPEM = caPEM
	addr := opts.Addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, err
	}
	s.lis = tls.NewListener(lis, &tls.Config{Certificates: []tls.Certificate{cert}, NextProtos: []string{"http/1.1"}, MinVersion: tls.VersionTLS12})
	s.URL = "https://" + lis.Addr().String()
	s.srv = &http.Server{
		Handler:           s.routes(),
		ReadHeaderTimeout: 10 * time.Second,
		ErrorLog:          log.New(io.Discard, "", 0),
		TLSNextProto:      map[string]func(*http.Server, *tls.Conn, http.Handler){}, // HTTP/1.1 only, like pveproxy
	}
	go func() { _ = s.srv.Serve(s.lis) }()
	return s, nil
}

// Close stops the server.
func (s *Server) Close() {
	s.mu.Lock()
	if s.holdCh != nil {
		close(s.holdCh)
		s.holdCh = nil
	}
	s.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := s.srv.Shutdown(ctx); err != nil {
		_ = s.srv.Close()
	}
}

func makeCert(nodeName string) ([]byte, tls.Certificate, error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "Proxmox Virtual Environment", OrganizationalUnit: []string{"pvefake"}},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	leafTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: nodeName + ".home.lab"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		DNSNames: []string{nodeName, nodeName + ".home.lab", "localhost"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, tls.Certificate{}, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		tls.Certificate{Certificate: [][]byte{leafDER}, PrivateKey: key}, nil
}

// ---- switches and inspection ----

// AddToken adds an API token with its ACL: path → privileges. The token's
// id is "user@realm!tokenid"; the client sends "<id>=<secret>".
func (s *Server) AddToken(id, secret string, acl map[string][]string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.tokens[id] = &token{secret: secret, acl: acl}
}

// OperatorPrivileges is the documented ProxyOperator role.
var OperatorPrivileges = []string{"VM.Allocate", "VM.Clone", "VM.Audit", "VM.Config.CDROM", "VM.Config.CPU", "VM.Config.Memory", "VM.Config.Disk", "VM.Config.Network", "VM.Config.Options", "VM.PowerMgmt", "VM.GuestAgent.Audit", "Datastore.Audit", "Datastore.AllocateSpace", "Datastore.AllocateTemplate", "Sys.Audit", "SDN.Use"}

// SeedPrivileges is the documented ProxyOperatorSeeds role.
var SeedPrivileges = []string{"Datastore.Allocate", "Datastore.AllocateTemplate", "Datastore.AllocateSpace", "Datastore.Audit"}

// OperatorACL is the documented ACL: ProxyOperator on / and ProxyOperatorSeeds
// on the seed storage.
func (s *Server) OperatorACL() map[string][]string {
	return map[string][]string{"/": OperatorPrivileges, "/storage/" + s.opts.ISOStorage: SeedPrivileges}
}

// AddTemplate adds a template VM with the given config (name, disks, net0,
// boot ...); "template: 1" is added unless notTemplate.
func (s *Server) AddTemplate(vmid int, nodeName string, config map[string]string, notTemplate bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	cfg := map[string]string{"meta": "creation-qemu=10.0.2,ctime=1758640000", "vmgenid": "5a1b0c2d-0000-4000-8000-000000000001", "smbios1": "uuid=0e0c1c2a-0000-4000-8000-000000000001", "digest": "0"}
	for k, v := range config {
		cfg[k] = v
	}
	if !notTemplate {
		cfg["template"] = "1"
	}
	s.vms[vmid] = &vm{VM: VM{VMID: vmid, Node: nodeName, Status: "stopped", QMP: "stopped", Template: !notTemplate, Config: cfg}, startsOK: true}
}

// DebianTemplate is a config like a Debian 13 cloud template.
func DebianTemplate() map[string]string {
	return map[string]string{
		"name": "debian-13-template", "memory": "2048", "cores": "2", "ostype": "l26", "machine": "q35", "bios": "ovmf",
		"efidisk0": "local-lvm:base-9001-disk-0,efitype=4m,pre-enrolled-keys=0,size=4M", "scsihw": "virtio-scsi-pci",
		"net0": "virtio=BC:24:11:2E:C5:4A,bridge=vmbr0,firewall=1", "serial0": "socket", "vga": "serial0",
		"agent": "1,fstrim_cloned_disks=1", "scsi0": "local-lvm:base-9001-disk-1,size=3G", "boot": "order=scsi0", "tags": "template",
	}
}

// AddVM adds a plain VM (someone else's, a hand-made one, a leftover).
func (s *Server) AddVM(v VM) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v.Status == "" {
		v.Status = "stopped"
	}
	if v.QMP == "" {
		v.QMP = v.Status
	}
	if v.Config == nil {
		v.Config = map[string]string{}
	}
	s.vms[v.VMID] = &vm{VM: v, startsOK: true}
}

// VMs returns a snapshot of every non-template VM, by VMID.
func (s *Server) VMs() map[int]VM {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceLocked()
	out := map[int]VM{}
	for id, v := range s.vms {
		if v.Template {
			continue
		}
		c := v.VM
		c.Config = cloneMap(v.Config)
		out[id] = c
	}
	return out
}

// SetVM changes a VM: fn edits it in place.
func (s *Server) SetVM(vmid int, fn func(v *VM)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v, ok := s.vms[vmid]; ok {
		fn(&v.VM)
	}
}

// RemoveVM removes a VM at once, as `qm destroy` run by someone else.
func (s *Server) RemoveVM(vmid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.vms, vmid)
}

// File returns a file on a node's storage ("iso/<name>"), or nil.
func (s *Server) File(nodeName, storageID, volume string) []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := s.nodes[nodeName]; n != nil {
		if st := n.storages[storageID]; st != nil {
			return st.files[volume]
		}
	}
	return nil
}

// Files lists the files of a node's storage.
func (s *Server) Files(nodeName, storageID string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	if n := s.nodes[nodeName]; n != nil {
		if st := n.storages[storageID]; st != nil {
			for k := range st.files {
				out = append(out, k)
			}
		}
	}
	sort.Strings(out)
	return out
}

// PutFile puts a file on a node's storage.
func (s *Server) PutFile(nodeName, storageID, volume string, data []byte) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nodes[nodeName].storages[storageID].put(volume, data, time.Now())
}

// SetFileTime sets the ctime the content listing reports for a file.
func (s *Server) SetFileTime(nodeName, storageID, volume string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if st := s.nodes[nodeName].storages[storageID]; st != nil && st.files[volume] != nil {
		st.put(volume, st.files[volume], at)
	}
}

// SetStorage changes a node's storage: active and content.
func (s *Server) SetStorage(nodeName, storageID string, active bool, content string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nodes[nodeName].storages[storageID] = &storage{content: content, active: active, avail: 10 << 30, files: map[string][]byte{}}
}

// RemoveStorage removes a storage from a node.
func (s *Server) RemoveStorage(nodeName, storageID string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.nodes[nodeName].storages, storageID)
}

// SetNodeDown makes pveproxy unable to reach a node: requests for it answer
// code (595 or 596), and its VMs are listed with status unknown. 0 brings
// it back.
func (s *Server) SetNodeDown(nodeName string, code int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.nodes[nodeName].down = code
}

// SetAgent sets how a VM's guest agent answers.
func (s *Server) SetAgent(vmid int, mode AgentMode) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if v := s.vms[vmid]; v != nil {
		v.agent = mode
	}
}

// SetStartStops makes the VM at vmid (now or once cloned) stop right
// after every start.
func (s *Server) SetStartStops(vmid int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopOnStart == nil {
		s.stopOnStart = map[int]bool{}
	}
	s.stopOnStart[vmid] = true
}

// Inject adds a fault.
func (s *Server) Inject(f Fault) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = append(s.faults, &f)
}

// ClearFaults removes every fault.
func (s *Server) ClearFaults() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.faults = nil
}

// FailNextTask makes the next task of kind (qmclone, qmstart, qmstop,
// qmdestroy, qmresize, imgcopy, imgdel) end with exitstatus exit instead
// of doing its work.
func (s *Server) FailNextTask(kind, exit string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.taskFails = append(s.taskFails, taskFail{kind, exit})
}

// SetTaskTiming makes every new task's status answer 400 "no such task"
// unknown times (as right after a real task starts), then "running"
// running times, before it ends (such a task ends only by being polled).
func (s *Server) SetTaskTiming(unknown, running int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.taskUnknown, s.taskRunning = unknown, running
}

// HoldClones keeps every clone started from now on running (its VM locked
// with lock: clone) until ReleaseClones.
func (s *Server) HoldClones() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holdClone = true
	if s.holdCh == nil {
		s.holdCh = make(chan struct{})
	}
}

// ReleaseClones lets held clones finish, and stops holding new ones.
func (s *Server) ReleaseClones() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holdClone = false
	if s.holdCh != nil {
		close(s.holdCh)
		s.holdCh = nil
	}
}

// CloneStarted returns a channel that receives the new VMID of every clone
// started from now on.
func (s *Server) CloneStarted() <-chan int {
	s.mu.Lock()
	defer s.mu.Unlock()
	ch := make(chan int, 64)
	s.cloneWait = append(s.cloneWait, ch)
	return ch
}

// Calls returns the number of requests by "METHOD /path/pattern".
func (s *Server) Calls() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return cloneMapInt(s.calls)
}

// TotalCalls is the number of requests served.
func (s *Server) TotalCalls() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, c := range s.calls {
		n += c
	}
	return n
}

// ResetCalls zeroes the counters.
func (s *Server) ResetCalls() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.calls = map[string]int{}
}

// LastForm returns the parameters of the last request matching pattern
// ("PUT /nodes/{node}/qemu/{vmid}/config").
func (s *Server) LastForm(pattern string) url.Values {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.lastForm[pattern]
}

// ---- HTTP plumbing ----

type apiError struct {
	status    int
	message   string
	errors    map[string]string
	emptyBody bool
}

func errf(status int, format string, args ...any) *apiError {
	return &apiError{status: status, message: fmt.Sprintf(format, args...)}
}

// writeError answers as pveproxy does: the reason phrase is the message,
// the body repeats it, and the connection closes.
func writeError(w http.ResponseWriter, e *apiError) {
	var body []byte
	if !e.emptyBody {
		m := map[string]any{"data": nil, "message": e.message + "\n"}
		if e.errors != nil {
			m["errors"] = e.errors
		}
		body, _ = json.Marshal(m)
	}
	hj, ok := w.(http.Hijacker)
	if !ok {
		http.Error(w, e.message, e.status)
		return
	}
	conn, buf, err := hj.Hijack()
	if err != nil {
		return
	}
	defer conn.Close()
	reason := strings.NewReplacer("\r", " ", "\n", " ").Replace(e.message)
	fmt.Fprintf(buf, "HTTP/1.1 %d %s\r\nCache-Control: max-age=0\r\nConnection: close\r\nDate: %s\r\nPragma: no-cache\r\nServer: pve-api-daemon/3.0\r\n",
		e.status, reason, time.Now().UTC().Format(http.TimeFormat))
	if len(body) > 0 {
		fmt.Fprintf(buf, "Content-Type: application/json;charset=UTF-8\r\n")
	}
	fmt.Fprintf(buf, "Content-Length: %d\r\n\r\n", len(body))
	_, _ = buf.Write(body)
	_ = buf.Flush()
}

func writeData(w http.ResponseWriter, data any) {
	body, _ := json.Marshal(map[string]any{"data": data})
	w.Header().Set("Content-Type", "application/json;charset=UTF-8")
	w.Header().Set("Server", "pve-api-daemon/3.0")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	_, _ = w.Write(body)
}

type request struct {
	w       http.ResponseWriter
	r       *http.Request
	user    string // user@realm!tokenid
	form    url.Values
	pattern string
}

type handler func(s *Server, q *request) (any, *apiError)

func (s *Server) routes() http.Handler {
	mux := http.NewServeMux()
	add := func(pattern string, h handler) {
		method, path, _ := strings.Cut(pattern, " ")
		mux.HandleFunc(method+" /api2/json"+path, func(w http.ResponseWriter, r *http.Request) { s.serve(w, r, pattern, h) })
	}
	add("GET /version", (*Server).version)
	add("GET /cluster/resources", (*Server).resources)
	add("GET /nodes/{node}/status", (*Server).nodeStatus)
	add("GET /nodes/{node}/storage/{storage}/status", (*Server).storageStatus)
	add("POST /nodes/{node}/storage/{storage}/upload", (*Server).upload)
	add("GET /nodes/{node}/storage/{storage}/content", (*Server).listContent)
	add("DELETE /nodes/{node}/storage/{storage}/content/{volume...}", (*Server).deleteVolume)
	add("GET /nodes/{node}/tasks/{upid}/status", (*Server).taskStatus)
	add("GET /nodes/{node}/qemu/{vmid}/config", (*Server).getConfig)
	add("PUT /nodes/{node}/qemu/{vmid}/config", (*Server).putConfig)
	add("POST /nodes/{node}/qemu/{vmid}/clone", (*Server).clone)
	add("GET /nodes/{node}/qemu/{vmid}/status/current", (*Server).statusCurrent)
	add("POST /nodes/{node}/qemu/{vmid}/status/start", (*Server).start)
	add("POST /nodes/{node}/qemu/{vmid}/status/stop", (*Server).stop)
	add("PUT /nodes/{node}/qemu/{vmid}/resize", (*Server).resize)
	add("DELETE /nodes/{node}/qemu/{vmid}", (*Server).destroy)
	add("GET /nodes/{node}/qemu/{vmid}/agent/network-get-interfaces", (*Server).agentInterfaces)
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		writeError(w, errf(501, "Method '%s %s' not implemented", r.Method, strings.TrimPrefix(r.URL.Path, "/api2/json")))
	})
	return mux
}

func (s *Server) serve(w http.ResponseWriter, r *http.Request, pattern string, h handler) {
	q := &request{w: w, r: r, pattern: pattern}
	s.mu.Lock()
	s.calls[pattern]++
	s.mu.Unlock()

	// Authentication first, as pveproxy does.
	auth := r.Header.Get("Authorization")
	if auth == "" {
		s.authFail(w, r, "No ticket")
		return
	}
	rest, ok := strings.CutPrefix(auth, "PVEAPIToken=")
	id, secret, ok2 := strings.Cut(rest, "=")
	s.mu.Lock()
	tok := s.tokens[id]
	s.mu.Unlock()
	if !ok || !ok2 || tok == nil || tok.secret != secret {
		s.authFail(w, r, "Authentication failed!")
		return
	}
	q.user = id

	if f := s.matchFault(r); f != nil {
		if f.Delay > 0 {
			t := time.NewTimer(f.Delay)
			select {
			case <-t.C:
			case <-r.Context().Done():
				// The client gave up: answer nothing.
				t.Stop()
				if hj, ok := w.(http.Hijacker); ok {
					if conn, _, err := hj.Hijack(); err == nil {
						_ = conn.Close()
					}
				}
				return
			}
		}
		if f.Cut {
			if hj, ok := w.(http.Hijacker); ok {
				if conn, _, err := hj.Hijack(); err == nil {
					_ = conn.Close()
				}
			}
			return
		}
		if f.Status != 0 {
			fail(w, r, &apiError{status: f.Status, message: f.Message, errors: f.Errors, emptyBody: f.EmptyBody})
			return
		}
	}
	if n := r.PathValue("node"); n != "" {
		s.mu.Lock()
		nd := s.nodes[n]
		s.mu.Unlock()
		if nd == nil {
			fail(w, r, errf(500, "hostname lookup '%s' failed - failed to get address info for: %s: Name or service not known", n, n))
			return
		}
		if nd.down == 595 {
			fail(w, r, errf(595, "Errors during connection establishment, proxy handler: No route to host"))
			return
		}
		if nd.down != 0 {
			fail(w, r, errf(nd.down, "Connection timed out"))
			return
		}
	}
	if !strings.HasPrefix(pattern, "POST /nodes/{node}/storage/{storage}/upload") {
		if err := r.ParseForm(); err != nil {
			fail(w, r, errf(400, "Parameter verification failed."))
			return
		}
		q.form = r.Form
		if ct, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); ct == "application/json" {
			var m map[string]any
			if json.NewDecoder(r.Body).Decode(&m) == nil {
				for k, v := range m {
					q.form.Set(k, fmt.Sprint(v))
				}
			}
		}
		s.mu.Lock()
		s.lastForm[pattern] = cloneValues(q.form)
		s.mu.Unlock()
	}
	data, apiErr := h(s, q)
	if apiErr != nil {
		fail(w, r, apiErr)
		return
	}
	writeData(w, data)
}

func (s *Server) authFail(w http.ResponseWriter, r *http.Request, msg string) {
	if s.opts.AuthFailDelay > 0 {
		time.Sleep(s.opts.AuthFailDelay) // pveproxy's own delay, not synchronisation
	}
	fail(w, r, &apiError{status: 401, message: msg, emptyBody: true})
}

func (s *Server) matchFault(r *http.Request) *Fault {
	s.mu.Lock()
	defer s.mu.Unlock()
	path := strings.TrimPrefix(r.URL.Path, "/api2/json")
	for i, f := range s.faults {
		if f.Method != "" && f.Method != r.Method {
			continue
		}
		if f.Path != "" && !strings.Contains(path, f.Path) {
			continue
		}
		if f.Times > 0 {
			f.Times--
			if f.Times == 0 {
				s.faults = append(s.faults[:i:i], s.faults[i+1:]...)
			}
		}
		return f
	}
	return nil
}

// allowed checks a privilege on an ACL path: the most specific path with
// an entry for the token decides.
func (s *Server) allowed(user, path, priv string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	tok := s.tokens[user]
	if tok == nil {
		return false
	}
	for p := path; ; {
		if privs, ok := tok.acl[p]; ok {
			return slices.Contains(privs, priv)
		}
		if p == "/" {
			return false
		}
		i := strings.LastIndex(p, "/")
		if i <= 0 {
			p = "/"
		} else {
			p = p[:i]
		}
	}
}

func (s *Server) need(q *request, path string, privs ...string) *apiError {
	for _, p := range privs {
		if !s.allowed(q.user, path, p) {
			return errf(403, "Permission check failed (%s, %s)", path, p)
		}
	}
	return nil
}

// ---- tasks ----

func (s *Server) newTaskLocked(nodeName, kind, id, user string, finish func() string) *task {
	s.taskSeq++
	now := time.Now().Unix()
	upid := fmt.Sprintf("UPID:%s:%08X:%08X:%08X:%s:%s:%s:", nodeName, 0x30000+s.taskSeq, 0x2000000+s.taskSeq*7, now, kind, id, user)
	t := &task{upid: upid, node: nodeName, kind: kind, user: user, running: true, finish: finish,
		unknownFor: s.taskUnknown, pollsLeft: s.taskRunning}
	for i, f := range s.taskFails {
		if f.kind == kind {
			exit := f.exit
			s.taskFails = append(s.taskFails[:i:i], s.taskFails[i+1:]...)
			t.finish = func() string { return exit }
			break
		}
	}
	s.tasks[upid] = t
	return t
}

// advanceLocked ends every task that may end.
func (s *Server) advanceLocked() {
	for _, t := range s.tasks {
		if !t.running || t.pollsLeft > 0 {
			continue
		}
		if t.held != nil {
			select {
			case <-t.held:
			default:
				continue
			}
		}
		t.running = false
		t.exit = t.finish()
	}
}

func (s *Server) taskStatus(q *request) (any, *apiError) {
	s.mu.Lock()
	defer s.mu.Unlock()
	upid := q.r.PathValue("upid")
	t := s.tasks[upid]
	if t == nil || t.node != q.r.PathValue("node") {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"upid": "no such task"}}
	}
	if t.unknownFor > 0 {
		t.unknownFor--
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"upid": "no such task"}}
	}
	running := t.pollsLeft > 0
	if running {
		t.pollsLeft--
	} else {
		s.advanceLocked()
	}
	parts := strings.Split(upid, ":")
	out := map[string]any{"upid": upid, "node": t.node, "type": t.kind, "id": parts[6], "user": t.user, "status": "running",
		"pid": 1, "pstart": 1, "starttime": time.Now().Unix(), "tokenid": strings.SplitN(t.user, "!", 2)[len(strings.SplitN(t.user, "!", 2))-1]}
	if !t.running && !running {
		out["status"] = "stopped"
		out["exitstatus"] = t.exit
	}
	return out, nil
}

// ---- handlers ----

func (s *Server) version(q *request) (any, *apiError) {
	return map[string]any{"version": Version, "release": "9.2", "repoid": "6f1d2d3c4b5a6978"}, nil
}

func (s *Server) nodeStatus(q *request) (any, *apiError) {
	n := q.r.PathValue("node")
	if e := s.need(q, "/nodes/"+n, "Sys.Audit"); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return map[string]any{
		"kversion": s.nodes[n].kernel, "pveversion": "pve-manager/" + Version + "/6f1d2d3c4b5a6978",
		"uptime": 123456, "cpu": 0.03, "memory": map[string]any{"total": 33554432000, "used": 4194304000, "free": 29360128000},
		"current-kernel": map[string]any{"release": "6.14.8-2-pve", "sysname": "Linux", "machine": "x86_64"},
	}, nil
}

func (s *Server) storageStatus(q *request) (any, *apiError) {
	n, id := q.r.PathValue("node"), q.r.PathValue("storage")
	if !s.allowed(q.user, "/storage/"+id, "Datastore.Audit") && !s.allowed(q.user, "/storage/"+id, "Datastore.AllocateSpace") {
		return nil, errf(403, "Permission check failed (/storage/%s, Datastore.Audit|Datastore.AllocateSpace)", id)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.nodes[n].storages[id]
	if st == nil {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"storage": "No such storage."}}
	}
	active := 0
	if st.active {
		active = 1
	}
	return map[string]any{"active": active, "enabled": 1, "content": st.content, "type": "dir", "shared": 0,
		"avail": st.avail, "total": st.avail * 2, "used": st.avail}, nil
}

func (s *Server) resources(q *request) (any, *apiError) {
	if t := q.form.Get("type"); t != "" && t != "vm" && t != "storage" && t != "node" && t != "sdn" {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"type": "value '" + t + "' does not have a value in the enumeration 'vm, storage, node, sdn'"}}
	}
	ids := s.vmids()
	var out []map[string]any
	for _, id := range ids {
		if !s.allowed(q.user, "/vms/"+strconv.Itoa(id), "VM.Audit") {
			continue // silently left out, as Proxmox does
		}
		s.mu.Lock()
		s.advanceLocked()
		v := s.vms[id]
		if v == nil {
			s.mu.Unlock()
			continue
		}
		item := map[string]any{"id": fmt.Sprintf("qemu/%d", id), "type": "qemu", "vmid": id, "node": v.Node}
		if s.nodes[v.Node].down != 0 {
			item["status"] = "unknown"
		} else {
			name := v.Config["name"]
			if name == "" {
				name = fmt.Sprintf("VM %d", id)
			}
			tmpl := 0
			if v.Template {
				tmpl = 1
			}
			item["name"], item["status"], item["template"] = name, v.Status, tmpl
			item["maxmem"], item["maxdisk"], item["uptime"] = 2147483648, 3221225472, 0
			if l := v.Config["lock"]; l != "" {
				item["lock"] = l
			}
			if tg := v.Config["tags"]; tg != "" {
				item["tags"] = tg
			}
		}
		s.mu.Unlock()
		out = append(out, item)
	}
	if out == nil {
		out = []map[string]any{}
	}
	return out, nil
}

func (s *Server) vmids() []int {
	s.mu.Lock()
	defer s.mu.Unlock()
	ids := make([]int, 0, len(s.vms))
	for id := range s.vms {
		ids = append(ids, id)
	}
	sort.Ints(ids)
	return ids
}

// vmOn returns the VM at vmid on the request's node, or the error Proxmox
// gives for a config file that is not there.
func (s *Server) vmOnLocked(q *request) (*vm, int, *apiError) {
	n := q.r.PathValue("node")
	id, err := strconv.Atoi(q.r.PathValue("vmid"))
	if err != nil || id < 100 {
		return nil, 0, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"vmid": "invalid format - value does not look like a valid VM ID"}}
	}
	s.advanceLocked()
	v := s.vms[id]
	if v == nil || v.Node != n {
		return nil, id, errf(500, "Configuration file 'nodes/%s/qemu-server/%d.conf' does not exist", n, id)
	}
	return v, id, nil
}

func (s *Server) getConfig(q *request) (any, *apiError) {
	if e := s.need(q, "/vms/"+q.r.PathValue("vmid"), "VM.Audit"); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, _, e := s.vmOnLocked(q)
	if e != nil {
		return nil, e
	}
	out := map[string]any{}
	for k, val := range v.Config {
		switch k {
		case "memory", "cores", "template", "agent":
			if n, err := strconv.Atoi(val); err == nil && k != "agent" {
				if k == "memory" {
					out[k] = val // memory is a string on PVE 9
				} else {
					out[k] = n
				}
				continue
			}
		}
		out[k] = val
	}
	return out, nil
}

var configPrivs = map[string]string{
	"cores": "VM.Config.CPU", "sockets": "VM.Config.CPU", "memory": "VM.Config.Memory", "agent": "VM.Config.Options",
	"tags": "VM.Config.Options", "description": "VM.Config.Options", "name": "VM.Config.Options", "boot": "VM.Config.Options",
	"net0": "VM.Config.Network", "ide2": "VM.Config.CDROM",
}

func (s *Server) putConfig(q *request) (any, *apiError) {
	vmid := q.r.PathValue("vmid")
	keys := make([]string, 0, len(q.form))
	for k := range q.form {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		switch k {
		case "digest", "delete":
			continue
		}
		priv, ok := configPrivs[k]
		if !ok {
			if strings.HasPrefix(k, "scsi") || strings.HasPrefix(k, "virtio") || strings.HasPrefix(k, "sata") {
				priv = "VM.Config.Disk"
			} else {
				return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{k: "property is not defined in schema and the schema does not allow additional properties"}}
			}
		}
		if e := s.need(q, "/vms/"+vmid, priv); e != nil {
			return nil, e
		}
	}
	if net0 := q.form.Get("net0"); net0 != "" {
		if br := optValue(net0, "bridge"); br != "" {
			path := "/sdn/zones/localnetwork/" + br
			if tag := optValue(net0, "tag"); tag != "" {
				path += "/" + tag
			}
			if e := s.need(q, path, "SDN.Use"); e != nil {
				return nil, e
			}
		}
	}
	if ide2 := q.form.Get("ide2"); ide2 != "" {
		vol, _, _ := strings.Cut(ide2, ",")
		if sid, volname, ok := strings.Cut(vol, ":"); ok && vol != "none" && vol != "cdrom" {
			s.mu.Lock()
			st := s.nodes[q.r.PathValue("node")].storages[sid]
			exists := st != nil && st.files[volname] != nil
			s.mu.Unlock()
			if !exists {
				return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"ide2": fmt.Sprintf("volume '%s' does not exist", vol)}}
			}
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, _, e := s.vmOnLocked(q)
	if e != nil {
		return nil, e
	}
	if l := v.Config["lock"]; l != "" {
		return nil, errf(500, "VM is locked (%s)", l)
	}
	for _, k := range keys {
		if k == "digest" || k == "delete" {
			continue
		}
		v.Config[k] = q.form.Get(k)
	}
	if q.form.Get("ide2") != "" {
		if b := v.Config["boot"]; strings.HasPrefix(b, "order=") && !strings.Contains(b, "ide2") {
			v.Config["boot"] = b + ";ide2"
		}
	}
	v.Config["digest"] = strconv.Itoa(len(v.Config))
	return nil, nil
}

// optValue returns key's value in a Proxmox property string.
func optValue(prop, key string) string {
	for _, part := range strings.Split(prop, ",") {
		if k, v, ok := strings.Cut(part, "="); ok && k == key {
			return v
		}
	}
	return ""
}

var diskKey = regexp.MustCompile(`^(scsi|virtio|sata|ide|efidisk|tpmstate)\d+$`)

func (s *Server) clone(q *request) (any, *apiError) {
	src := q.r.PathValue("vmid")
	newid, err := strconv.Atoi(q.form.Get("newid"))
	if err != nil || newid < 100 {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"newid": "property is missing and it is not optional"}}
	}
	if e := s.need(q, "/vms/"+src, "VM.Clone"); e != nil {
		return nil, e
	}
	if e := s.need(q, "/vms/"+strconv.Itoa(newid), "VM.Allocate"); e != nil {
		return nil, e
	}
	if st := q.form.Get("storage"); st != "" {
		if e := s.need(q, "/storage/"+st, "Datastore.AllocateSpace"); e != nil {
			return nil, e
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	source, _, e := s.vmOnLocked(q)
	if e != nil {
		return nil, e
	}
	if l := source.Config["lock"]; l != "" {
		return nil, errf(500, "VM is locked (%s)", l)
	}
	if _, exists := s.vms[newid]; exists {
		return nil, errf(500, "unable to create VM %d: config file already exists", newid)
	}
	target := q.form.Get("target")
	if target == "" {
		target = source.Node
	}
	if s.nodes[target] == nil {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"target": "no such cluster node '" + target + "'"}}
	}
	if target != source.Node && !source.Template {
		return nil, errf(500, "Can't clone to other node if VM is not a template")
	}
	nv := &vm{VM: VM{VMID: newid, Node: target, Status: "stopped", QMP: "stopped", Config: map[string]string{"lock": "clone"}}, startsOK: true}
	s.vms[newid] = nv
	srcCfg := cloneMap(source.Config)
	form := cloneValues(q.form)
	t := s.newTaskLocked(source.Node, "qmclone", src, q.user, func() string {
		cfg := map[string]string{}
		disk := 0
		for k, v := range srcCfg {
			switch k {
			case "template", "lock", "digest":
				continue
			}
			if diskKey.MatchString(k) && !strings.Contains(v, "media=cdrom") && !strings.Contains(v, "cloudinit") {
				vol, opts, _ := strings.Cut(v, ",")
				sid, _, _ := strings.Cut(vol, ":")
				if st := form.Get("storage"); st != "" {
					sid = st
				}
				v = fmt.Sprintf("%s:vm-%d-disk-%d,%s", sid, newid, disk, opts)
				disk++
			}
			if k == "net0" {
				s.macSeq++
				if model, rest, ok := strings.Cut(v, ","); ok && strings.Contains(model, "=") {
					m, _, _ := strings.Cut(model, "=")
					v = fmt.Sprintf("%s=BC:24:11:%02X:%02X:%02X,%s", m, (s.macSeq>>16)&0xff, (s.macSeq>>8)&0xff, s.macSeq&0xff, rest)
				}
			}
			cfg[k] = v
		}
		cfg["name"] = form.Get("name")
		if d := form.Get("description"); d != "" {
			cfg["description"] = d
		} else {
			delete(cfg, "description")
		}
		cfg["digest"] = "1"
		nv.Config = cfg
		return "OK"
	})
	if s.holdClone {
		t.held = s.holdCh
	}
	// A failed clone removes the new VM's config.
	finish := t.finish
	t.finish = func() string {
		exit := finish()
		if exit != "OK" && !strings.HasPrefix(exit, "WARNINGS") {
			delete(s.vms, newid)
		}
		return exit
	}
	for _, ch := range s.cloneWait {
		select {
		case ch <- newid:
		default:
		}
	}
	return t.upid, nil
}

func (s *Server) statusCurrent(q *request) (any, *apiError) {
	if e := s.need(q, "/vms/"+q.r.PathValue("vmid"), "VM.Audit"); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, id, e := s.vmOnLocked(q)
	if e != nil {
		return nil, e
	}
	out := map[string]any{"vmid": id, "status": v.Status, "qmpstatus": v.QMP, "name": v.Config["name"], "cpus": 1, "maxmem": 1073741824, "uptime": 0}
	if v.Config["agent"] != "" {
		out["agent"] = 1
	}
	if l := v.Config["lock"]; l != "" {
		out["lock"] = l
	}
	return out, nil
}

func (s *Server) powerTask(q *request, kind string, work func(v *vm) string) (any, *apiError) {
	vmid := q.r.PathValue("vmid")
	if e := s.need(q, "/vms/"+vmid, "VM.PowerMgmt"); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.advanceLocked()
	n := q.r.PathValue("node")
	id, _ := strconv.Atoi(vmid)
	t := s.newTaskLocked(n, kind, vmid, q.user, func() string {
		v := s.vms[id]
		if v == nil || v.Node != n {
			return fmt.Sprintf("unable to find configuration file for VM %d on node '%s'", id, n)
		}
		if l := v.Config["lock"]; l != "" {
			return fmt.Sprintf("VM is locked (%s)", l)
		}
		return work(v)
	})
	return t.upid, nil
}

func (s *Server) start(q *request) (any, *apiError) {
	return s.powerTask(q, "qmstart", func(v *vm) string {
		if v.Template {
			return "you can't start a vm if it's a template"
		}
		if v.Status == "running" && v.QMP == "running" {
			return "OK"
		}
		if !v.startsOK || s.stopOnStart[v.VMID] {
			v.Status, v.QMP = "stopped", "stopped"
			return "OK"
		}
		v.Status, v.QMP = "running", "running"
		if v.ip == "" {
			s.ipSeq++
			v.ip = fmt.Sprintf("192.168.4.%d", 10+s.ipSeq%240)
		}
		return "OK"
	})
}

func (s *Server) stop(q *request) (any, *apiError) {
	return s.powerTask(q, "qmstop", func(v *vm) string {
		v.Status, v.QMP = "stopped", "stopped"
		return "OK"
	})
}

func (s *Server) resize(q *request) (any, *apiError) {
	vmid := q.r.PathValue("vmid")
	if e := s.need(q, "/vms/"+vmid, "VM.Config.Disk"); e != nil {
		return nil, e
	}
	disk, size := q.form.Get("disk"), q.form.Get("size")
	if disk == "" || size == "" {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"size": "property is missing and it is not optional"}}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, _, e := s.vmOnLocked(q); e != nil {
		return nil, e
	}
	n := q.r.PathValue("node")
	id, _ := strconv.Atoi(vmid)
	t := s.newTaskLocked(n, "qmresize", vmid, q.user, func() string {
		v := s.vms[id]
		if v == nil {
			return fmt.Sprintf("unable to find configuration file for VM %d on node '%s'", id, n)
		}
		if l := v.Config["lock"]; l != "" {
			return fmt.Sprintf("VM is locked (%s)", l)
		}
		cur := v.Config[disk]
		if cur == "" {
			return fmt.Sprintf("disk '%s' does not exist", disk)
		}
		var parts []string
		for _, p := range strings.Split(cur, ",") {
			if !strings.HasPrefix(p, "size=") {
				parts = append(parts, p)
			}
		}
		v.Config[disk] = strings.Join(append(parts, "size="+size), ",")
		return "OK"
	})
	return t.upid, nil
}

func (s *Server) destroy(q *request) (any, *apiError) {
	vmid := q.r.PathValue("vmid")
	if e := s.need(q, "/vms/"+vmid, "VM.Allocate"); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, id, e := s.vmOnLocked(q)
	if e != nil {
		return nil, e
	}
	_ = v
	n := q.r.PathValue("node")
	t := s.newTaskLocked(n, "qmdestroy", vmid, q.user, func() string {
		v := s.vms[id]
		if v == nil {
			return fmt.Sprintf("unable to find configuration file for VM %d on node '%s'", id, n)
		}
		if l := v.Config["lock"]; l != "" && l != "suspended" {
			return fmt.Sprintf("VM is locked (%s)", l)
		}
		if v.Status == "running" {
			return fmt.Sprintf("VM %d is running - destroy failed", id)
		}
		delete(s.vms, id)
		return "OK"
	})
	return t.upid, nil
}

var badFileChar = regexp.MustCompile(`[^a-zA-Z0-9_.-]`)

func (s *Server) upload(q *request) (any, *apiError) {
	n, id := q.r.PathValue("node"), q.r.PathValue("storage")
	if !s.allowed(q.user, "/storage/"+id, "Datastore.AllocateTemplate") {
		// Raised while authenticating the upload: no body.
		return nil, &apiError{status: 403, message: fmt.Sprintf("Permission check failed (/storage/%s, Datastore.AllocateTemplate)", id), emptyBody: true}
	}
	if q.r.ContentLength < 0 {
		return nil, errf(501, "chunked transfer encoding not supported")
	}
	ct, params, err := mime.ParseMediaType(q.r.Header.Get("Content-Type"))
	if err != nil || ct != "multipart/form-data" {
		return nil, errf(400, "Parameter verification failed.")
	}
	mr := multipart.NewReader(q.r.Body, params["boundary"])
	var content, filename string
	var data []byte
	for {
		p, err := mr.NextPart()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, errf(400, "Parameter verification failed.")
		}
		b, _ := io.ReadAll(p)
		switch p.FormName() {
		case "content":
			content = string(b)
		case "filename":
			if p.FileName() == "" {
				return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"filename": "duplicate parameter"}}
			}
			filename, data = p.FileName(), b
		}
	}
	s.mu.Lock()
	s.bodies += int64(len(data))
	s.mu.Unlock()
	if content != "iso" && content != "vztmpl" && content != "import" {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"content": "value '" + content + "' does not have a value in the enumeration 'iso, vztmpl, import'"}}
	}
	filename = badFileChar.ReplaceAllString(filename, "_")
	if content == "iso" && !strings.HasSuffix(filename, ".iso") && !strings.HasSuffix(filename, ".img") {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"filename": "wrong file extension"}}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.nodes[n].storages[id]
	if st == nil {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"storage": "No such storage."}}
	}
	if !strings.Contains(st.content, content) {
		return nil, errf(400, "storage '%s' does not support '%s' content", id, content)
	}
	t := s.newTaskLocked(n, "imgcopy", "", q.user, func() string {
		st.put(content+"/"+filename, data, time.Now())
		return "OK"
	})
	return t.upid, nil
}

// listContent answers a storage's volumes as pvesm list does: volid,
// content, format, size and ctime, filtered by content when given.
func (s *Server) listContent(q *request) (any, *apiError) {
	n, id := q.r.PathValue("node"), q.r.PathValue("storage")
	if !s.allowed(q.user, "/storage/"+id, "Datastore.Audit") && !s.allowed(q.user, "/storage/"+id, "Datastore.AllocateSpace") {
		return nil, errf(403, "Permission check failed (/storage/%s, Datastore.Audit|Datastore.AllocateSpace)", id)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.nodes[n].storages[id]
	if st == nil {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"storage": "No such storage."}}
	}
	if !st.active {
		return nil, errf(500, "storage '%s' is not online", id)
	}
	want := q.form.Get("content")
	vols := make([]string, 0, len(st.files))
	for v := range st.files {
		vols = append(vols, v)
	}
	sort.Strings(vols)
	out := []map[string]any{}
	for _, v := range vols {
		content, _, _ := strings.Cut(v, "/")
		if want != "" && content != want {
			continue
		}
		format := "raw"
		if content == "iso" {
			format = "iso"
		}
		out = append(out, map[string]any{"volid": id + ":" + v, "content": content, "format": format,
			"size": len(st.files[v]), "ctime": st.ctimes[v]})
	}
	return out, nil
}

func (s *Server) deleteVolume(q *request) (any, *apiError) {
	n, id := q.r.PathValue("node"), q.r.PathValue("storage")
	volume := q.r.PathValue("volume")
	if e := s.need(q, "/storage/"+id, "Datastore.Allocate"); e != nil {
		return nil, e
	}
	sid, volname, ok := strings.Cut(volume, ":")
	if !ok {
		sid, volname = id, volume
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.nodes[n].storages[sid]
	if st == nil {
		return nil, &apiError{status: 400, message: "Parameter verification failed.", errors: map[string]string{"storage": "No such storage."}}
	}
	t := s.newTaskLocked(n, "imgdel", sid+":"+volname, q.user, func() string {
		if _, ok := st.files[volname]; !ok {
			return fmt.Sprintf("unlink '/var/lib/%s/template/%s' failed - No such file or directory", sid, strings.TrimPrefix(volname, "iso/"))
		}
		delete(st.files, volname)
		delete(st.ctimes, volname)
		return "OK"
	})
	return t.upid, nil
}

func (s *Server) agentInterfaces(q *request) (any, *apiError) {
	if e := s.need(q, "/vms/"+q.r.PathValue("vmid"), "VM.GuestAgent.Audit"); e != nil {
		return nil, e
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, id, e := s.vmOnLocked(q)
	if e != nil {
		return nil, e
	}
	if _, ok := v.Config["agent"]; !ok {
		return nil, errf(500, "No QEMU guest agent configured")
	}
	if v.Status != "running" {
		return nil, errf(500, "VM %d is not running", id)
	}
	if strings.HasPrefix(v.Config["agent"], "0") || v.agent == AgentNotRunning {
		return nil, errf(500, "QEMU guest agent is not running")
	}
	ifaces := []map[string]any{
		{"name": "lo", "hardware-address": "00:00:00:00:00:00", "ip-addresses": []map[string]any{
			{"ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8}, {"ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128}}},
	}
	eth := map[string]any{"name": "eth0", "hardware-address": "bc:24:11:00:00:01", "ip-addresses": []map[string]any{
		{"ip-address": "fe80::be24:11ff:fe00:1", "ip-address-type": "ipv6", "prefix": 64}}}
	if v.agent == AgentReady {
		eth["ip-addresses"] = append(eth["ip-addresses"].([]map[string]any), map[string]any{"ip-address": v.ip, "ip-address-type": "ipv4", "prefix": 24})
	}
	ifaces = append(ifaces, eth, map[string]any{"name": "docker0", "hardware-address": "02:42:00:00:00:01"})
	return map[string]any{"result": ifaces}, nil
}

func cloneMap(m map[string]string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func cloneMapInt(m map[string]int) map[string]int {
	out := make(map[string]int, len(m))
	for k, v := range m {
		out[k] = v
	}
	return out
}

func cloneValues(v url.Values) url.Values {
	out := url.Values{}
	for k, vs := range v {
		out[k] = append([]string(nil), vs...)
	}
	return out
}

// fail reads what is left of the request body, as pveproxy does before it
// answers (an upload is staged whole), then writes the error.
func fail(w http.ResponseWriter, r *http.Request, e *apiError) {
	_, _ = io.Copy(io.Discard, io.LimitReader(r.Body, 256<<20))
	writeError(w, e)
}
