// Package providerhealth asks every configured provider's provisioner to
// check its backend on an interval: all providers concurrently under one timeout, one stored record per
// provider, a log line only when a target goes down, changes its reason or
// comes back, and gauges read at scrape time. Across replicas it runs as a
// singleton: only the holder of a PostgreSQL advisory lock checks (and
// exports the gauges); the others wait to take over.
package providerhealth

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
)

const (
	minInterval    = 10 * time.Second
	defaultTimeout = 15 * time.Second
	// maxMessageLen is the limit on a target's message.
	maxMessageLen = 1024
)

// Reasons of a provider's readiness.
const (
	ReasonAllTargetsReady      = "AllTargetsReady"
	ReasonTargetsNotReady      = "TargetsNotReady"
	ReasonChecksNotImplemented = "ChecksNotImplemented"
	ReasonNoTargets            = "NoTargets"
)

// TargetStatus is one target's verdict from a check.
type TargetStatus struct {
	Name    string
	Address string
	Ready   bool
	Reason  string
	Message string
	Latency time.Duration
	Details map[string]string
}

// ErrNotImplemented is what a Checker returns when its backend has no
// check.
var ErrNotImplemented = errors.New("the provider implements no backend check")

// Checker checks one provider's backend. It never fails as a whole except
// with ErrNotImplemented: a failure is a verdict.
type Checker interface {
	Check(ctx context.Context) ([]TargetStatus, error)
}

// Target is one configured provider; Checker is nil when nothing can check
// it (no provisioner address configured).
type Target struct {
	Name    string
	Type    string
	Checker Checker
}

// Result is the outcome of one provider's latest check.
type Result struct {
	Provider string
	Type     string
	// Supported is false when the provider has no check.
	Supported bool
	// Unconfigured is set when nothing can check the provider: no
	// provisioner address is configured for it.
	Unconfigured bool
	Targets      []TargetStatus
	CheckedAt    time.Time
}

// Store keeps the results.
type Store interface {
	SaveProvider(ctx context.Context, h *healthv1.ProviderHealth) error
	DeleteProvidersExcept(ctx context.Context, keep []string) ([]string, error)
	Providers(ctx context.Context) (map[string]*healthv1.ProviderHealth, error)
}

// Monitor checks the providers.
type Monitor struct {
	Store Store
	// Targets are the providers to check, in config order, asked at every
	// round (the providers config is reloaded on change).
	Targets func() []Target
	// Interval between rounds; 0 turns checking off.
	Interval time.Duration
	// Timeout bounds each round; 0 means min(15s, Interval).
	Timeout time.Duration
	Log     *slog.Logger
	// Lock, when set, makes the monitor a singleton across replicas: it
	// checks only while it holds this advisory lock on a connection of
	// the pool.
	Lock *pgxpool.Pool
	// LockKey is the advisory lock key.
	LockKey int64
	// Retry is how often a replica without the lock tries to take it; 0
	// means Interval.
	Retry time.Duration

	now func() time.Time

	mu     sync.Mutex
	latest []Result
	// prev holds each target's previous verdict for transition logging.
	// Only the checking goroutine touches it.
	prev map[string]TargetStatus
	// cleaned is the set of names the stored health was last cleaned up
	// for; nil before the first round. Only the checking goroutine
	// touches it.
	cleaned []string
}

// cleanupFor removes the stored health of providers not among targets, at
// the first round and whenever the configured set changes.
func (m *Monitor) cleanupFor(ctx context.Context, targets []Target) {
	keep := make([]string, 0, len(targets))
	for _, t := range targets {
		keep = append(keep, t.Name)
	}
	if m.cleaned != nil && slices.Equal(keep, m.cleaned) {
		return
	}
	if m.cleanup(ctx, keep) {
		m.cleaned = keep
	}
}

// ValidateSchedule checks --provider-check-interval and
// --provider-check-timeout: the interval is 0 (off) or at least 10s; the
// timeout is 0 (derived) or positive and no longer than the interval.
func ValidateSchedule(interval, timeout time.Duration) error {
	switch {
	case interval == 0:
		return nil
	case interval < minInterval:
		return fmt.Errorf("--provider-check-interval must be 0 (off) or at least %s, got %s", minInterval, interval)
	case timeout < 0 || timeout > interval:
		return fmt.Errorf("--provider-check-timeout must be at most the interval (%s), got %s", interval, timeout)
	}
	return nil
}

