package gcp

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net/http"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"

	compute "cloud.google.com/go/compute/apiv1"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/api/option"
	htransport "google.golang.org/api/transport/http"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
)

// Backend is the Compute Engine backend.
type Backend struct {
	name string // provider name
	cfg  Config
	log  *slog.Logger
	now  func() time.Time
	opts Options

	requestTimeout time.Duration
	operationWait  time.Duration
	poll           time.Duration

	mu      sync.Mutex
	clients *clients // built on first use; nil until then or after a failure

	// probes are health-check requests Check stopped waiting for; Close
	// lets them end (the client's timeout bounds them) before closing.
	probes sync.WaitGroup
}

type clients struct {
	instances *compute.InstancesClient
}

// Options adjust a Backend.
type Options struct {
	// WirePayloads logs every request and response body at DEBUG, with the
	// user-data metadata redacted (--gcp-wire-payloads).
	WirePayloads bool
	// Poll is the interval between operation polls (1s by default).
	Poll time.Duration
	// ListPageSize is List's page size (Compute's maximum, 500, by
	// default; tests make pages small).
	ListPageSize int
	// Now is the clock (time.Now by default).
	Now func() time.Time
	// TracerProvider traces the HTTP requests (the global one by default).
	TracerProvider trace.TracerProvider
}

// FromProvider decodes the provider's gcp block and builds the backend.
func FromProvider(p providers.Provider, log *slog.Logger, opts Options) (*Backend, error) {
	var cfg Config
	if err := p.DecodeBackend(&cfg); err != nil {
		return nil, err
	}
	return New(p.Name, cfg, log, opts)
}

// New validates cfg and builds the backend. It makes no request and reads
// no credentials: those are loaded on first use, so a provisioner starts
// while they are missing (it logs a WARNING then).
func New(provider string, cfg Config, log *slog.Logger, opts Options) (*Backend, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("gcp: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("backend", "gcp", "project", cfg.Project)
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Poll <= 0 {
		opts.Poll = time.Second
	}
	if opts.ListPageSize <= 0 {
		opts.ListPageSize = listPageSize
	}
	be := &Backend{name: provider, cfg: cfg, log: log, now: opts.Now, opts: opts,
		requestTimeout: time.Duration(cfg.RequestTimeoutSeconds) * time.Second,
		operationWait:  time.Duration(*cfg.OperationWaitSeconds) * time.Second,
		poll:           opts.Poll,
	}
	switch {
	case cfg.WithoutAuthentication:
		log.Warn("WARNING: withoutAuthentication is set; requests carry no credentials", "endpoint", cfg.Endpoint)
	case cfg.CredentialsFile != "":
		if f, err := os.Open(cfg.CredentialsFile); err == nil {
			_ = f.Close()
		} else {
			log.Warn("WARNING: credentials file is not readable; every call fails until it is", "path", cfg.CredentialsFile, "reason", pathReason(err))
		}
	default:
		if p := os.Getenv("GOOGLE_APPLICATION_CREDENTIALS"); p != "" {
			if _, err := os.Stat(p); err != nil {
				log.Warn("WARNING: GOOGLE_APPLICATION_CREDENTIALS names a file that is not readable; every call fails until it is", "path", p, "reason", pathReason(err))
			}
		}
	}
	if opts.WirePayloads {
		log.Warn("WARNING: GCP wire payload logging is on; request and response bodies go to the DEBUG log (user-data redacted)")
	}
	return be, nil
}

func pathReason(err error) string {
	var pe *fs.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// client returns the Compute clients, building them on first use. A
// missing credentials file is Transient (it may appear: a Secret mounted
// late); a file that is not a service-account key is Permanent.
func (be *Backend) client(ctx context.Context) (*clients, error) {
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.clients != nil {
		return be.clients, nil
	}
	opts := []option.ClientOption{
		// The SDK's own logger would log bodies, user-data included, when
		// GOOGLE_SDK_GO_LOGGING_LEVEL=debug; the wire transport logs instead.
		option.WithLogger(slog.New(slog.DiscardHandler)),
		option.WithScopes(compute.DefaultAuthScopes()...),
	}
	if be.cfg.Endpoint != "" {
		opts = append(opts, option.WithEndpoint(be.cfg.Endpoint))
	}
	switch {
	case be.cfg.WithoutAuthentication:
		opts = append(opts, option.WithoutAuthentication())
	case be.cfg.CredentialsFile != "":
		data, err := os.ReadFile(be.cfg.CredentialsFile)
		if err != nil {
			return nil, errclass.New(errclass.Transient, "credentials file %s: %s", be.cfg.CredentialsFile, pathReason(err)).WithMetadata("credentialsFile", be.cfg.CredentialsFile)
		}
		if err := checkServiceAccountKey(data); err != nil {
			return nil, errclass.New(errclass.Permanent, "credentials file %s is not a service-account key: %v", be.cfg.CredentialsFile, err).WithMetadata("credentialsFile", be.cfg.CredentialsFile)
		}
		opts = append(opts, option.WithAuthCredentialsJSON(option.ServiceAccount, data))
	}
	base := http.DefaultTransport.(*http.Transport).Clone()
	var rt http.RoundTripper = &wire{base: base, log: be.log, payloads: be.opts.WirePayloads}
	var otelOpts []otelhttp.Option
	if be.opts.TracerProvider != nil {
		otelOpts = append(otelOpts, otelhttp.WithTracerProvider(be.opts.TracerProvider))
	}
	rt = otelhttp.NewTransport(rt, otelOpts...)
	authed, err := htransport.NewTransport(ctx, rt, opts...)
	if err != nil {
		// Application default credentials not found, or a file the auth
		// library refuses.
		class := errclass.Transient
		if be.cfg.CredentialsFile != "" {
			class = errclass.Permanent
		}
		return nil, errclass.New(class, "gcp credentials: %v", err)
	}
	// The client's own timeout bounds every request: the SDK's
	// AggregatedList builds its requests without the caller's context.
	hc := &http.Client{Transport: authed, Timeout: be.requestTimeout}
	instances, err := compute.NewInstancesRESTClient(ctx, append(opts, option.WithHTTPClient(hc))...)
	if err != nil {
		return nil, errclass.New(errclass.Transient, "compute client: %v", err)
	}
	be.clients = &clients{instances: instances}
	return be.clients, nil
}

// Close releases the clients.
func (be *Backend) Close() error {
	be.probes.Wait()
	be.mu.Lock()
	defer be.mu.Unlock()
	if be.clients == nil {
		return nil
	}
	err := be.clients.instances.Close()
	be.clients = nil
	return err
}

// call bounds one API request.
func (be *Backend) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, be.requestTimeout)
}

