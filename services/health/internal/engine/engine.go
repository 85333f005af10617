// Package engine probes proxies on their intervals and turns probe results
// into verdicts: success and failure thresholds before a verdict flips, a
// first verdict, a latency threshold, and a stale-probe guard that drops
// results for an instance that was replaced while its probe ran.
//
// The engine holds only the proxies this replica owns; whoever feeds it
// (the fleet) adds and removes them. Scheduling is one heap of due times
// and one timer for all proxies: every proxy starts at a random point of
// its first round, so probes spread evenly and never synchronise, then
// runs at a fixed rate. The rate adapts (Config.FastInterval): a proxy
// whose verdict is unsettled — none yet, or its latest probes disagree
// with it — is probed at the fast interval, a steady one at its own
// interval, which is never exceeded. A probe still running when its proxy
// is due again is not doubled; that round is skipped.
package engine

import (
	"container/heap"
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

// Spec is what the engine needs to probe one proxy.
type Spec struct {
	UID        string
	Name       string
	ProviderID string
	// Address is host:port of the proxy.
	Address string
	// CredentialsTime is when the proxy's current credentials were made;
	// zero when it has none. Probes authenticate with them.
	CredentialsTime  time.Time
	Interval         time.Duration
	Timeout          time.Duration
	SuccessThreshold int
	FailureThreshold int
	// LatencyThreshold: a slower probe is a failure (TooSlow); 0 is none.
	LatencyThreshold time.Duration
	// Revision is the revision of the proxy snapshot this spec came from;
	// it is stored with the proxy's state, so that forgetting a proxy's
	// health as of one snapshot never removes what was written for a later
	// one.
	Revision int64
}

// Defaults fill what a proxy's health_check leaves unset.
type Defaults struct {
	Interval         time.Duration
	Timeout          time.Duration
	SuccessThreshold int
	FailureThreshold int
}

// DefaultDefaults are the service defaults.
var DefaultDefaults = Defaults{Interval: time.Second, Timeout: time.Second, SuccessThreshold: 2, FailureThreshold: 3}

// MinInterval is the shortest probe interval a proxy may ask for.
const MinInterval = 100 * time.Millisecond

// DefaultTick is the engine's batching of probe starts (Config.Tick).
const DefaultTick = 25 * time.Millisecond

// Validate checks the defaults.
func (d Defaults) Validate() error {
	switch {
	case d.Interval < MinInterval:
		return fmt.Errorf("--probe-interval must be at least %s, got %s", MinInterval, d.Interval)
	case d.Timeout <= 0 || d.Timeout > d.Interval:
		return fmt.Errorf("--probe-timeout must be in (0, --probe-interval=%s], got %s", d.Interval, d.Timeout)
	case d.SuccessThreshold < 1 || d.FailureThreshold < 1:
		return fmt.Errorf("--success-threshold and --failure-threshold must be at least 1")
	}
	return nil
}

// SpecFor decides whether p is probed and how: Running or Ready MANAGED
// proxies at status.ip:status.port, every EXTERNAL proxy at its endpoint.
// A proxy being deleted is never probed.
func SpecFor(p *proxyv1.Proxy, d Defaults) (Spec, bool) {
	if p.GetUid() == "" || p.GetDeleteTime() != nil {
		return Spec{}, false
	}
	var host string
	var port uint32
	switch p.GetSpec().GetMode() {
	case proxyv1.ProxyMode_PROXY_MODE_MANAGED:
		switch p.GetStatus().GetPhase() {
		case proxyv1.ProxyPhase_PROXY_PHASE_RUNNING, proxyv1.ProxyPhase_PROXY_PHASE_READY:
		default:
			return Spec{}, false
		}
		host, port = p.GetStatus().GetIp(), p.GetStatus().GetPort()
		if port == 0 {
			port = p.GetSpec().GetPort()
		}
		if port == 0 {
			port = 3128
		}
	case proxyv1.ProxyMode_PROXY_MODE_EXTERNAL:
		if p.GetStatus().GetPhase() == proxyv1.ProxyPhase_PROXY_PHASE_DELETING {
			return Spec{}, false
		}
		host, port = p.GetSpec().GetEndpoint().GetHost(), p.GetSpec().GetEndpoint().GetPort()
	default:
		return Spec{}, false
	}
	if host == "" || port == 0 || port > 65535 {
		return Spec{}, false
	}
	hc := p.GetSpec().GetHealthCheck()
	s := Spec{
		UID:              p.GetUid(),
		Name:             p.GetName(),
		ProviderID:       p.GetStatus().GetProviderId(),
		Address:          joinHostPort(host, port),
		CredentialsTime:  credentialsTime(p),
		Interval:         d.Interval,
		Timeout:          d.Timeout,
		SuccessThreshold: d.SuccessThreshold,
		FailureThreshold: d.FailureThreshold,
	}
	if v := hc.GetInterval(); v != nil && v.AsDuration() >= MinInterval {
		s.Interval = v.AsDuration()
	}
	if v := hc.GetTimeout(); v != nil && v.AsDuration() > 0 {
		s.Timeout = v.AsDuration()
	}
	s.Timeout = min(s.Timeout, s.Interval)
	if v := hc.GetSuccessThreshold(); v > 0 {
		s.SuccessThreshold = int(v)
	}
	if v := hc.GetFailureThreshold(); v > 0 {
		s.FailureThreshold = int(v)
	}
	if v := hc.GetLatencyThreshold(); v != nil && v.AsDuration() > 0 {
		s.LatencyThreshold = v.AsDuration()
	}
	return s, true
}

func joinHostPort(host string, port uint32) string {
	for i := 0; i < len(host); i++ {
		if host[i] == ':' {
			return "[" + host + "]:" + fmt.Sprint(port)
		}
	}
	return host + ":" + fmt.Sprint(port)
}

// Transition is a flip of a proxy's verdict, or its first verdict.
type Transition struct {
	UID        string
	Name       string
	ProviderID string
	// CredentialsTime is the instance's credentials' (zero: none): with
	// the provider ID, which instance the verdict is for.
	CredentialsTime time.Time
	Healthy         bool
	Reason          string
	Message         string
	Latency         time.Duration
	Time            time.Time
}

// State is the engine's view of one proxy.
type State struct {
	Spec                 Spec
	VerdictKnown         bool
	Healthy              bool
	Reason               string
	Message              string
	Latency              time.Duration
	ConsecutiveSuccesses int
	ConsecutiveFailures  int
	LastProbe            time.Time
	LastTransition       time.Time
}

// ProbeFunc probes the proxy of s (at s.Address, with its credentials if
// s.CredentialsTime is set) under ctx.
type ProbeFunc func(ctx context.Context, s Spec) probe.Result

// Config wires an engine.
type Config struct {
	// Probe runs one probe. Required.
	Probe ProbeFunc
	// OnTransition receives every transition, in order for each proxy. It
	// runs on the probe's goroutine and must not block for long.
	OnTransition func(Transition)
	// OnResult observes every applied probe (metrics).
	OnResult func(s Spec, r probe.Result)
	// OnRemove is called when a proxy leaves the engine.
	OnRemove func(s Spec)
	// MaxConcurrent bounds the probes in flight; 0 means 4096.
	MaxConcurrent int
	// Tick batches probes: the engine wakes at most once a Tick and starts
	// every probe due before its next wake, up to one Tick early — never
	// late, so no proxy waits longer than its interval. Probes started
	// together keep the process (and the network stack) busy instead of
	// waking it for each one (BenchmarkProbeAt1Hz measures the engine as
	// the service runs it). 0 means 25ms.
	Tick time.Duration
	// FastInterval is how often a proxy whose verdict is unsettled is
	// probed (at most its own interval): one with no verdict yet, a healthy
	// one whose last probe failed, an unhealthy one whose last probe
	// passed. A steady proxy is probed at its interval. 0: every proxy at
	// its interval (a fixed cadence).
	FastInterval time.Duration
	// Now and Jitter are the clock and the random source; tests set them.
	Now    func() time.Time
	Jitter func(d time.Duration) time.Duration
}

// Engine schedules and evaluates probes.
type Engine struct {
	cfg Config

	mu      sync.Mutex
	proxies map[string]*entry
	queue   schedule
	wake    chan struct{}
	running sync.WaitGroup
}

type entry struct {
	spec  Spec
	epoch uint64
	next  time.Time
	// started is when the latest probe was started; cadence the current
	// time between probes.
	started  time.Time
	cadence  time.Duration
	index    int // in the heap
	inflight bool
	dirty    bool
	st       State
}

// Job is one due probe.
type Job struct {
	Spec  Spec
	entry *entry
	epoch uint64
}

// New returns an engine.
func New(cfg Config) *Engine {
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Jitter == nil {
		cfg.Jitter = func(d time.Duration) time.Duration {
			if d <= 0 {
				return 0
			}
			return rand.N(d)
		}
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = 4096
	}
	if cfg.Tick <= 0 {
		cfg.Tick = DefaultTick
	}
	return &Engine{cfg: cfg, proxies: map[string]*entry{}, wake: make(chan struct{}, 1)}
}

// Upsert adds a proxy or updates its spec. A new proxy, or a new instance
// (provider ID or address changed), starts over: no verdict, counters at
// zero, first probe at a random point of its first round; a probe of the
// old instance still running is dropped when it returns.
func (e *Engine) Upsert(s Spec) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.upsertLocked(s, nil)
}

