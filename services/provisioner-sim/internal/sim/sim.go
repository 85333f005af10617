// Package sim is the simulator backend: instances on a farm (internal/farm)
// that exist the moment they are made, each a real forward proxy at an
// address of its own in 127.0.0.0/8. It serves the Provisioner contract
// like every backend, so that the orchestrator, lease and health can be
// run against a fleet of 100,000 proxies on one machine. Instances serve
// anyone: the proxy's credentials are not enforced.
package sim

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/provisioner"
	"github.com/egress-proxies/egress-proxies/services/provisioner-sim/internal/farm"
)

// Config is the `sim:` block of a provider.
type Config struct {
	// Farm is the farm's API URL (http://127.0.0.1:port), which
	// `provisioner-sim farm` logs when it is ready.
	Farm string `yaml:"farm"`
	// Network is the loopback prefix instance addresses come from.
	// Default 127.96.0.0/12 (about a million addresses).
	Network string `yaml:"network"`
}

// Backend implements provisioner.Backend on a farm.
type Backend struct {
	farm    *farm.Client
	network netip.Prefix
	log     *slog.Logger
}

// FromProvider builds the backend from its provider block.
func FromProvider(p providers.Provider, log *slog.Logger) (*Backend, error) {
	var c Config
	if err := p.DecodeBackend(&c); err != nil {
		return nil, err
	}
	u, err := url.Parse(c.Farm)
	if err != nil || u.Scheme != "http" || u.Host == "" {
		return nil, fmt.Errorf("%s.sim.farm: %q must be the farm's http://host:port", p.Path, c.Farm)
	}
	network := c.Network
	if network == "" {
		network = "127.96.0.0/12"
	}
	pfx, err := netip.ParsePrefix(network)
	if err != nil || !pfx.Addr().Is4() || !pfx.Addr().IsLoopback() || pfx.Bits() < 8 {
		return nil, fmt.Errorf("%s.sim.network: %q must be an IPv4 prefix within 127.0.0.0/8", p.Path, network)
	}
	return &Backend{farm: farm.NewClient(strings.TrimRight(c.Farm, "/")), network: pfx.Masked(), log: log}, nil
}

// idPrefix starts every instance ID the simulator makes: sim-<proxy UID>.
const idPrefix = "sim-"

func instanceID(uid string) string { return idPrefix + uid }

// classify turns a farm call's failure into the contract's classes: a
// farm that cannot be reached is Transient, as an unreachable cloud is.
func classify(err error, what string) error {
	var se *farm.StatusError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &se) && se.Code == http.StatusNotFound:
		return errclass.New(errclass.NotFound, "%s does not exist", what)
	case errors.As(err, &se) && se.Code == http.StatusInsufficientStorage:
		return errclass.New(errclass.QuotaExceeded, "%s: %s", what, se.Message)
	case errors.As(err, &se) && se.Code == http.StatusBadRequest:
		return errclass.New(errclass.Permanent, "%s: %s", what, se.Message)
	default:
		return errclass.New(errclass.Transient, "%s: the farm: %v", what, err)
	}
}

func (b *Backend) instance(in farm.Instance) *provisionerv1.Instance {
	return &provisionerv1.Instance{
		ProviderId: in.ID, ProxyUid: in.ProxyUID, Name: in.Name, Installation: in.Installation,
		State: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, Ip: in.Address,
		CreateTime: timestamppb.New(in.CreateTime),
		Details:    map[string]string{"port": strconv.FormatUint(uint64(in.Port), 10)},
	}
}

// Create implements provisioner.Backend: idempotent per proxy UID.
func (b *Backend) Create(ctx context.Context, req *provisionerv1.CreateInstanceRequest) (*provisionerv1.Instance, error) {
	uid := req.GetProxyUid()
	if uid == "" || strings.ContainsAny(uid, "/?#%") {
		return nil, errclass.New(errclass.Permanent, "proxy UID %q is not usable", uid)
	}
	if p := req.GetPort(); p == 0 || p > 65535 {
		return nil, errclass.New(errclass.Permanent, "port %d is not a TCP port", p)
	}
	id := instanceID(uid)
	for range 3 {
		in, err := b.farm.Get(ctx, id)
		if farm.IsStatus(err, http.StatusNotFound) {
			in, err = b.farm.Create(ctx, farm.Instance{ID: id, ProxyUID: uid, Installation: req.GetInstallation(), Marked: true,
				Name: "proxy-" + uid, Port: req.GetPort()}, b.network)
			if farm.IsStatus(err, http.StatusConflict) {
				continue // made meanwhile by another replica: read it
			}
			if err != nil {
				return nil, classify(err, "instance "+id)
			}
			return b.instance(in), nil
		}
		if err != nil {
			return nil, classify(err, "instance "+id)
		}
		switch {
		case !in.Marked || in.ProxyUID != uid:
			return nil, errclass.New(errclass.Permanent, "instance %s exists and is not an instance of this provisioner for proxy %s; it was left untouched, remove it", id, uid).
				WithMetadata("instance", id)
		case in.Installation != "" && in.Installation != req.GetInstallation():
			return nil, errclass.New(errclass.Permanent, "instance %s is installation %s's, not %s: two installations hold proxy UID %s (a copied database?); it was left untouched",
				id, in.Installation, req.GetInstallation(), uid)
		}
		if in, err = b.claim(ctx, in, req.GetInstallation()); err != nil {
			return nil, err
		}
		return b.instance(in), nil
	}
	return nil, errclass.New(errclass.Transient, "instance %s changed under every attempt to create it", id)
}