// ---- names, labels and provider IDs ----

const (
	labelPrefix    = "proxy-operator-"
	labelManaged   = labelPrefix + "managed"
	labelUID       = labelPrefix + "uid"
	labelCreatedAt = labelPrefix + "created-at"
	// labelInstallation names the installation (pkg/installation, a valid
	// label value as it is); instances labelled before installations have
	// none.
	labelInstallation = labelPrefix + "installation"
	labelManagedOn    = "true"
	namePrefix        = "proxy-"
	// managedFilter selects the instances this system created.
	managedFilter = "labels." + labelManaged + " = " + labelManagedOn
)

var nonName = regexp.MustCompile(`[^a-z0-9-]+`)

// instanceName is the proxy's deterministic instance name: proxy-<uid>,
// a valid Compute resource name. The same UID always yields the same
// name, so a second insert of one proxy is a 409 rather than a twin.
func instanceName(uid string) (string, error) {
	n := namePrefix + strings.Trim(nonName.ReplaceAllString(strings.ToLower(uid), "-"), "-")
	if len(n) > 63 {
		n = strings.TrimRight(n[:63], "-")
	}
	if n == namePrefix {
		return "", errclass.New(errclass.Permanent, "proxy UID %q yields no instance name", uid)
	}
	return n, nil
}

// labelValue turns a UID into a label value (lowercase, at most 63).
func labelValue(uid string) string {
	v := strings.ToLower(uid)
	if len(v) > 63 {
		v = v[:63]
	}
	return v
}

// mark is what the labels say about an instance.
type mark struct {
	managed      bool
	uid          string
	createdAt    time.Time
	installation string
}

func markOf(labels map[string]string) mark {
	m := mark{managed: labels[labelManaged] == labelManagedOn, uid: labels[labelUID], installation: labels[labelInstallation]}
	if s, err := strconv.ParseInt(labels[labelCreatedAt], 10, 64); err == nil && s > 0 {
		m.createdAt = time.Unix(s, 0).UTC()
	}
	return m
}

// ours reports whether the mark belongs to the proxy with uid of
// installation, or to the proxy with uid from before installations.
func (m mark) ours(uid, installation string) bool {
	return m.managed && m.uid == labelValue(uid) && !m.foreignInstallation(installation)
}

// foreignInstallation reports whether the mark names an installation
// other than installation.
func (m mark) foreignInstallation(installation string) bool {
	return m.installation != "" && m.installation != installation
}

// providerID is zones/<zone>/instances/<name>: the zone is part of it
// because every instance call is zonal.
func providerID(zone, name string) string { return "zones/" + zone + "/instances/" + name }

func parseProviderID(id string) (zone, name string, err error) {
	parts := strings.Split(id, "/")
	if len(parts) == 4 && parts[0] == "zones" && parts[2] == "instances" && zoneRE.MatchString(parts[1]) && resourceRE.MatchString(parts[3]) {
		return parts[1], parts[3], nil
	}
	return "", "", errclass.New(errclass.Permanent, "providerID %q is not zones/<zone>/instances/<name>", id)
}

// lastSegment is the last path segment of a Compute URL
// (…/zones/europe-west1-b → europe-west1-b).
func lastSegment(s string) string {
	if i := strings.LastIndexByte(s, '/'); i >= 0 {
		return s[i+1:]
	}
	return s
}
