package kvm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	libvirt "github.com/digitalocean/go-libvirt"
	"google.golang.org/protobuf/types/known/timestamppb"
	"libvirt.org/go/libvirtxml"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/nocloud"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner/crashpoint"
)

// Backend is the KVM/libvirt backend.
type Backend struct {
	name         string // provider name
	cfg          Config
	log          *slog.Logger
	hosts        *hostPool
	images       *imageCache
	now          func() time.Time
	checkTimeout time.Duration
	// neighbourWarned holds the hosts whose neighbour table failed
	// permanently and was logged as a WARNING.
	neighbourWarned sync.Map
	// legacyWarned holds the host/domain pairs whose legacy mark List
	// reported.
	legacyWarned sync.Map
}

// Options adjust a Backend; the zero value is production.
type Options struct {
	// HTTPClient downloads images (http.DefaultClient by default).
	HTTPClient *http.Client
	Now        func() time.Time
	// Keepalive is the SSH keepalive interval (15s by default).
	Keepalive time.Duration
	// CheckTimeout bounds one host's check (15s by default).
	CheckTimeout time.Duration

	// dial replaces the SSH dialer (unit tests); wrap wraps every
	// connection's API (tests stop an operation at a chosen call).
	dial hostDialer
	wrap func(libvirtAPI) libvirtAPI
}

// Defaults of Options.
const (
	DefaultKeepalive    = 15 * time.Second
	DefaultCheckTimeout = 15 * time.Second
)

// FromProvider decodes the provider's kvm block and builds the backend.
func FromProvider(p providers.Provider, log *slog.Logger, opts Options) (*Backend, error) {
	var cfg Config
	if err := p.DecodeBackend(&cfg); err != nil {
		return nil, err
	}
	return New(p.Name, cfg, log, opts)
}