func (m *Monitor) setDefaults() {
	if m.Timeout == 0 {
		m.Timeout = min(defaultTimeout, m.Interval)
	}
	if m.now == nil {
		m.now = time.Now
	}
	if m.Retry == 0 {
		m.Retry = m.Interval
	}
}

// Run checks until ctx ends. With checking off it removes every stored
// record, so none is left claiming a stale Ready, and returns.
func (m *Monitor) Run(ctx context.Context) error {
	if err := ValidateSchedule(m.Interval, m.Timeout); err != nil {
		return err
	}
	m.setDefaults()
	if m.Interval == 0 {
		m.cleanup(ctx, nil)
		m.Log.Info("provider checks are off (--provider-check-interval=0)")
		return nil
	}
	if m.Lock == nil {
		return m.lead(ctx)
	}
	s := &postgres.Singleton{Pool: m.Lock, Key: m.LockKey, Name: "provider checks", Log: m.Log,
		Retry: m.Retry, Watch: min(m.Interval/2, 5*time.Second)}
	return s.Run(ctx, func(ctx context.Context) error {
		defer func() {
			m.mu.Lock()
			m.latest = nil // only the singleton exports gauges
			m.mu.Unlock()
		}()
		return m.lead(ctx)
	})
}

// lead cleans up unconfigured providers, then checks at once and every
// Interval until ctx ends.
func (m *Monitor) lead(ctx context.Context) error {
	m.cleaned = nil // a new leader cleans up before its first round
	m.CheckOnce(ctx)
	t := time.NewTicker(m.Interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			m.CheckOnce(ctx)
		}
	}
}

func (m *Monitor) cleanup(ctx context.Context, keep []string) bool {
	gone, err := m.Store.DeleteProvidersExcept(ctx, keep)
	if err != nil {
		if ctx.Err() == nil {
			m.Log.Error("removing the health of unconfigured providers failed; retried at the next round", "error", err)
		}
		return false
	}
	for _, name := range gone {
		m.Log.Info("removed the health of an unconfigured provider", "provider", name)
	}
	return true
}

// Snapshot returns the latest results in config order (empty on a replica
// that does not run the checks).
func (m *Monitor) Snapshot() []Result {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Result, len(m.latest))
	for i, r := range m.latest {
		r.Targets = slices.Clone(r.Targets)
		out[i] = r
	}
	return out
}

// CheckOnce runs every provider's check concurrently under one timeout,
// then records, logs and stores the results provider by provider. A failed
// write is logged and retried by the next round.
func (m *Monitor) CheckOnce(ctx context.Context) {
	m.setDefaults()
	ctx, span := otel.Tracer("egress/health").Start(ctx, "providerhealth.check")
	defer span.End()
	checkCtx, cancel := context.WithTimeout(ctx, m.Timeout)
	defer cancel()
	targets := m.Targets()
	m.cleanupFor(ctx, targets)
	results := make([]Result, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() { results[i] = m.run(checkCtx, t) })
	}
	wg.Wait()
	if ctx.Err() != nil {
		return
	}

	m.mu.Lock()
	m.latest = results
	m.mu.Unlock()

	// The previous records keep each target's last transition time; if
	// they cannot be read, this round is logged but not stored.
	prev, err := m.Store.Providers(ctx)
	if err != nil {
		m.Log.Error("reading provider health failed; this round is not stored", "error", err)
	}
	notReady := 0
	for _, r := range results {
		for _, ts := range r.Targets {
			if !ts.Ready {
				notReady++
			}
		}
		m.logTransitions(r)
		if err != nil {
			continue
		}
		if err := m.Store.SaveProvider(ctx, BuildHealth(prev[r.Provider], r)); err != nil {
			m.Log.Error("writing provider health failed", "provider", r.Provider, "error", err)
		}
	}
	span.SetAttributes(attribute.Int("providerhealth.providers", len(results)), attribute.Int("providerhealth.targets_not_ready", notReady))
}

func (m *Monitor) run(ctx context.Context, t Target) Result {
	r := Result{Provider: t.Name, Type: t.Type, Unconfigured: t.Checker == nil}
	if t.Checker != nil {
		ts, err := t.Checker.Check(ctx)
		if !errors.Is(err, ErrNotImplemented) {
			r.Supported, r.Targets = true, ts
		}
	}
	r.CheckedAt = m.now()
	return r
}

