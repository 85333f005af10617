package kvm

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"libvirt.org/go/libvirtxml"
)

// fakeAPI is an in-memory libvirt answering the calls the backend makes
// with the error numbers and texts the real daemon uses.
type fakeAPI struct {
	mu      sync.Mutex
	pools   map[string]map[string]*fakeVol
	states  map[string]libvirt.StoragePoolState
	domains map[string]*fakeDomain
	calls   []string
	// fail makes a method fail every time; block makes it wait until the
	// channel is closed.
	fail  map[string]error
	block map[string]chan struct{}
	// agentIP and arp answer DomainInterfaceAddresses.
	agentIP string
	arp     map[string]string // MAC → IP
}

type fakeVol struct {
	format  string
	backing string
	data    []byte
	mtime   time.Time // zero: long ago
}

type fakeDomain struct {
	xml   string
	meta  string
	state libvirt.DomainState
}

func lvErr(code libvirt.ErrorNumber, format string, args ...any) error {
	return libvirt.Error{Code: uint32(code), Message: fmt.Sprintf(format, args...)}
}

func newFakeAPI(pools ...string) *fakeAPI {
	f := &fakeAPI{pools: map[string]map[string]*fakeVol{}, states: map[string]libvirt.StoragePoolState{},
		domains: map[string]*fakeDomain{}, fail: map[string]error{}, block: map[string]chan struct{}{}, arp: map[string]string{}}
	for _, p := range pools {
		f.pools[p] = map[string]*fakeVol{}
	}
	return f
}

// enter records a call and applies fail/block; it is called with mu held
// and may release it while blocking.
func (f *fakeAPI) enter(m string) error {
	f.calls = append(f.calls, m)
	if ch, ok := f.block[m]; ok {
		f.mu.Unlock()
		<-ch
		f.mu.Lock()
	}
	return f.fail[m]
}

func (f *fakeAPI) count(m string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, c := range f.calls {
		if c == m {
			n++
		}
	}
	return n
}

func (f *fakeAPI) volNames(pool string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for n := range f.pools[pool] {
		out = append(out, n)
	}
	return out
}

func (f *fakeAPI) ConnectGetLibVersion() (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return 9000000, f.enter("ConnectGetLibVersion")
}

func (f *fakeAPI) ConnectGetVersion() (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return 7002000, f.enter("ConnectGetVersion")
}

func (f *fakeAPI) ConnectGetHostname() (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return "fake-host", f.enter("ConnectGetHostname")
}

func (f *fakeAPI) ConnectGetAllDomainStats(_ []libvirt.Domain, _ uint32, _ uint32) ([]libvirt.DomainStatsRecord, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("ConnectGetAllDomainStats"); err != nil {
		return nil, err
	}
	var out []libvirt.DomainStatsRecord
	for n, d := range f.domains {
		out = append(out, libvirt.DomainStatsRecord{Dom: libvirt.Domain{Name: n}, Params: []libvirt.TypedParam{
			{Field: "state.state", Value: libvirt.TypedParamValue{D: 1, I: int32(d.state)}},
			{Field: "state.reason", Value: libvirt.TypedParamValue{D: 1, I: int32(0)}},
		}})
	}
	return out, nil
}

func (f *fakeAPI) DomainLookupByName(name string) (libvirt.Domain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainLookupByName"); err != nil {
		return libvirt.Domain{}, err
	}
	if _, ok := f.domains[name]; !ok {
		return libvirt.Domain{}, lvErr(libvirt.ErrNoDomain, "Domain not found: no domain with matching name '%s'", name)
	}
	return libvirt.Domain{Name: name}, nil
}

func (f *fakeAPI) DomainDefineXML(x string) (libvirt.Domain, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainDefineXML"); err != nil {
		return libvirt.Domain{}, err
	}
	var d libvirtxml.Domain
	if err := d.Unmarshal(x); err != nil {
		return libvirt.Domain{}, lvErr(libvirt.ErrXMLError, "XML error: %v", err)
	}
	meta := ""
	if d.Metadata != nil {
		meta = d.Metadata.XML
	}
	f.domains[d.Name] = &fakeDomain{xml: x, meta: meta, state: libvirt.DomainShutoff}
	return libvirt.Domain{Name: d.Name}, nil
}

