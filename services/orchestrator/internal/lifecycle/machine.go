package lifecycle

import (
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"

	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Timing is the state machine's schedule.
type Timing struct {
	// Deadlines per operation: a command unanswered by then is issued again.
	CreateDeadline, GetDeadline, DeleteDeadline time.Duration
	// ProvisioningPoll is how often an instance without an address is read.
	ProvisioningPoll time.Duration
	// Resync is how often a running instance is read to notice it vanished.
	Resync time.Duration
	// DeletionPoll is how often a deleted instance is read until it is gone.
	DeletionPoll time.Duration
	// Transient errors back off exponentially from TransientBase to
	// TransientMax; quota errors from QuotaBase to QuotaMax. Both with ±20%
	// jitter.
	TransientBase, TransientMax time.Duration
	QuotaBase, QuotaMax         time.Duration
	// UnconfiguredRetry is how often a proxy whose provider is missing from
	// the config is looked at again.
	UnconfiguredRetry time.Duration
	// StoppedGrace is how long an instance may stay stopped before it is
	// replaced; 0 never replaces it.
	StoppedGrace time.Duration
}

// DefaultTiming is the production schedule.
func DefaultTiming() Timing {
	return Timing{
		CreateDeadline:    20 * time.Minute,
		GetDeadline:       2 * time.Minute,
		DeleteDeadline:    15 * time.Minute,
		ProvisioningPoll:  2 * time.Second,
		Resync:            5 * time.Minute,
		DeletionPoll:      2 * time.Second,
		TransientBase:     time.Second,
		TransientMax:      5 * time.Minute,
		QuotaBase:         30 * time.Second,
		QuotaMax:          30 * time.Minute,
		UnconfiguredRetry: time.Minute,
		StoppedGrace:      5 * time.Minute,
	}
}

// Machine holds what the rules of the reconcile queue depend on besides
// the proxy: the schedule and the providers config. The rules that need
// neither (New, Update, RequestDelete, Drain, ApplyHealth) are functions.
type Machine struct {
	Timing Timing
	// Installation names this installation in every command's request
	// (pkg/installation).
	Installation string
	// Configured reports whether a provider is in the providers config.
	Configured func(string) bool
	Log        *slog.Logger
	// NoJitter turns off the ±20% jitter of the backoffs; tests set it.
	NoJitter bool
}

// backoff is base·2^(attempt-1), capped at max, with ±20% jitter.
func (m *Machine) backoff(attempt int32, base, max time.Duration) time.Duration {
	b := &backoff.ExponentialBackOff{InitialInterval: base, Multiplier: 2, MaxInterval: max, RandomizationFactor: 0.2}
	if m.NoJitter {
		b.RandomizationFactor = 0
	}
	// The attempt count is stored with the proxy, not the backoff: step to
	// its interval (the cap is reached long before 64 doublings).
	d := b.NextBackOff()
	for i := int32(1); i < min(attempt, 64); i++ {
		d = b.NextBackOff()
	}
	return d
}

// retryDelay is how long p waits after a failure of class: the quota
// backoff for QuotaExceeded, the transient one for everything else.
func (m *Machine) retryDelay(p *Proxy, class errclass.Class) time.Duration {
	if class == errclass.QuotaExceeded {
		return m.backoff(p.Attempts, m.Timing.QuotaBase, m.Timing.QuotaMax)
	}
	return m.backoff(p.Attempts, m.Timing.TransientBase, m.Timing.TransientMax)
}