// logTransitions logs a target going down, staying down for a different
// reason, or coming back. Steady states stay quiet; a target ready the
// first time it is seen logs only at debug.
func (m *Monitor) logTransitions(r Result) {
	if m.prev == nil {
		m.prev = map[string]TargetStatus{}
	}
	for _, ts := range r.Targets {
		key := r.Provider + "/" + ts.Name
		prev, seen := m.prev[key]
		m.prev[key] = ts
		kv := []any{"provider", r.Provider, "target", ts.Name, "address", ts.Address, "reason", ts.Reason}
		switch {
		case !ts.Ready && (!seen || prev.Ready || prev.Reason != ts.Reason):
			m.Log.Warn("WARNING: provider target not ready", append(kv, "message", ts.Message)...)
		case ts.Ready && seen && !prev.Ready:
			m.Log.Info("Provider target ready", append(kv, "latency", ts.Latency.Round(time.Millisecond))...)
		case ts.Ready && !seen:
			m.Log.Debug("Provider target ready", append(kv, "latency", ts.Latency.Round(time.Millisecond))...)
		}
	}
}

// BuildHealth derives a provider's record from its previous one (nil for
// none) and a fresh result. A target keeps its last transition time while
// ready does not flip, and the provider its readiness transition time
// while its readiness stays the same.
func BuildHealth(prev *healthv1.ProviderHealth, r Result) *healthv1.ProviderHealth {
	now := timestamppb.New(r.CheckedAt)
	out := &healthv1.ProviderHealth{Provider: r.Provider, Type: r.Type, LastCheckTime: now}
	before := map[string]*healthv1.ProviderTarget{}
	for _, t := range prev.GetTargets() {
		before[t.GetName()] = t
	}
	ready := 0
	var failing []string
	for _, ts := range r.Targets {
		t := &healthv1.ProviderTarget{
			Name: ts.Name, Address: ts.Address, Ready: ts.Ready, Reason: ts.Reason,
			Message: truncate(ts.Message, maxMessageLen), Latency: durationpb.New(ts.Latency),
			LastTransitionTime: now, Details: ts.Details,
		}
		if b, ok := before[ts.Name]; ok && b.GetReady() == ts.Ready && b.GetLastTransitionTime() != nil {
			t.LastTransitionTime = b.GetLastTransitionTime()
		}
		if ts.Ready {
			ready++
		} else {
			failing = append(failing, ts.Name+": "+ts.Reason)
		}
		out.Targets = append(out.Targets, t)
	}
	if r.Supported {
		out.TargetsReady = fmt.Sprintf("%d/%d", ready, len(r.Targets))
	}
	switch {
	case !r.Supported:
		out.Readiness, out.Reason = healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN, ReasonChecksNotImplemented
		out.Message = "the " + r.Type + " provisioner implements no backend check"
		if r.Unconfigured {
			out.Message = "no provisioner address is configured for this provider (--provisioner)"
		}
	case len(r.Targets) == 0:
		// Nothing was checked, so nothing is known: UNKNOWN, not a verdict
		// that would steer pools away from the provider.
		out.Readiness, out.Reason = healthv1.ProviderReadiness_PROVIDER_READINESS_UNKNOWN, ReasonNoTargets
		out.Message = "the provider has nothing to check"
	case len(failing) == 0:
		out.Readiness, out.Reason = healthv1.ProviderReadiness_PROVIDER_READINESS_READY, ReasonAllTargetsReady
		out.Message = fmt.Sprintf("%d of %d targets ready", ready, len(r.Targets))
	default:
		out.Readiness, out.Reason = healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY, ReasonTargetsNotReady
		out.Message = truncate(strings.Join(failing, "; "), maxMessageLen)
	}
	out.ReadinessTransitionTime = now
	if prev.GetReadiness() == out.Readiness && prev.GetReadinessTransitionTime() != nil {
		out.ReadinessTransitionTime = prev.GetReadinessTransitionTime()
	}
	return out
}

// truncate cuts s to at most n characters.
func truncate(s string, n int) string {
	if utf8.RuneCountInString(s) <= n {
		return s
	}
	return string([]rune(s)[:n-1]) + "…"
}