func (f *fakeAPI) dom(name string) (*fakeDomain, error) {
	d, ok := f.domains[name]
	if !ok {
		return nil, lvErr(libvirt.ErrNoDomain, "Domain not found: no domain with matching name '%s'", name)
	}
	return d, nil
}

func (f *fakeAPI) DomainCreate(dom libvirt.Domain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainCreate"); err != nil {
		return err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return err
	}
	if d.state == libvirt.DomainRunning {
		return lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is already running")
	}
	d.state = libvirt.DomainRunning
	return nil
}

func (f *fakeAPI) DomainGetState(dom libvirt.Domain, _ uint32) (int32, int32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainGetState"); err != nil {
		return 0, 0, err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return 0, 0, err
	}
	return int32(d.state), 0, nil
}

func (f *fakeAPI) DomainGetMetadata(dom libvirt.Domain, _ int32, _ libvirt.OptString, _ libvirt.DomainModificationImpact) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainGetMetadata"); err != nil {
		return "", err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return "", err
	}
	if d.meta == "" {
		return "", lvErr(libvirt.ErrNoDomainMetadata, "metadata not found: Requested metadata element is not present")
	}
	return d.meta, nil
}

// DomainSetMetadata replaces the mark; like libvirt, changing the live
// domain of one that is not running is "operation invalid".
func (f *fakeAPI) DomainSetMetadata(dom libvirt.Domain, _ int32, metadata, _, _ libvirt.OptString, flags libvirt.DomainModificationImpact) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainSetMetadata"); err != nil {
		return err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return err
	}
	if flags&libvirt.DomainAffectLive != 0 && d.state != libvirt.DomainRunning {
		return lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is not running")
	}
	if len(metadata) > 0 {
		if strings.Contains(metadata[0], "xmlns:") {
			return lvErr(libvirt.ErrInternalError, "internal error: failed to create a new XML namespace")
		}
		d.meta = metadata[0]
	}
	return nil
}

func (f *fakeAPI) DomainGetXMLDesc(dom libvirt.Domain, _ libvirt.DomainXMLFlags) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainGetXMLDesc"); err != nil {
		return "", err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return "", err
	}
	return d.xml, nil
}

func (f *fakeAPI) DomainInterfaceAddresses(dom libvirt.Domain, source uint32, _ uint32) ([]libvirt.DomainInterface, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainInterfaceAddresses"); err != nil {
		return nil, err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return nil, err
	}
	if source == uint32(libvirt.DomainInterfaceAddressesSrcAgent) {
		if f.agentIP == "" {
			return nil, lvErr(libvirt.ErrAgentUnresponsive, "Guest agent is not responding: QEMU guest agent is not connected")
		}
		return []libvirt.DomainInterface{
			{Name: "lo", Addrs: []libvirt.DomainIPAddr{{Type: int32(libvirt.IPAddrTypeIpv4), Addr: "127.0.0.1", Prefix: 8}}},
			{Name: "eth0", Hwaddr: []string{"52:54:00:00:00:01"}, Addrs: []libvirt.DomainIPAddr{{Type: int32(libvirt.IPAddrTypeIpv4), Addr: f.agentIP, Prefix: 24}}},
		}, nil
	}
	var out []libvirt.DomainInterface
	for _, mac := range domainMACs(d.xml) {
		if ip, ok := f.arp[mac]; ok {
			out = append(out, libvirt.DomainInterface{Name: "vnet0", Hwaddr: []string{mac}, Addrs: []libvirt.DomainIPAddr{{Type: int32(libvirt.IPAddrTypeIpv4), Addr: ip}}})
		}
	}
	return out, nil
}