func (e *Engine) upsertLocked(s Spec, prior *Verdict) {
	now := e.cfg.Now()
	en, ok := e.proxies[s.UID]
	switch {
	case !ok:
		en = &entry{spec: s, dirty: true}
		en.st.Spec = s
		window := s.Interval
		if prior != nil {
			// Seeded under the same lock as the insert, so no flush ever
			// sees the proxy without its verdict. Taken over from a replica
			// that stopped probing it, it is due soon: within half an
			// interval, so that a replica's death leaves its proxies
			// unprobed for less than two intervals (docs/health.md).
			en.st.VerdictKnown, en.st.Healthy, en.st.LastTransition = true, prior.Healthy, prior.LastTransition
			window = s.Interval / 2
		}
		en.cadence = e.cadence(en)
		en.next = now.Add(e.cfg.Jitter(min(window, en.cadence)))
		e.proxies[s.UID] = en
		heap.Push(&e.queue, en)
	case en.spec.ProviderID != s.ProviderID || en.spec.Address != s.Address || !en.spec.CredentialsTime.Equal(s.CredentialsTime):
		en.epoch++
		en.spec = s
		en.inflight = false
		en.st = State{Spec: s}
		en.dirty = true
		en.cadence = e.cadence(en)
		en.next = now.Add(e.cfg.Jitter(en.cadence))
		heap.Fix(&e.queue, en.index)
	default:
		en.spec = s
		en.st.Spec = s
		en.cadence = e.cadence(en)
		if latest := now.Add(en.cadence); en.next.After(latest) {
			en.next = now.Add(e.cfg.Jitter(en.cadence))
			heap.Fix(&e.queue, en.index)
		}
	}
	e.wakeUp()
}

