package kubernetes

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"strings"
	"sync"
	"time"

	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
)

// Backend is the Kubernetes backend.
type Backend struct {
	name string // provider name
	s    *settings
	log  *slog.Logger
	now  func() time.Time

	mu     sync.Mutex
	client kubernetes.Interface // built on first use; nil until then
	host   string               // the API server's URL, for Check

	cloudInitOnce sync.Once
}

// Options adjust a Backend.
type Options struct {
	// Client replaces the clientset built from the config (tests).
	Client kubernetes.Interface
	// Now is the clock (time.Now by default).
	Now func() time.Time
}

// FromProvider decodes the provider's kubernetes block and builds the
// backend.
func FromProvider(p providers.Provider, log *slog.Logger, opts Options) (*Backend, error) {
	var cfg Config
	if err := p.DecodeBackend(&cfg); err != nil {
		return nil, err
	}
	return New(p.Name, cfg, log, opts)
}

// New validates cfg and builds the backend. It contacts nothing: the
// client is built on first use, so a provisioner starts while its
// kubeconfig is missing (it logs a WARNING then).
func New(provider string, cfg Config, log *slog.Logger, opts Options) (*Backend, error) {
	cfg = cfg.WithDefaults()
	s, err := cfg.compile()
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("backend", "kubernetes", "namespace", cfg.Namespace)
	if opts.Now == nil {
		opts.Now = time.Now
	}
	b := &Backend{name: provider, s: s, log: log, now: opts.Now, client: opts.Client}
	if opts.Client == nil && cfg.Kubeconfig != "" {
		if _, err := os.Stat(cfg.Kubeconfig); err != nil {
			log.Warn("WARNING: kubeconfig is not readable; every call fails until it is", "path", cfg.Kubeconfig, "reason", pathReason(err))
		}
	}
	return b, nil
}

func pathReason(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// restConfig loads the kubeconfig, or the in-cluster config without one.
func (b *Backend) restConfig() (*rest.Config, error) {
	c := b.s.cfg
	if c.Kubeconfig == "" {
		return rest.InClusterConfig()
	}
	rules := &clientcmd.ClientConfigLoadingRules{ExplicitPath: c.Kubeconfig}
	return clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules,
		&clientcmd.ConfigOverrides{CurrentContext: c.Context}).ClientConfig()
}

// clientset returns the client, building it on first use. A config that
// cannot be loaded is Transient: a Secret may be mounted late.
func (b *Backend) clientset() (kubernetes.Interface, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.client != nil {
		return b.client, nil
	}
	rc, err := b.restConfig()
	if err != nil {
		where := "the in-cluster config"
		if b.s.cfg.Kubeconfig != "" {
			where = "kubeconfig " + b.s.cfg.Kubeconfig
		}
		// The loaders' messages name files, never their content.
		return nil, errclass.New(errclass.Transient, "kubernetes client: %s: %s", where, oneLine(err.Error())).WithMetadata("reason", "ConfigUnavailable")
	}
	rc = rest.CopyConfig(rc)
	rc.UserAgent = "egress-proxies-provisioner-kubernetes"
	rc.Timeout = b.s.timeout
	rc.Wrap(func(rt http.RoundTripper) http.RoundTripper { return otelhttp.NewTransport(rt) })
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, errclass.New(errclass.Permanent, "kubernetes client: %s", oneLine(err.Error()))
	}
	b.client, b.host = cs, rc.Host
	return cs, nil
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

// apiHost is the API server's URL once the client is built.
func (b *Backend) apiHost() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.host
}

// call bounds one API request.
func (b *Backend) call(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(ctx, b.s.timeout)
}

// selector picks this provider's pods.
func (b *Backend) selector() string {
	return LabelManagedBy + "=" + ManagedByValue + "," + LabelProvider + "=" + b.name
}

// providerID is <namespace>/<pod name>.
func providerID(ns, name string) string { return ns + "/" + name }

// parseProviderID reads a providerID of this backend's namespace; an ID
// of another namespace is not this provider's (NotFound).
func (b *Backend) parseProviderID(id, uid string) (string, error) {
	if id == "" {
		if uid == "" {
			return "", errclass.New(errclass.Permanent, "provider_id or proxy_uid is required")
		}
		return podName(uid)
	}
	ns, name, ok := strings.Cut(id, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return "", errclass.New(errclass.Permanent, "providerID %q is not <namespace>/<pod>", id)
	}
	if ns != b.s.cfg.Namespace {
		return "", errclass.New(errclass.NotFound, "providerID %q is in namespace %s; this provider's pods are in %s", id, ns, b.s.cfg.Namespace)
	}
	return name, nil
}
