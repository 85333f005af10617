package pool

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
)

// Defaults of ProviderHealth.
const (
	DefaultProviderHealthInterval = 5 * time.Second
	DefaultProviderHealthStale    = time.Minute
)

// ProviderHealth keeps the providers' backend verdicts the health service
// last gave (ListProviderHealth), polled every Interval. A failed poll
// keeps the last verdicts for StaleAfter from the last good one; past it
// every provider is unknown again, which the pools treat as healthy: a
// lost health service must not move proxies away from every provider.
type ProviderHealth struct {
	// Health is the health service's API (ListProviderHealth with a
	// service token).
	Health healthv1.HealthServiceClient
	// Interval between polls; 0 means DefaultProviderHealthInterval.
	Interval time.Duration
	// StaleAfter is how long the last verdicts hold without a good poll;
	// 0 means DefaultProviderHealthStale.
	StaleAfter time.Duration
	Log        *slog.Logger
	// Changed, when set, is called after a poll that changed the verdicts
	// (the controller then syncs the pools at once).
	Changed func()
	// PollFailures, when set, counts the failed polls: the log warns once
	// per spell, the counter shows how long a spell lasts.
	PollFailures prometheus.Counter

	now func() time.Time

	mu       sync.Mutex
	notReady map[string]string
	goodAt   time.Time
	failing  bool // in a spell of failed polls (warned once)
	stale    bool // the verdicts were dropped (warned once)
}

func (h *ProviderHealth) clock() time.Time {
	if h.now != nil {
		return h.now()
	}
	return time.Now()
}

// NotReady returns the providers whose backends the health service last
// found NOT_READY, each with why; nil when none or unknown.
func (h *ProviderHealth) NotReady() map[string]string {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.goodAt.IsZero() || h.clock().Sub(h.goodAt) > h.staleAfter() {
		return nil
	}
	if len(h.notReady) == 0 {
		return nil
	}
	return maps.Clone(h.notReady)
}

func (h *ProviderHealth) staleAfter() time.Duration {
	if h.StaleAfter > 0 {
		return h.StaleAfter
	}
	return DefaultProviderHealthStale
}

// Run polls every Interval until ctx ends. Call Poll once before, so
// the pools' first sync already knows the providers' health.
func (h *ProviderHealth) Run(ctx context.Context) error {
	t := time.NewTicker(h.interval())
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
			h.Poll(ctx, h.interval())
		}
	}
}

func (h *ProviderHealth) interval() time.Duration {
	if h.Interval > 0 {
		return h.Interval
	}
	return DefaultProviderHealthInterval
}

// Poll asks the health service once, within timeout.
func (h *ProviderHealth) Poll(ctx context.Context, timeout time.Duration) {
	pctx, cancel := context.WithTimeout(ctx, timeout)
	resp, err := h.Health.ListProviderHealth(pctx, &healthv1.ListProviderHealthRequest{})
	cancel()
	if ctx.Err() != nil {
		return
	}
	if err != nil && h.PollFailures != nil {
		h.PollFailures.Inc()
	}
	h.mu.Lock()
	if err != nil {
		var warn, drop bool
		if !h.failing {
			h.failing, warn = true, true
		}
		if !h.goodAt.IsZero() && !h.stale && h.clock().Sub(h.goodAt) > h.staleAfter() {
			h.stale, drop = true, len(h.notReady) > 0
		}
		h.mu.Unlock()
		if warn {
			h.Log.Warn("WARNING: reading the providers' health failed; pools keep the last verdicts for a while",
				"keptFor", h.staleAfter(), "error", err)
		}
		if drop {
			h.Log.Warn("WARNING: the providers' health is unknown: pools spread over every provider until the health service answers")
			if h.Changed != nil {
				h.Changed()
			}
		}
		return
	}
	next := map[string]string{}
	for _, p := range resp.GetProviders() {
		if p.GetReadiness() == healthv1.ProviderReadiness_PROVIDER_READINESS_NOT_READY {
			next[p.GetProvider()] = notReadyWhy(p)
		}
	}
	recovered := h.failing
	changed := h.stale || !maps.Equal(h.notReady, next)
	h.notReady, h.goodAt, h.failing, h.stale = next, h.clock(), false, false
	h.mu.Unlock()
	if recovered {
		h.Log.Info("reading the providers' health works again")
	}
	if changed {
		h.Log.Info("providers' health changed", "notReady", fmt.Sprint(next))
		if h.Changed != nil {
			h.Changed()
		}
	}
}

// notReadyWhy is the health service's reason and the targets that failed,
// e.g. "TargetsNotReady: pve1 Unreachable".
func notReadyWhy(p *healthv1.ProviderHealth) string {
	why := p.GetReason()
	var bad []string
	for _, t := range p.GetTargets() {
		if !t.GetReady() {
			bad = append(bad, strings.TrimSpace(t.GetName()+" "+t.GetReason()))
		}
	}
	if len(bad) > 0 {
		why += ": " + strings.Join(bad, ", ")
	}
	return why
}