func (e *Engine) wakeUp() {
	select {
	case e.wake <- struct{}{}:
	default:
	}
}

// cadence is the time between en's probes: its interval when its verdict
// is steady, the fast interval (at most its interval) while unsettled.
func (e *Engine) cadence(en *entry) time.Duration {
	st := &en.st
	unsettled := !st.VerdictKnown || (st.Healthy && st.ConsecutiveFailures > 0) || (!st.Healthy && st.ConsecutiveSuccesses > 0)
	if e.cfg.FastInterval > 0 && unsettled {
		return min(e.cfg.FastInterval, en.spec.Interval)
	}
	return en.spec.Interval
}

// Verdict is a verdict reached earlier, possibly by another replica.
type Verdict struct {
	Healthy        bool
	LastTransition time.Time
}

// Adopt is Upsert for a proxy taken over from another replica (or from
// before a restart): when the engine does not hold it yet and v is set,
// it starts from v, so thresholds keep applying to the verdict everyone
// already knows instead of reaching a new first verdict.
func (e *Engine) Adopt(s Spec, v *Verdict) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.upsertLocked(s, v)
}

// Remove drops a proxy; a probe of it still running is dropped when it
// returns.
func (e *Engine) Remove(uid string) {
	e.mu.Lock()
	en, ok := e.proxies[uid]
	if ok {
		delete(e.proxies, uid)
		heap.Remove(&e.queue, en.index)
		en.epoch++
	}
	e.mu.Unlock()
	if ok && e.cfg.OnRemove != nil {
		e.cfg.OnRemove(en.spec)
	}
}