func (f *fakeAPI) DomainDestroy(dom libvirt.Domain) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainDestroy"); err != nil {
		return err
	}
	d, err := f.dom(dom.Name)
	if err != nil {
		return err
	}
	if d.state != libvirt.DomainRunning {
		return lvErr(libvirt.ErrOperationInvalid, "Requested operation is not valid: domain is not running")
	}
	d.state = libvirt.DomainShutoff
	return nil
}

func (f *fakeAPI) DomainUndefineFlags(dom libvirt.Domain, _ libvirt.DomainUndefineFlagsValues) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("DomainUndefineFlags"); err != nil {
		return err
	}
	if _, err := f.dom(dom.Name); err != nil {
		return err
	}
	delete(f.domains, dom.Name)
	return nil
}

func (f *fakeAPI) StoragePoolLookupByName(name string) (libvirt.StoragePool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StoragePoolLookupByName"); err != nil {
		return libvirt.StoragePool{}, err
	}
	if _, ok := f.pools[name]; !ok {
		return libvirt.StoragePool{}, lvErr(libvirt.ErrNoStoragePool, "Storage pool not found: no storage pool with matching name '%s'", name)
	}
	return libvirt.StoragePool{Name: name}, nil
}

func (f *fakeAPI) StoragePoolGetInfo(pool libvirt.StoragePool) (uint8, uint64, uint64, uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StoragePoolGetInfo"); err != nil {
		return 0, 0, 0, 0, err
	}
	st, ok := f.states[pool.Name]
	if !ok {
		st = libvirt.StoragePoolRunning
	}
	return uint8(st), 100 << 30, 40 << 30, 60 << 30, nil
}

func (f *fakeAPI) StorageVolLookupByName(pool libvirt.StoragePool, name string) (libvirt.StorageVol, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StorageVolLookupByName"); err != nil {
		return libvirt.StorageVol{}, err
	}
	if _, ok := f.pools[pool.Name][name]; !ok {
		return libvirt.StorageVol{}, lvErr(libvirt.ErrNoStorageVol, "Storage volume not found: no storage vol with matching name '%s'", name)
	}
	return libvirt.StorageVol{Pool: pool.Name, Name: name, Key: "/pools/" + pool.Name + "/" + name}, nil
}

func (f *fakeAPI) StorageVolGetPath(vol libvirt.StorageVol) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return "/pools/" + vol.Pool + "/" + vol.Name, f.enter("StorageVolGetPath")
}

func (f *fakeAPI) StorageVolCreateXML(pool libvirt.StoragePool, x string, _ libvirt.StorageVolCreateFlags) (libvirt.StorageVol, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StorageVolCreateXML"); err != nil {
		return libvirt.StorageVol{}, err
	}
	var v libvirtxml.StorageVolume
	if err := v.Unmarshal(x); err != nil {
		return libvirt.StorageVol{}, lvErr(libvirt.ErrXMLError, "XML error: %v", err)
	}
	if _, ok := f.pools[pool.Name][v.Name]; ok {
		return libvirt.StorageVol{}, lvErr(libvirt.ErrStorageVolExist, "storage volume '%s' exists already", v.Name)
	}
	fv := &fakeVol{format: v.Target.Format.Type, mtime: time.Now()}
	if v.BackingStore != nil {
		fv.backing = v.BackingStore.Path
	}
	f.pools[pool.Name][v.Name] = fv
	return libvirt.StorageVol{Pool: pool.Name, Name: v.Name}, nil
}

func (f *fakeAPI) StorageVolUpload(vol libvirt.StorageVol, r io.Reader, _, length uint64, _ libvirt.StorageVolUploadFlags) error {
	f.mu.Lock()
	err := f.enter("StorageVolUpload")
	f.mu.Unlock()
	if err != nil {
		return err
	}
	data, err := io.ReadAll(io.LimitReader(r, int64(length)))
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	v, ok := f.pools[vol.Pool][vol.Name]
	if !ok {
		return lvErr(libvirt.ErrNoStorageVol, "no storage vol '%s'", vol.Name)
	}
	v.data = data
	v.mtime = time.Now()
	return nil
}