// claim writes installation into the mark of an instance made before
// marks named one.
func (b *Backend) claim(ctx context.Context, in farm.Instance, installation string) (farm.Instance, error) {
	if installation == "" || in.Installation != "" {
		return in, nil
	}
	out, err := b.farm.Mark(ctx, in.ID, in.ProxyUID, installation, true)
	if err != nil {
		return in, classify(err, "instance "+in.ID)
	}
	b.log.Info("sim instance marked before installations claimed for this installation", "provider_id", in.ID, "installation", installation)
	return out, nil
}

// ours reads providerID's instance and checks it is the proxy's and
// installation's.
func (b *Backend) ours(ctx context.Context, providerID, proxyUID, installation string) (farm.Instance, error) {
	if !strings.HasPrefix(providerID, idPrefix) || strings.ContainsAny(providerID, "/?#%") {
		return farm.Instance{}, errclass.New(errclass.Permanent, "providerID %q is not %s<uid>", providerID, idPrefix)
	}
	in, err := b.farm.Get(ctx, providerID)
	if err != nil {
		return farm.Instance{}, classify(err, "instance "+providerID)
	}
	switch {
	case !in.Marked:
		return farm.Instance{}, errclass.New(errclass.NotFound, "instance %s is not this provisioner's", providerID)
	case proxyUID != "" && in.ProxyUID != proxyUID:
		return farm.Instance{}, errclass.New(errclass.NotFound, "instance %s belongs to proxy %s, not %s", providerID, in.ProxyUID, proxyUID)
	case in.Installation != "" && in.Installation != installation:
		return farm.Instance{}, errclass.New(errclass.NotFound, "instance %s is installation %s's", providerID, in.Installation)
	}
	return in, nil
}

// Get implements provisioner.Backend.
func (b *Backend) Get(ctx context.Context, req *provisionerv1.GetInstanceRequest) (*provisionerv1.Instance, error) {
	in, err := b.ours(ctx, req.GetProviderId(), req.GetProxyUid(), req.GetInstallation())
	if err != nil {
		return nil, err
	}
	if req.GetProxyUid() != "" {
		if in, err = b.claim(ctx, in, req.GetInstallation()); err != nil {
			return nil, err
		}
	}
	return b.instance(in), nil
}

// Delete implements provisioner.Backend: another proxy's, another
// installation's or someone else's instance is left alone.
func (b *Backend) Delete(ctx context.Context, req *provisionerv1.DeleteInstanceRequest) (bool, error) {
	in, err := b.ours(ctx, req.GetProviderId(), req.GetProxyUid(), req.GetInstallation())
	if errclass.Is(err, errclass.NotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	err = b.farm.Delete(ctx, in.ID)
	if farm.IsStatus(err, http.StatusNotFound) {
		return false, nil
	}
	if err != nil {
		return false, classify(err, "instance "+in.ID)
	}
	return true, nil
}

// List implements provisioner.Backend: every marked instance.
func (b *Backend) List(ctx context.Context) ([]*provisionerv1.Instance, error) {
	all, err := b.farm.List(ctx)
	if err != nil {
		return nil, classify(err, "the instance list")
	}
	out := make([]*provisionerv1.Instance, 0, len(all))
	for _, in := range all {
		if in.Marked {
			out = append(out, b.instance(in))
		}
	}
	return out, nil
}

// Check implements provisioner.Checker: the farm answers (its count of
// instances, not their list: a check must stay cheap at 100,000).
func (b *Backend) Check(ctx context.Context) []*provisionerv1.TargetStatus {
	start := time.Now()
	t := &provisionerv1.TargetStatus{Name: "farm", Address: b.farm.Base, Ready: true, Reason: provisioner.ReasonReachable,
		Details: map[string]string{"network": b.network.String()}}
	if st, err := b.farm.Stats(ctx); err != nil {
		t.Ready, t.Reason, t.Message = false, provisioner.ReasonUnreachable, err.Error()
	} else {
		t.Details["instances"] = strconv.Itoa(st.Instances)
	}
	t.Latency = durationpb.New(time.Since(start))
	return []*provisionerv1.TargetStatus{t}
}