// Get returns one proxy's state.
func (e *Engine) Get(uid string) (State, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	en, ok := e.proxies[uid]
	if !ok {
		return State{}, false
	}
	return en.st, true
}

// TakeDirty returns the states that changed since the last call.
func (e *Engine) TakeDirty() []State {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []State
	for _, en := range e.proxies {
		if en.dirty {
			en.dirty = false
			out = append(out, en.st)
		}
	}
	return out
}

// Due returns the probes due at now and schedules their next round. A
// proxy whose previous probe still runs skips this round.
func (e *Engine) Due(now time.Time) []Job {
	e.mu.Lock()
	defer e.mu.Unlock()
	var jobs []Job
	for e.queue.Len() > 0 {
		en := e.queue[0]
		if en.next.After(now) {
			break
		}
		// Fixed rate from the proxy's own phase; rounds missed while the
		// process stalled are skipped, not caught up in a burst.
		en.next = en.next.Add(en.cadence)
		if !en.next.After(now) {
			missed := now.Sub(en.next)/en.cadence + 1
			en.next = en.next.Add(missed * en.cadence)
		}
		heap.Fix(&e.queue, 0)
		if en.inflight {
			continue
		}
		en.inflight = true
		en.started = now
		jobs = append(jobs, Job{Spec: en.spec, entry: en, epoch: en.epoch})
	}
	return jobs
}

// NextDue is when the earliest proxy is due; ok is false with none.
func (e *Engine) NextDue() (time.Time, bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.queue.Len() == 0 {
		return time.Time{}, false
	}
	return e.queue[0].next, true
}

// Complete applies a probe result. It returns false when the result is
// stale: the proxy left, or its instance was replaced, while the probe ran.
func (e *Engine) Complete(j Job, r probe.Result) bool {
	e.mu.Lock()
	en, ok := e.proxies[j.Spec.UID]
	if !ok || en != j.entry || en.epoch != j.epoch {
		e.mu.Unlock()
		return false
	}
	en.inflight = false
	now := e.cfg.Now()
	tr, flipped := evaluate(&en.st, en.spec, r, now)
	en.dirty = true
	if c := e.cadence(en); c != en.cadence {
		// The next round counts from this probe's start at the new
		// cadence: one fast interval when the verdict became unsettled; a
		// random point of the interval once it settled, so that proxies
		// that settled together (a thousand added at once, all failing
		// when the target went down) spread over the interval again
		// instead of keeping the fast interval's narrow phases.
		settled := c > en.cadence
		en.cadence = c
		next := en.started.Add(c)
		if settled {
			next = en.started.Add(e.cfg.Jitter(c))
		}
		if next.Before(now) {
			next = now
		}
		if !next.Equal(en.next) {
			en.next = next
			heap.Fix(&e.queue, en.index)
			e.wakeUp()
		}
	}
	spec := en.spec
	e.mu.Unlock()
	if e.cfg.OnResult != nil {
		e.cfg.OnResult(spec, r)
	}
	if flipped && e.cfg.OnTransition != nil {
		e.cfg.OnTransition(tr)
	}
	return true
}