func (f *fakeAPI) StorageVolDownload(vol libvirt.StorageVol, w io.Writer, _, _ uint64, _ libvirt.StorageVolDownloadFlags) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StorageVolDownload"); err != nil {
		return err
	}
	v, ok := f.pools[vol.Pool][vol.Name]
	if !ok {
		return lvErr(libvirt.ErrNoStorageVol, "no storage vol '%s'", vol.Name)
	}
	_, err := io.Copy(w, bytes.NewReader(v.data))
	return err
}

func (f *fakeAPI) StorageVolDelete(vol libvirt.StorageVol, _ libvirt.StorageVolDeleteFlags) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StorageVolDelete"); err != nil {
		return err
	}
	if _, ok := f.pools[vol.Pool][vol.Name]; !ok {
		return lvErr(libvirt.ErrNoStorageVol, "no storage vol '%s'", vol.Name)
	}
	delete(f.pools[vol.Pool], vol.Name)
	return nil
}

func (f *fakeAPI) StoragePoolListAllVolumes(pool libvirt.StoragePool, _ int32, _ uint32) ([]libvirt.StorageVol, uint32, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StoragePoolListAllVolumes"); err != nil {
		return nil, 0, err
	}
	var out []libvirt.StorageVol
	for n := range f.pools[pool.Name] {
		out = append(out, libvirt.StorageVol{Pool: pool.Name, Name: n, Key: "/pools/" + pool.Name + "/" + n})
	}
	return out, uint32(len(out)), nil
}

// StorageVolGetXMLDesc answers the path, format, mtime and backing store,
// as a dir pool does.
func (f *fakeAPI) StorageVolGetXMLDesc(vol libvirt.StorageVol, _ uint32) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.enter("StorageVolGetXMLDesc"); err != nil {
		return "", err
	}
	v, ok := f.pools[vol.Pool][vol.Name]
	if !ok {
		return "", lvErr(libvirt.ErrNoStorageVol, "no storage vol '%s'", vol.Name)
	}
	doc := libvirtxml.StorageVolume{Name: vol.Name, Target: &libvirtxml.StorageVolumeTarget{
		Path: "/pools/" + vol.Pool + "/" + vol.Name, Format: &libvirtxml.StorageVolumeTargetFormat{Type: v.format},
		Timestamps: &libvirtxml.StorageVolumeTargetTimestamps{Mtime: fmt.Sprintf("%d.%09d", v.mtime.Unix(), v.mtime.Nanosecond())},
	}}
	if v.mtime.IsZero() {
		doc.Target.Timestamps.Mtime = "0"
	}
	if v.backing != "" {
		doc.BackingStore = &libvirtxml.StorageVolumeBackingStore{Path: v.backing}
	}
	return doc.Marshal()
}

// fakeDialer hands out connections to one fakeAPI and counts dials.
type fakeDialer struct {
	mu    sync.Mutex
	api   *fakeAPI
	dials int
	err   error
	conns []*fakeConn
	// run answers the host commands (the neighbour table).
	run commandRunner
}

type fakeConn struct {
	done   chan struct{}
	once   sync.Once
	closed bool
}

func (d *fakeDialer) dial(context.Context, Host) (*hostClient, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.dials++
	if d.err != nil {
		return nil, d.err
	}
	c := &fakeConn{done: make(chan struct{})}
	d.conns = append(d.conns, c)
	return &hostClient{api: d.api, run: d.run, done: c.done, close: func() {
		d.mu.Lock()
		c.closed = true
		d.mu.Unlock()
		c.once.Do(func() { close(c.done) })
	}}, nil
}

func (d *fakeDialer) dialCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.dials
}

func (d *fakeDialer) closedCount() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	n := 0
	for _, c := range d.conns {
		if c.closed {
			n++
		}
	}
	return n
}