// New validates cfg and builds the backend. It connects to nothing: the
// key material of each host is tried once, and a failure is a WARNING, not
// an error, since a provisioner starts while its hosts or their files are
// not there yet.
func New(provider string, cfg Config, log *slog.Logger, opts Options) (*Backend, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("kvm: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("backend", "kvm")
	if opts.Keepalive <= 0 {
		opts.Keepalive = DefaultKeepalive
	}
	if opts.CheckTimeout <= 0 {
		opts.CheckTimeout = DefaultCheckTimeout
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	dial := opts.dial
	if dial == nil {
		d := newSSHDialer(cfg.InsecureIgnoreHostKey, opts.Keepalive, log)
		for _, h := range cfg.Hosts {
			if _, err := d.load(h); err != nil {
				log.Warn("WARNING: the SSH key material of a kvm host is not usable; its operations fail until it is",
					"host", h.Name, "error", err.Error())
			}
		}
		dial = d.dial
	}
	if cfg.InsecureIgnoreHostKey {
		log.Warn("WARNING: insecureIgnoreHostKey is set; kvm host keys are not verified")
	}
	return &Backend{
		name:         provider,
		cfg:          cfg,
		log:          log,
		hosts:        newHostPool(dial, cfg.MaxConcurrentPerHost, log, opts.wrap),
		images:       newImageCache(opts.HTTPClient, log),
		now:          opts.Now,
		checkTimeout: opts.CheckTimeout,
	}, nil
}

// Close closes the connections to the hosts.
func (be *Backend) Close() { be.hosts.close() }

// placement is a resolved CreateInstanceRequest.
type placement struct {
	host    Host
	machine MachineType
	image   imageSource
}

func (be *Backend) resolve(req *provisionerv1.CreateInstanceRequest) (placement, error) {
	var p placement
	pl := req.GetPlacement()
	zone := pl.GetZone()
	if zone == "" && len(be.cfg.Hosts) == 1 {
		zone = be.cfg.Hosts[0].Name
	}
	h, ok := be.cfg.host(zone)
	if !ok {
		return p, errclass.New(errclass.Permanent, "placement.zone %q is not a host of provider %s (hosts: %v)", zone, be.name, be.hostNames())
	}
	p.host = h
	mt := pl.GetMachineType()
	if mt == "" && len(be.cfg.MachineTypes) == 1 {
		mt = sortedKeys(be.cfg.MachineTypes)[0]
	}
	m, ok := be.cfg.MachineTypes[mt]
	if !ok {
		return p, errclass.New(errclass.Permanent, "placement.machineType %q is not one of %v", mt, sortedKeys(be.cfg.MachineTypes))
	}
	p.machine = m
	img := pl.GetImage()
	if img == "" && len(be.cfg.Images) == 1 {
		img = sortedKeys(be.cfg.Images)[0]
	}
	src, err := be.cfg.resolveImage(img)
	if err != nil {
		return p, err
	}
	p.image = src
	return p, nil
}

func (be *Backend) hostNames() []string {
	out := make([]string, len(be.cfg.Hosts))
	for i, h := range be.cfg.Hosts {
		out[i] = h.Name
	}
	return out
}

func (be *Backend) diskBytes(m MachineType) uint64 {
	gb := be.cfg.DiskSizeGB
	if m.DiskSizeGB > 0 {
		gb = m.DiskSizeGB
	}
	return uint64(gb) << 30
}

// Create makes the proxy's domain and starts it. Every step can be
// resumed: an existing overlay is adopted, the seed is rewritten, a domain
// of ours that is defined but stopped is started. A domain with the name
// and another proxy's mark, or none, is refused as Permanent and left
// untouched.
func (be *Backend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	name, err := instanceName(req.GetProxyUid())
	if err != nil {
		return nil, err
	}
	p, err := be.resolve(req)
	if err != nil {
		return nil, err
	}
	var out *provisionerv1.Instance
	var basePath string
	// Looking up and building move kilobytes and start a process: a
	// libvirt call that has not answered within the step timeout never will,
	// and the dropped connection lets the next attempt resume. Only a
	// base image's download may take longer.
	err = be.step(ctx, p.host, name, "looking up", func(ctx context.Context, api libvirtAPI) error {
		var err error
		out, basePath, err = be.adoptOrCached(ctx, api, p, name, req)
		return err
	})
	if err == nil && out == nil && basePath == "" {
		err = be.hosts.call(ctx, p.host, func(api libvirtAPI) error {
			pool, err := api.StoragePoolLookupByName(p.host.Pool)
			if err != nil {
				return err
			}
			basePath, err = be.images.ensure(ctx, api, p.host.Name, pool, p.image)
			return err
		})
	}
	if err == nil && out == nil {
		err = be.step(ctx, p.host, name, "building", func(ctx context.Context, api libvirtAPI) error {
			var err error
			out, err = be.build(ctx, api, p, name, basePath, req)
			return err
		})
	}
	if err != nil {
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) {
			// Something vanished under us (a volume deleted by hand): retry.
			err = errclass.Wrap(errclass.Transient, err)
		}
		return nil, err
	}
	return out, nil
}

// step runs fn on host's connection within the configured stepTimeout;
// running out of it is Transient, saying what was being done to which
// domain.
func (be *Backend) step(ctx context.Context, h Host, name, doing string, fn func(ctx context.Context, api libvirtAPI) error) error {
	sctx, cancel := context.WithTimeout(ctx, be.cfg.StepTimeout)
	defer cancel()
	err := be.hosts.call(sctx, h, func(api libvirtAPI) error { return fn(sctx, api) })
	if err != nil && errors.Is(sctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil {
		return errclass.New(errclass.Transient, "%s domain %s on host %s took over %s; the connection was dropped and the next attempt resumes", doing, name, h.Name, be.cfg.StepTimeout).
			WithMetadata("host", h.Name, "domain", name)
	}
	return err
}

// adoptOrCached answers the proxy's existing domain, started, or, when
// there is none, the path of the cached base image the new one backs onto
// ("" when the base must be downloaded first).
func (be *Backend) adoptOrCached(ctx context.Context, api libvirtAPI, p placement, name string, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, string, error) {
	uid := req.GetProxyUid()
	dom, err := api.DomainLookupByName(name)
	switch {
	case err == nil:
		m, err := readMark(api, dom)
		if err != nil {
			return nil, "", err
		}
		if !m.isFor(be.name, req.GetInstallation(), uid) {
			return nil, "", errclass.New(errclass.Permanent, "domain %s on host %s exists and is not this proxy's on provider %s (it carries %s); it was left untouched",
				name, p.host.Name, be.name, m.describe()).
				WithMetadata("host", p.host.Name, "domain", name)
		}
		if m.needsClaim(be.name, req.GetInstallation()) {
			m = be.claim(ctx, api, p.host, dom, m, req.GetInstallation())
		}
		in, err := be.startAndDescribe(ctx, api, dom, p.host, providerID(p.host.Name, name), m)
		return in, "", err
	case !hasCode(err, libvirt.ErrNoDomain):
		return nil, "", err
	}
	pool, err := api.StoragePoolLookupByName(p.host.Pool)
	if err != nil {
		return nil, "", err
	}
	basePath, err := be.images.cached(ctx, api, p.host.Name, pool, p.image)
	return nil, basePath, err
}

// build makes the domain of a proxy that has none, backed onto basePath,
// and starts it.
func (be *Backend) build(ctx context.Context, api libvirtAPI, p placement, name, basePath string, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	uid := req.GetProxyUid()
	id := providerID(p.host.Name, name)
	pool, err := api.StoragePoolLookupByName(p.host.Pool)
	if err != nil {
		return nil, err
	}
	overlay, err := api.StorageVolLookupByName(pool, overlayName(name))
	if hasCode(err, libvirt.ErrNoStorageVol) {
		overlay, err = createVolume(api, pool, overlayName(name), FormatQcow2, be.diskBytes(p.machine),
			&libvirtxml.StorageVolumeBackingStore{Path: basePath, Format: &libvirtxml.StorageVolumeTargetFormat{Type: p.image.Format}})
	}
	if err != nil {
		return nil, err
	}
	crashpoint.After(ctx, "kvm.overlay-created")
	overlayPath, err := api.StorageVolGetPath(overlay)
	if err != nil {
		return nil, err
	}
	iso, err := nocloud.BuildSeedISO(nocloud.Seed{
		InstanceID:        name,
		Hostname:          name,
		UserData:          []byte(req.GetCloudInit()),
		InstallGuestAgent: *be.cfg.InstallGuestAgent,
		VendorData:        []byte(be.cfg.VendorData),
		ProxyUser:         req.GetCredentials().GetUsername(),
		ProxyPassword:     req.GetCredentials().GetPassword(),
	})
	if err != nil {
		return nil, errclass.Wrap(errclass.Permanent, err)
	}
	// The seed is rewritten on every attempt: one left by a crash may be
	// half uploaded.
	if err := deleteVolume(api, pool, seedName(name)); err != nil {
		return nil, err
	}
	if err := writeVolume(api, pool, seedName(name), iso); err != nil {
		return nil, err
	}
	crashpoint.After(ctx, "kvm.seed-written")
	seed, err := api.StorageVolLookupByName(pool, seedName(name))
	if err != nil {
		return nil, err
	}
	seedPath, err := api.StorageVolGetPath(seed)
	if err != nil {
		return nil, err
	}
	created := be.now().UTC().Truncate(time.Second)
	x, err := domainXML(domainSpec{
		Name: name, Type: be.cfg.DomainType, VCPUs: p.machine.VCPUs, MemoryMiB: p.machine.MemoryMiB,
		Firmware: p.image.Firmware, OverlayPath: overlayPath, SeedPath: seedPath, Bridge: p.host.Bridge,
		ConsoleLog: consoleLogPath(p.host, name), Mark: markXML(be.name, req.GetInstallation(), uid, created),
	})
	if err != nil {
		return nil, err
	}
	dom, err := api.DomainDefineXML(x)
	if err != nil {
		return nil, err
	}
	crashpoint.After(ctx, "kvm.defined")
	return be.startAndDescribe(ctx, api, dom, p.host, id, mark{Managed: "true", Provider: be.name, UID: uid, CreatedAt: created.Format(time.RFC3339)})
}

// startAndDescribe starts dom unless it runs already and describes it.
func (be *Backend) startAndDescribe(ctx context.Context, api libvirtAPI, dom libvirt.Domain, h Host, id string, m mark) (*provisionerv1.Instance, error) {
	st, reason, err := api.DomainGetState(dom, 0)
	if err != nil {
		return nil, err
	}
	switch libvirt.DomainState(st) {
	case libvirt.DomainShutoff, libvirt.DomainCrashed:
		// libvirtd goes on starting the domain when its caller is gone.
		halt := crashpoint.During(ctx, "kvm.starting")
		err := api.DomainCreate(dom)
		halt()
		if err != nil && !hasCode(err, libvirt.ErrOperationInvalid) {
			return nil, err
		}
		st, reason = int32(libvirt.DomainRunning), 0
	}
	in := be.instance(h, dom.Name, id, m, libvirt.DomainState(st), reason, "")
	return in, nil
}

func (be *Backend) instance(h Host, name, id string, m mark, st libvirt.DomainState, reason int32, ip string) *provisionerv1.Instance {
	in := &provisionerv1.Instance{
		ProviderId:   id,
		ProxyUid:     m.UID,
		Installation: m.Installation,
		Name:         name,
		State:        mapState(st, reason, ip),
		Ip:           ip,
		Details:      map[string]string{"host": h.Name, "pool": h.Pool, "libvirtState": domainStateName(st)},
	}
	if t := m.createdAt(); !t.IsZero() {
		in.CreateTime = timestamppb.New(t)
	}
	return in
}

// mapState maps libvirt's domain state and its reason: running (or
// blocked on I/O) is Running once the address is known and Provisioning
// before, and so is paused while libvirtd starts the domain (its reason
// "starting up": a start whose caller is gone goes on); otherwise paused,
// shutting down, shut off and suspended are Stopped; crashed is Failed.
func mapState(s libvirt.DomainState, reason int32, ip string) provisionerv1.InstanceState {
	if s == libvirt.DomainPaused && libvirt.DomainPausedReason(reason) == libvirt.DomainPausedStartingUp {
		s = libvirt.DomainRunning
	}
	switch s {
	case libvirt.DomainRunning, libvirt.DomainBlocked:
		if ip != "" {
			return provisionerv1.InstanceState_INSTANCE_STATE_RUNNING
		}
		return provisionerv1.InstanceState_INSTANCE_STATE_PROVISIONING
	case libvirt.DomainPaused, libvirt.DomainShutdown, libvirt.DomainShutoff, libvirt.DomainPmsuspended:
		return provisionerv1.InstanceState_INSTANCE_STATE_STOPPED
	case libvirt.DomainCrashed:
		return provisionerv1.InstanceState_INSTANCE_STATE_FAILED
	default:
		return provisionerv1.InstanceState_INSTANCE_STATE_UNSPECIFIED
	}
}

func domainStateName(s libvirt.DomainState) string {
	switch s {
	case libvirt.DomainRunning:
		return "running"
	case libvirt.DomainBlocked:
		return "blocked"
	case libvirt.DomainPaused:
		return "paused"
	case libvirt.DomainShutdown:
		return "shutdown"
	case libvirt.DomainShutoff:
		return "shut off"
	case libvirt.DomainCrashed:
		return "crashed"
	case libvirt.DomainPmsuspended:
		return "pmsuspended"
	default:
		return "nostate"
	}
}

// readMark reads a domain's mark; a domain without one has the zero mark.
func readMark(api libvirtAPI, dom libvirt.Domain) (mark, error) {
	s, err := api.DomainGetMetadata(dom, int32(libvirt.DomainMetadataElement), libvirt.OptString{metadataURI}, 0)
	if hasCode(err, libvirt.ErrNoDomainMetadata) {
		return mark{}, nil
	}
	if err != nil {
		return mark{}, err
	}
	m, err := parseMark(s)
	if err != nil {
		return mark{}, nil //nolint:nilerr // an unreadable mark is not ours
	}
	return m, nil
}

// claim rewrites a mark without provider or installation as this
// provider's and installation's, keeping its UID and creation time, in the live domain (when running) and its persistent
// definition, and returns the mark as it now is. It is best effort: the
// domain is the proxy's either way, so a failure is a WARNING, the
// operation goes on, and the next Get tries again.
func (be *Backend) claim(ctx context.Context, api libvirtAPI, h Host, dom libvirt.Domain, m mark, installation string) mark {
	if installation == "" {
		installation = m.Installation
	}
	x := markElement(be.name, installation, m.UID, m.createdAt())
	flags := libvirt.DomainAffectLive | libvirt.DomainAffectConfig
	err := api.DomainSetMetadata(dom, int32(libvirt.DomainMetadataElement), libvirt.OptString{x},
		libvirt.OptString{metadataPrefix}, libvirt.OptString{metadataURI}, flags)
	if hasCode(err, libvirt.ErrOperationInvalid) {
		// Not running: only the definition exists.
		err = api.DomainSetMetadata(dom, int32(libvirt.DomainMetadataElement), libvirt.OptString{x},
			libvirt.OptString{metadataPrefix}, libvirt.OptString{metadataURI}, libvirt.DomainAffectConfig)
	}
	if err != nil {
		be.log.WarnContext(ctx, "WARNING: claiming a domain with a mark without provider failed; it stays out of List until a later Get claims it",
			"host", h.Name, "domain", dom.Name, "proxy_uid", m.UID, "error", err.Error())
		return m
	}
	be.log.InfoContext(ctx, "domain with a mark without provider or installation claimed for this provider and installation", "host", h.Name, "domain", dom.Name,
		"proxy_uid", m.UID, "installation", installation)
	m.Provider, m.Installation = be.name, installation
	return m
}

// warnLegacy logs, once per domain, a legacy-marked domain List leaves
// out.
func (be *Backend) warnLegacy(ctx context.Context, h Host, domain string, m mark) {
	if _, warned := be.legacyWarned.LoadOrStore(h.Name+"/"+domain, true); warned {
		return
	}
	be.log.WarnContext(ctx, "WARNING: domain carries a mark without provider; List leaves it out (orphan GC never deletes it) until its proxy's Get or Create claims it",
		"host", h.Name, "domain", domain, "proxy_uid", m.UID)
}

// locate resolves a providerID to its host; a host no longer configured
// is reported as ok=false.
func (be *Backend) locate(id string) (Host, string, bool, error) {
	hostName, name, err := parseProviderID(id)
	if err != nil {
		return Host{}, "", false, err
	}
	h, ok := be.cfg.host(hostName)
	return h, name, ok, nil
}

// Get describes the proxy's domain: its state, and its address from the
// guest agent or, failing that, from the host's ARP table for the NIC's
// MAC. A domain that is gone, or not this proxy's, is NotFound. A host no
// longer configured is Permanent: a typo in hosts must not look like a
// vanished VM and get it rebuilt elsewhere.
func (be *Backend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	h, name, ok, err := be.locate(req.GetProviderId())
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, errclass.New(errclass.Permanent, "providerID %q names host %q, which is not configured on provider %s", req.GetProviderId(), hostOf(req.GetProviderId()), be.name)
	}
	var out *provisionerv1.Instance
	err = be.hosts.callHost(ctx, h, func(api libvirtAPI, run commandRunner) error {
		dom, err := api.DomainLookupByName(name)
		if err != nil {
			return err
		}
		m, err := readMark(api, dom)
		if err != nil {
			return err
		}
		if !m.isFor(be.name, req.GetInstallation(), req.GetProxyUid()) {
			return errclass.New(errclass.NotFound, "domain %s on host %s is not this proxy's on provider %s (it carries %s)", name, h.Name, be.name, m.describe())
		}
		if req.GetProxyUid() != "" && m.needsClaim(be.name, req.GetInstallation()) {
			m = be.claim(ctx, api, h, dom, m, req.GetInstallation())
		}
		st, reason, err := api.DomainGetState(dom, 0)
		if err != nil {
			return err
		}
		ip, source := "", ""
		if s := libvirt.DomainState(st); s == libvirt.DomainRunning || s == libvirt.DomainBlocked {
			ip, source = be.address(ctx, api, run, h, dom)
		}
		out = be.instance(h, name, req.GetProviderId(), m, libvirt.DomainState(st), reason, ip)
		if source != "" {
			out.Details["addressSource"] = source
		}
		return nil
	})
	if err != nil {
		return nil, classify(err)
	}
	return out, nil
}

func hostOf(id string) string {
	h, _, _ := parseProviderID(id)
	return h
}

// Where an address came from (the instance's addressSource detail).
const (
	sourceAgent      = "guest-agent"
	sourceARP        = "libvirt-arp"
	sourceNeighbours = "host-neighbours"
)

// address asks the guest agent, then libvirt's ARP source, then the
// host's neighbour table read over the SSH link, for the NIC's MAC. None
// answering is not an error: the domain is still booting. A neighbour
// table that cannot be read is a WARNING once per host (until it can be
// read again), since it leaves guests without an agent Provisioning.
func (be *Backend) address(ctx context.Context, api libvirtAPI, run commandRunner, h Host, dom libvirt.Domain) (ip, source string) {
	ifaces, err := api.DomainInterfaceAddresses(dom, uint32(libvirt.DomainInterfaceAddressesSrcAgent), 0)
	if err == nil {
		if ip := firstIPv4(ifaces, nil); ip != "" {
			return ip, sourceAgent
		}
	} else {
		be.log.DebugContext(ctx, "guest agent has no address", "domain", dom.Name, "error", err.Error())
	}
	x, err := api.DomainGetXMLDesc(dom, 0)
	if err != nil {
		return "", ""
	}
	macs := domainMACs(x)
	if len(macs) == 0 {
		return "", ""
	}
	ifaces, err = api.DomainInterfaceAddresses(dom, uint32(libvirt.DomainInterfaceAddressesSrcArp), 0)
	if err == nil {
		if ip := firstIPv4(ifaces, macs); ip != "" {
			return ip, sourceARP
		}
	} else {
		be.log.DebugContext(ctx, "libvirt's ARP source has no address", "domain", dom.Name, "error", err.Error())
	}
	start := time.Now()
	ns, err := hostNeighbours(ctx, h.Name, run)
	if err != nil {
		be.neighbourFailed(ctx, h, dom.Name, err)
		return "", ""
	}
	be.neighbourWarned.Delete(h.Name)
	ip = neighbourAddress(ns, macs)
	be.log.DebugContext(ctx, "host neighbour table read", "domain", dom.Name, "entries", len(ns), "ip", ip, "duration", time.Since(start))
	if ip == "" {
		return "", ""
	}
	return ip, sourceNeighbours
}

// neighbourFailed logs a neighbour table that could not be read: a
// WARNING the first time a host fails permanently, debug otherwise.
func (be *Backend) neighbourFailed(ctx context.Context, h Host, domain string, err error) {
	if errclass.Is(err, errclass.Permanent) {
		if _, warned := be.neighbourWarned.LoadOrStore(h.Name, true); !warned {
			be.log.WarnContext(ctx, "WARNING: the kvm host's neighbour table cannot be read over SSH; guests without a guest agent stay Provisioning",
				"host", h.Name, "error", err.Error())
			return
		}
	}
	be.log.DebugContext(ctx, "host neighbour table not read", "host", h.Name, "domain", domain,
		"class", errclass.Of(err).String(), "error", err.Error())
}

// firstIPv4 is the first global IPv4 address, of an interface with one of
// macs when given.
func firstIPv4(ifaces []libvirt.DomainInterface, macs []string) string {
	for _, i := range ifaces {
		if macs != nil {
			found := false
			for _, m := range macs {
				if len(i.Hwaddr) > 0 && equalFoldMAC(i.Hwaddr[0], m) {
					found = true
				}
			}
			if !found {
				continue
			}
		}
		for _, a := range i.Addrs {
			ip := net.ParseIP(a.Addr)
			if a.Type == int32(libvirt.IPAddrTypeIpv4) && ip != nil && ip.To4() != nil && !ip.IsLoopback() && !ip.IsLinkLocalUnicast() {
				return ip.String()
			}
		}
	}
	return ""
}

func equalFoldMAC(a, b string) bool {
	x, err1 := net.ParseMAC(a)
	y, err2 := net.ParseMAC(b)
	return err1 == nil && err2 == nil && x.String() == y.String()
}

// undefineFlags removes everything libvirt keeps next to a definition, the
// UEFI variable store included.
const undefineFlags = libvirt.DomainUndefineNvram | libvirt.DomainUndefineManagedSave |
	libvirt.DomainUndefineSnapshotsMetadata | libvirt.DomainUndefineCheckpointsMetadata

// Delete destroys and undefines the proxy's domain (with its NVRAM) and
// removes its overlay and seed volumes by name, also when the domain is
// already gone, so a crash between the volumes and the define is cleaned
// up. A domain with the name but another mark is left alone. A host no
// longer configured is success: nothing there can be reached any more.
func (be *Backend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	h, name, ok, err := be.locate(req.GetProviderId())
	if err != nil {
		return false, err
	}
	if !ok {
		be.log.WarnContext(ctx, "WARNING: the instance's host is no longer configured; nothing to delete, its domain and volumes stay on that host",
			"provider_id", req.GetProviderId())
		return false, nil
	}
	deleted := false
	err = be.hosts.call(ctx, h, func(api libvirtAPI) error {
		dom, err := api.DomainLookupByName(name)
		switch {
		case err == nil:
			m, err := readMark(api, dom)
			if err != nil {
				return err
			}
			if !m.isFor(be.name, req.GetInstallation(), req.GetProxyUid()) {
				be.log.WarnContext(ctx, "domain with the proxy's name is not this proxy's; left untouched", "host", h.Name, "domain", name,
					"markProvider", m.Provider, "markInstallation", m.Installation, "markUID", m.UID)
				return nil
			}
			if err := api.DomainDestroy(dom); err != nil && !hasCode(err, libvirt.ErrOperationInvalid) && !hasCode(err, libvirt.ErrNoDomain) {
				return err
			}
			if err := api.DomainUndefineFlags(dom, undefineFlags); err != nil && !hasCode(err, libvirt.ErrNoDomain) {
				return err
			}
			deleted = true
		case !hasCode(err, libvirt.ErrNoDomain):
			return err
		}
		pool, err := api.StoragePoolLookupByName(h.Pool)
		if hasCode(err, libvirt.ErrNoStoragePool) {
			return nil // no pool, no volumes
		}
		if err != nil {
			return err
		}
		for _, v := range []string{overlayName(name), seedName(name)} {
			if err := deleteVolume(api, pool, v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		err = classify(err)
		if errclass.Is(err, errclass.NotFound) {
			err = errclass.Wrap(errclass.Transient, err)
		}
		return false, err
	}
	return deleted, nil
}

// List returns every marked domain on every host. A host that cannot be
// reached is logged and skipped, so it does not hide the others; only when
// no host answers is List an error. Addresses are not looked up.
func (be *Backend) List(ctx context.Context) ([]*provisionerv1.Instance, error) {
	type result struct {
		ins []*provisionerv1.Instance
		err error
	}
	res := make([]result, len(be.cfg.Hosts))
	var wg sync.WaitGroup
	for i, h := range be.cfg.Hosts {
		wg.Go(func() {
			res[i].ins, res[i].err = be.listHost(ctx, h)
		})
	}
	wg.Wait()
	var out []*provisionerv1.Instance
	var errs []error
	for i, r := range res {
		if r.err != nil {
			h := be.cfg.Hosts[i]
			be.log.WarnContext(ctx, "WARNING: kvm host skipped in List", "host", h.Name, "error", r.err.Error())
			errs = append(errs, fmt.Errorf("host %s: %w", h.Name, r.err))
			continue
		}
		out = append(out, r.ins...)
	}
	if len(errs) == len(be.cfg.Hosts) {
		return nil, classify(errors.Join(errs...))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ProviderId < out[j].ProviderId })
	return out, nil
}

func (be *Backend) listHost(ctx context.Context, h Host) ([]*provisionerv1.Instance, error) {
	var out []*provisionerv1.Instance
	err := be.hosts.call(ctx, h, func(api libvirtAPI) error {
		// One call for every domain's name and state; then one per proxy
		// domain for its mark.
		recs, err := api.ConnectGetAllDomainStats(nil, uint32(libvirt.DomainStatsState), 0)
		if err != nil {
			return err
		}
		for _, r := range recs {
			d := r.Dom
			if !strings.HasPrefix(d.Name, namePrefix) {
				continue
			}
			m, err := readMark(api, d)
			if hasCode(err, libvirt.ErrNoDomain) {
				continue // deleted meanwhile
			}
			if err != nil {
				return err
			}
			switch m.ownedBy(be.name) {
			case owned:
			case legacy:
				be.warnLegacy(ctx, h, d.Name, m)
				continue
			default:
				continue
			}
			st, reason := statsState(r)
			out = append(out, be.instance(h, d.Name, providerID(h.Name, d.Name), m, st, reason, ""))
		}
		return nil
	})
	return out, err
}

// statsState reads state.state and state.reason from a domain stats
// record.
func statsState(r libvirt.DomainStatsRecord) (libvirt.DomainState, int32) {
	st, reason := libvirt.DomainNostate, int32(0)
	for _, p := range r.Params {
		var v int64
		switch n := p.Value.I.(type) {
		case int32:
			v = int64(n)
		case uint32:
			v = int64(n)
		case int64:
			v = n
		default:
			continue
		}
		switch p.Field {
		case "state.state":
			st = libvirt.DomainState(v)
		case "state.reason":
			reason = int32(v)
		}
	}
	return st, reason
}

// formatVersion decodes libvirt's major*1e6 + minor*1e3 + micro.
func formatVersion(v uint64) string {
	return strconv.FormatUint(v/1_000_000, 10) + "." + strconv.FormatUint(v/1_000%1_000, 10) + "." + strconv.FormatUint(v%1_000, 10)
}