// evaluate applies r to st. The first verdict is unhealthy at the first
// failure (a proxy is not healthy until shown to be) and healthy after
// SuccessThreshold successes; after that the verdict flips only after
// FailureThreshold failures or SuccessThreshold successes in a row. A probe
// slower than the latency threshold is a failure with reason TooSlow.
func evaluate(st *State, s Spec, r probe.Result, now time.Time) (Transition, bool) {
	ok, reason, msg := r.OK, r.Reason, r.Message
	if ok && s.LatencyThreshold > 0 && r.Latency > s.LatencyThreshold {
		ok, reason = false, probe.ReasonTooSlow
		msg = fmt.Sprintf("probe took %s, over the latency threshold of %s", r.Latency.Round(time.Millisecond), s.LatencyThreshold)
	}
	if ok {
		st.ConsecutiveSuccesses++
		st.ConsecutiveFailures = 0
	} else {
		st.ConsecutiveFailures++
		st.ConsecutiveSuccesses = 0
	}
	st.Reason, st.Message, st.Latency, st.LastProbe = reason, msg, r.Latency, now

	var flipTo, flip bool
	switch {
	case !st.VerdictKnown && ok:
		flip, flipTo = st.ConsecutiveSuccesses >= s.SuccessThreshold, true
	case !st.VerdictKnown && !ok:
		flip, flipTo = true, false
	case st.Healthy && !ok:
		flip, flipTo = st.ConsecutiveFailures >= s.FailureThreshold, false
	case !st.Healthy && ok:
		flip, flipTo = st.ConsecutiveSuccesses >= s.SuccessThreshold, true
	}
	if !flip {
		return Transition{}, false
	}
	st.VerdictKnown, st.Healthy, st.LastTransition = true, flipTo, now
	return Transition{
		UID: s.UID, Name: s.Name, ProviderID: s.ProviderID, CredentialsTime: s.CredentialsTime, Healthy: flipTo,
		Reason: reason, Message: msg, Latency: r.Latency, Time: now,
	}, true
}

// Run probes until ctx ends, then waits for the probes in flight.
func (e *Engine) Run(ctx context.Context) error {
	sem := make(chan struct{}, e.cfg.MaxConcurrent)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	defer e.running.Wait()
	for {
		jobs, wait := e.step(e.cfg.Now())
		for _, j := range jobs {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				e.release(j)
				return nil
			}
			e.running.Add(1)
			go func() {
				defer e.running.Done()
				defer func() { <-sem }()
				pctx, cancel := context.WithTimeout(ctx, j.Spec.Timeout)
				r := e.cfg.Probe(pctx, j.Spec)
				cancel()
				if ctx.Err() != nil {
					e.release(j)
					return
				}
				e.Complete(j, r)
			}()
		}
		timer.Reset(wait)
		select {
		case <-ctx.Done():
			return nil
		case <-e.wake:
		case <-timer.C:
		}
	}
}

// step is one wake of Run at now: the probes to start (those due within a
// tick) and how long to sleep — until a tick before the next due probe,
// and never less than a tick, so that what falls due meanwhile starts
// together.
func (e *Engine) step(now time.Time) ([]Job, time.Duration) {
	tick := e.cfg.Tick
	jobs := e.Due(now.Add(tick))
	wait := time.Hour
	if next, ok := e.NextDue(); ok {
		wait = max(next.Sub(now)-tick, tick)
	}
	return jobs, wait
}

// release marks a job's probe as no longer running without a result.
func (e *Engine) release(j Job) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if en, ok := e.proxies[j.Spec.UID]; ok && en == j.entry && en.epoch == j.epoch {
		en.inflight = false
	}
}

// schedule is a min-heap of entries by due time.
type schedule []*entry

func (s schedule) Len() int           { return len(s) }
func (s schedule) Less(i, j int) bool { return s[i].next.Before(s[j].next) }
func (s schedule) Swap(i, j int) {
	s[i], s[j] = s[j], s[i]
	s[i].index, s[j].index = i, j
}
func (s *schedule) Push(x any) {
	en := x.(*entry)
	en.index = len(*s)
	*s = append(*s, en)
}
func (s *schedule) Pop() any {
	old := *s
	en := old[len(old)-1]
	old[len(old)-1] = nil
	*s = old[:len(old)-1]
	en.index = -1
	return en
}

// credentialsTime is when p's credentials were made; zero without any.
func credentialsTime(p *proxyv1.Proxy) time.Time {
	if t := p.GetStatus().GetCredentialsTime(); t != nil {
		// At PostgreSQL's precision, so that it compares equal to what the
		// store gives back.
		return t.AsTime().UTC().Truncate(time.Microsecond)
	}
	return time.Time{}
}
