package engine

import (
	"container/heap"
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/probe"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

var t0 = time.Date(2026, 12, 2, 12, 0, 0, 0, time.UTC)

// fakeClock is advanced by hand.
type fakeClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *fakeClock) Add(d time.Duration) time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
	return c.now
}

var (
	pass = probe.Result{OK: true, Reason: probe.ReasonSucceeded, Latency: 10 * time.Millisecond}
	fail = probe.Result{Reason: probe.ReasonConnectFailed, Message: "connection refused", Latency: time.Millisecond}
	slow = probe.Result{OK: true, Reason: probe.ReasonSucceeded, Latency: 400 * time.Millisecond}
)

func spec(uid string) Spec {
	return Spec{UID: uid, Name: "p-" + uid, ProviderID: "vm-" + uid, Address: "10.0.0.1:3128",
		Interval: time.Second, Timeout: time.Second, SuccessThreshold: 2, FailureThreshold: 3}
}

func TestEvaluate_matrix(t *testing.T) {
	t.Parallel()
	// Each step is a probe result; want is the transition it must cause:
	// "" none, "up" healthy, "down" unhealthy.
	tests := []struct {
		name    string
		success int
		failure int
		latency time.Duration
		probes  []probe.Result
		want    []string
		reasons []string // the reason of each transition, in order
	}{
		{name: "first verdict healthy after the success threshold", success: 2, failure: 3,
			probes: []probe.Result{pass, pass, pass}, want: []string{"", "up", ""}},
		{name: "first verdict unhealthy at the first failure", success: 2, failure: 3,
			probes: []probe.Result{fail, fail}, want: []string{"down", ""}, reasons: []string{probe.ReasonConnectFailed}},
		{name: "a success then a failure before the first verdict", success: 2, failure: 3,
			probes: []probe.Result{pass, fail, pass, pass}, want: []string{"", "down", "", "up"}},
		{name: "success threshold 1 decides at once", success: 1, failure: 1,
			probes: []probe.Result{pass, fail, pass}, want: []string{"up", "down", "up"}},
		{name: "healthy survives failures below the threshold", success: 2, failure: 3,
			probes: []probe.Result{pass, pass, fail, fail, pass, fail, fail}, want: []string{"", "up", "", "", "", "", ""}},
		{name: "healthy flips after failure threshold in a row", success: 2, failure: 3,
			probes: []probe.Result{pass, pass, fail, fail, fail, fail}, want: []string{"", "up", "", "", "down", ""}},
		{name: "unhealthy needs the success threshold in a row", success: 3, failure: 1,
			probes: []probe.Result{fail, pass, pass, fail, pass, pass, pass}, want: []string{"down", "", "", "", "", "", "up"}},
		{name: "slow probe is a failure", success: 1, failure: 2, latency: 100 * time.Millisecond,
			probes: []probe.Result{pass, slow, slow, pass}, want: []string{"up", "", "down", "up"},
			reasons: []string{probe.ReasonSucceeded, probe.ReasonTooSlow, probe.ReasonSucceeded}},
		{name: "slow first probe gives an unhealthy first verdict", success: 1, failure: 3, latency: 100 * time.Millisecond,
			probes: []probe.Result{slow}, want: []string{"down"}, reasons: []string{probe.ReasonTooSlow}},
		{name: "no latency threshold: slow is fine", success: 1, failure: 1,
			probes: []probe.Result{slow, slow}, want: []string{"up", ""}},
		{name: "a failing probe is a failure whatever its latency", success: 1, failure: 1, latency: time.Second,
			probes: []probe.Result{pass, fail}, want: []string{"up", "down"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := spec("u1")
			s.SuccessThreshold, s.FailureThreshold, s.LatencyThreshold = tc.success, tc.failure, tc.latency
			var st State
			var reasons []string
			for i, r := range tc.probes {
				now := t0.Add(time.Duration(i) * time.Second)
				tr, flipped := evaluate(&st, s, r, now)
				got := ""
				if flipped {
					got = map[bool]string{true: "up", false: "down"}[tr.Healthy]
					reasons = append(reasons, tr.Reason)
					if !tr.Time.Equal(now) || st.LastTransition != now || tr.ProviderID != s.ProviderID {
						t.Errorf("probe %d: transition %+v / state %+v, want time %s and the spec's provider ID", i, tr, st, now)
					}
				}
				if got != tc.want[i] {
					t.Fatalf("probe %d (%s): transition %q, want %q", i, r.Reason, got, tc.want[i])
				}
				if st.LastProbe != now {
					t.Errorf("probe %d: LastProbe = %s, want %s", i, st.LastProbe, now)
				}
			}
			if tc.reasons != nil && fmt.Sprint(reasons) != fmt.Sprint(tc.reasons) {
				t.Errorf("transition reasons = %v, want %v", reasons, tc.reasons)
			}
		})
	}
}

func TestEvaluate_counters(t *testing.T) {
	t.Parallel()
	var st State
	s := spec("u1")
	for _, r := range []probe.Result{pass, pass, pass, fail, fail} {
		evaluate(&st, s, r, t0)
	}
	if st.ConsecutiveFailures != 2 || st.ConsecutiveSuccesses != 0 || !st.Healthy || !st.VerdictKnown {
		t.Errorf("state = %+v, want 2 failures, 0 successes, still healthy", st)
	}
	if st.Reason != probe.ReasonConnectFailed || st.Message != "connection refused" || st.Latency != time.Millisecond {
		t.Errorf("last probe fields = %q %q %s", st.Reason, st.Message, st.Latency)
	}
}

// recorder collects transitions and removals.
type recorder struct {
	mu      sync.Mutex
	trans   []Transition
	removed []string
	results int
}

func (r *recorder) config(clock *fakeClock, p ProbeFunc) Config {
	return Config{
		Probe:        p,
		Now:          clock.Now,
		Jitter:       func(d time.Duration) time.Duration { return d / 2 },
		OnTransition: func(tr Transition) { r.mu.Lock(); r.trans = append(r.trans, tr); r.mu.Unlock() },
		OnRemove:     func(s Spec) { r.mu.Lock(); r.removed = append(r.removed, s.UID); r.mu.Unlock() },
		OnResult:     func(Spec, probe.Result) { r.mu.Lock(); r.results++; r.mu.Unlock() },
	}
}

func (r *recorder) transitions() []Transition {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Transition(nil), r.trans...)
}

func uids(jobs []Job) []string {
	var out []string
	for _, j := range jobs {
		out = append(out, j.Spec.UID)
	}
	return out
}

func TestEngine_scheduling(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	rec := &recorder{}
	e := New(rec.config(clock, nil))

	e.Upsert(spec("a")) // jitter: first probe at t0+500ms
	clock.Add(100 * time.Millisecond)
	b := spec("b")
	b.Interval = 2 * time.Second
	e.Upsert(b) // first probe at t0+100ms+1s

	if jobs := e.Due(t0.Add(499 * time.Millisecond)); len(jobs) != 0 {
		t.Fatalf("due before the jittered start: %v", uids(jobs))
	}
	if next, ok := e.NextDue(); !ok || !next.Equal(t0.Add(500*time.Millisecond)) {
		t.Fatalf("NextDue = %s %v, want t0+500ms", next, ok)
	}
	jobs := e.Due(t0.Add(500 * time.Millisecond))
	if fmt.Sprint(uids(jobs)) != "[a]" {
		t.Fatalf("due at +500ms = %v, want [a]", uids(jobs))
	}
	// a's probe still runs at its next round: that round is skipped.
	bJobs := e.Due(t0.Add(1500 * time.Millisecond))
	if fmt.Sprint(uids(bJobs)) != "[b]" {
		t.Fatalf("due at +1.5s = %v, want [b] only (a still in flight)", uids(bJobs))
	}
	e.Complete(bJobs[0], pass)
	e.Complete(jobs[0], pass)
	// Fixed rate from a's phase: +2.5s, not +1.5s + interval.
	if got := e.Due(t0.Add(2499 * time.Millisecond)); len(got) != 0 {
		t.Fatalf("due at +2.499s = %v, want none", uids(got))
	}
	got := e.Due(t0.Add(2500 * time.Millisecond))
	if fmt.Sprint(uids(got)) != "[a]" {
		t.Fatalf("due at +2.5s = %v, want [a]", uids(got))
	}
	e.Complete(got[0], pass)
	// A stall of ten seconds yields one probe each, not a burst.
	got = e.Due(t0.Add(13 * time.Second))
	if len(got) != 2 {
		t.Fatalf("due after a stall = %v, want one probe per proxy", uids(got))
	}
	for _, j := range got {
		e.Complete(j, pass)
	}
	if got := e.Due(t0.Add(13 * time.Second)); len(got) != 0 {
		t.Fatalf("due twice at the same instant: %v", uids(got))
	}
}

// simulate drives e on clock in 5ms steps until the end, completing each
// probe at once with result(uid, time) and returning each proxy's probe
// times.
func simulate(e *Engine, clock *fakeClock, end time.Time, result func(uid string, at time.Time) probe.Result) map[string][]time.Time {
	probes := map[string][]time.Time{}
	for now := clock.Now(); !now.After(end); now = clock.Add(5 * time.Millisecond) {
		for _, j := range e.Due(now) {
			probes[j.Spec.UID] = append(probes[j.Spec.UID], now)
			e.Complete(j, result(j.Spec.UID, now))
		}
	}
	return probes
}

func gaps(ts []time.Time) []time.Duration {
	var out []time.Duration
	for i := 1; i < len(ts); i++ {
		out = append(out, ts[i].Sub(ts[i-1]))
	}
	return out
}

// The adaptive cadence: an unsettled proxy (no verdict yet, or failing
// while healthy, or passing while unhealthy) is probed at the fast
// interval; a steady one at its interval, never less often.
func TestEngine_adaptiveCadence(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	rec := &recorder{}
	cfg := rec.config(clock, nil)
	cfg.FastInterval = 250 * time.Millisecond
	e := New(cfg)
	e.Upsert(spec("a")) // first probe at +125ms: half of its first, fast, round

	// Healthy until +3s, failing until +8s, then healthy again.
	probes := simulate(e, clock, t0.Add(12*time.Second), func(_ string, at time.Time) probe.Result {
		if at.Sub(t0) >= 3*time.Second && at.Sub(t0) < 8*time.Second {
			return fail
		}
		return pass
	})["a"]
	ms := func(d time.Duration) string { return fmt.Sprint(d.Milliseconds()) }
	var got []string
	for _, g := range gaps(probes) {
		got = append(got, ms(g))
	}
	// +125, +375 (healthy: settled, so the next probe falls at a random
	// point of the interval — here its middle), +875, +1875, +2875, +3875
	// (fails: fast), +4125, +4375 (third failure: unhealthy, settled),
	// +4875, +5875 ... +7875, +8875 (passes: fast), +9125 (healthy
	// again, settled), +9625, +10625, +11625.
	want := []string{"250", "500", "1000", "1000", "1000", "250", "250", "500", "1000", "1000", "1000", "1000", "250", "500", "1000", "1000"}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("gaps between probes (ms) = %v, want %v", got, want)
	}
	trs := rec.transitions()
	var flips []string
	for _, tr := range trs {
		flips = append(flips, fmt.Sprintf("%v@%s", tr.Healthy, ms(tr.Time.Sub(t0))))
	}
	if want := "[true@375 false@4375 true@9125]"; fmt.Sprint(flips) != want {
		t.Errorf("transitions %v, want %s: each confirmed at the fast interval", flips, want)
	}
}

// Proxies that settle together — a thousand added at once, confirmed at
// the fast interval — spread over their interval again instead of
// keeping the narrow phases of their first fast rounds.
func TestEngine_settledProxiesSpreadOverTheInterval(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	e := New(Config{Now: clock.Now, FastInterval: 250 * time.Millisecond}) // the real random jitter
	const n = 1000
	for i := range n {
		e.Upsert(spec(fmt.Sprint(i)))
	}
	// Two fast rounds: every proxy healthy, settled, by +500ms.
	slots := map[int]int{}
	for now := clock.Now(); now.Before(t0.Add(5 * time.Second)); now = clock.Add(5 * time.Millisecond) {
		for _, j := range e.Due(now) {
			if at := now.Sub(t0); at >= 2*time.Second && at < 3*time.Second {
				slots[int(at/(100*time.Millisecond))]++
			}
			e.Complete(j, pass)
		}
	}
	// In a steady second every 100ms slot holds about a tenth.
	for slot := 20; slot < 30; slot++ {
		if c := slots[slot]; c < n/20 || c > n/5 {
			t.Errorf("slot %d of the third second holds %d of %d probes, want about %d", slot, c, n, n/10)
		}
	}
}

// A fixed cadence (no fast interval) probes at the interval whatever the
// verdict: the baseline of the adaptive one.
func TestEngine_fixedCadence(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	e := New((&recorder{}).config(clock, nil))
	e.Upsert(spec("a"))
	probes := simulate(e, clock, t0.Add(6*time.Second), func(_ string, at time.Time) probe.Result {
		if at.Sub(t0) >= 2*time.Second {
			return fail
		}
		return pass
	})["a"]
	for _, g := range gaps(probes) {
		if g != time.Second {
			t.Fatalf("gaps %v, want every probe a second apart", gaps(probes))
		}
	}
}

// A proxy taken over with a known verdict is steady, but it went
// unprobed while its owner died: its first probe falls within half an
// interval.
func TestEngine_takenOverProbedWithinHalfAnInterval(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	cfg := (&recorder{}).config(clock, nil)
	cfg.Jitter = func(d time.Duration) time.Duration { return d - time.Millisecond } // the latest
	cfg.FastInterval = 250 * time.Millisecond
	e := New(cfg)
	e.Adopt(spec("a"), &Verdict{Healthy: true})
	if next, _ := e.NextDue(); next.Sub(t0) >= spec("a").Interval/2 {
		t.Errorf("first probe of a taken-over proxy at +%s, want within half an interval", next.Sub(t0))
	}
	e.Adopt(spec("b"), nil) // no verdict: its first round is fast
	for _, j := range e.Due(t0.Add(250 * time.Millisecond)) {
		if j.Spec.UID == "b" {
			return
		}
	}
	t.Error("a proxy without a verdict was not probed within the fast interval")
}

// Run's wakes: each starts the probes due within a tick (up to a tick
// early, never late) and sleeps until a tick before the next one, at least
// a tick.
func TestEngine_stepBatchesByTick(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	due := map[string]time.Duration{"a": 10 * time.Millisecond, "b": 30 * time.Millisecond, "c": 40 * time.Millisecond, "d": 200 * time.Millisecond}
	e := New(Config{Now: clock.Now, Tick: 25 * time.Millisecond})
	for uid := range due {
		e.Upsert(spec(uid))
	}
	e.mu.Lock()
	for uid, d := range due {
		en := e.proxies[uid]
		en.next = t0.Add(d)
		heap.Fix(&e.queue, en.index)
	}
	e.mu.Unlock()

	type wake struct {
		at    time.Duration
		start []string
		sleep time.Duration
	}
	var got []wake
	now := t0
	for now.Before(t0.Add(300 * time.Millisecond)) {
		jobs, wait := e.step(now)
		var started []string
		for _, j := range jobs {
			started = append(started, j.Spec.UID)
			if d := due[j.Spec.UID]; now.Sub(t0) > d {
				t.Errorf("%s due at +%s started late, at +%s", j.Spec.UID, d, now.Sub(t0))
			}
		}
		slices.Sort(started)
		got = append(got, wake{now.Sub(t0), started, wait})
		now = now.Add(wait)
		if len(got) == 3 {
			break
		}
	}
	want := []wake{
		{0, []string{"a"}, 25 * time.Millisecond},                           // b due in 30ms: wake in a tick
		{25 * time.Millisecond, []string{"b", "c"}, 150 * time.Millisecond}, // both within the tick; d's at 200 - 25
		{175 * time.Millisecond, []string{"d"}, 810 * time.Millisecond},     // a's next round at 1010 - 25
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("wakes %v, want %v", got, want)
	}
}

func TestEngine_jitterSpreadsProxies(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	e := New(Config{Probe: nil, Now: clock.Now}) // the real random jitter
	const n = 1000
	for i := range n {
		e.Upsert(spec(fmt.Sprint(i)))
	}
	// Count probes per 100ms slot of the first second: with jitter every
	// slot holds about a tenth, none anywhere near all of them.
	seen := 0
	for slot := 1; slot <= 10; slot++ {
		jobs := e.Due(t0.Add(time.Duration(slot) * 100 * time.Millisecond))
		if len(jobs) < n/20 || len(jobs) > n/5 {
			t.Errorf("slot %d holds %d of %d first probes, want about %d", slot, len(jobs), n, n/10)
		}
		seen += len(jobs)
	}
	if seen != n {
		t.Errorf("%d of %d proxies probed in their first interval", seen, n)
	}
}

func TestEngine_staleProbeGuard(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		change func(e *Engine)
	}{
		{"instance replaced", func(e *Engine) { s := spec("a"); s.ProviderID = "vm-new"; e.Upsert(s) }},
		{"address changed", func(e *Engine) { s := spec("a"); s.Address = "10.0.0.2:3128"; e.Upsert(s) }},
		{"proxy removed", func(e *Engine) { e.Remove("a") }},
		{"proxy removed and re-added", func(e *Engine) { e.Remove("a"); e.Upsert(spec("a")) }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			clock := &fakeClock{now: t0}
			rec := &recorder{}
			e := New(rec.config(clock, nil))
			s := spec("a")
			s.SuccessThreshold = 1
			e.Upsert(s)
			jobs := e.Due(t0.Add(time.Second))
			if len(jobs) != 1 {
				t.Fatalf("due = %v", uids(jobs))
			}
			tc.change(e)
			if e.Complete(jobs[0], pass) {
				t.Fatal("Complete accepted a probe of the old instance")
			}
			if len(rec.transitions()) != 0 {
				t.Errorf("a stale probe caused transitions %+v", rec.transitions())
			}
			if st, ok := e.Get("a"); ok && (st.VerdictKnown || st.ConsecutiveSuccesses != 0) {
				t.Errorf("state after a stale probe = %+v, want untouched", st)
			}
		})
	}
}

func TestEngine_newInstanceStartsOver(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	rec := &recorder{}
	e := New(rec.config(clock, nil))
	s := spec("a")
	s.SuccessThreshold = 1
	e.Upsert(s)
	j := e.Due(t0.Add(time.Second))
	e.Complete(j[0], pass)
	if st, _ := e.Get("a"); !st.Healthy {
		t.Fatalf("state = %+v, want healthy", st)
	}
	// Same instance, new thresholds: the verdict stays.
	s.FailureThreshold = 5
	e.Upsert(s)
	if st, _ := e.Get("a"); !st.Healthy || st.Spec.FailureThreshold != 5 {
		t.Fatalf("state after a threshold change = %+v, want healthy with the new threshold", st)
	}
	s.ProviderID = "vm-2"
	e.Upsert(s)
	st, _ := e.Get("a")
	if st.VerdictKnown || st.Healthy || st.Spec.ProviderID != "vm-2" {
		t.Fatalf("state after replacement = %+v, want no verdict for the new instance", st)
	}
	clock.Add(2 * time.Second)
	j = e.Due(clock.Now())
	e.Complete(j[0], pass)
	trs := rec.transitions()
	if len(trs) != 2 || trs[1].ProviderID != "vm-2" || !trs[1].Healthy {
		t.Fatalf("transitions = %+v, want a first verdict for vm-2", trs)
	}
}

func TestEngine_adoptKeepsThePriorVerdict(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	rec := &recorder{}
	e := New(rec.config(clock, nil))
	before := t0.Add(-time.Hour)
	e.Adopt(spec("a"), &Verdict{Healthy: true, LastTransition: before})
	e.Adopt(spec("b"), &Verdict{Healthy: false, LastTransition: before})
	// A verdict for a proxy already held is ignored.
	e.Adopt(spec("a"), &Verdict{Healthy: false})
	if st, _ := e.Get("a"); !st.VerdictKnown || !st.Healthy || !st.LastTransition.Equal(before) {
		t.Fatalf("a = %+v, want the adopted healthy verdict", st)
	}
	probes := map[string]probe.Result{"a": fail, "b": pass}
	for range 2 {
		clock.Add(time.Second)
		for _, j := range e.Due(clock.Now()) {
			e.Complete(j, probes[j.Spec.UID])
		}
	}
	// a: two failures under a threshold of three; b: two successes reach
	// the success threshold, a real flip.
	trs := rec.transitions()
	if len(trs) != 1 || trs[0].UID != "b" || !trs[0].Healthy {
		t.Fatalf("transitions = %+v, want only b turning healthy", trs)
	}
	if st, _ := e.Get("a"); !st.Healthy || st.ConsecutiveFailures != 2 {
		t.Errorf("a = %+v, want still healthy after two failures", st)
	}
}

func TestEngine_removeForgets(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	rec := &recorder{}
	e := New(rec.config(clock, nil))
	e.Upsert(spec("a"))
	e.Upsert(spec("b"))
	e.Remove("a")
	e.Remove("missing")
	if got := e.Due(t0.Add(10 * time.Second)); fmt.Sprint(uids(got)) != "[b]" {
		t.Fatalf("due after removing a = %v, want [b]", uids(got))
	}
	if fmt.Sprint(rec.removed) != "[a]" {
		t.Errorf("OnRemove saw %v, want [a]", rec.removed)
	}
	if _, ok := e.Get("a"); ok {
		t.Error("a still known after Remove")
	}
}

func TestEngine_takeDirty(t *testing.T) {
	t.Parallel()
	clock := &fakeClock{now: t0}
	e := New(Config{Now: clock.Now, Jitter: func(time.Duration) time.Duration { return 0 }})
	e.Upsert(spec("a"))
	e.Upsert(spec("b"))
	if got := e.TakeDirty(); len(got) != 2 {
		t.Fatalf("dirty after adding = %d, want 2", len(got))
	}
	if got := e.TakeDirty(); len(got) != 0 {
		t.Fatalf("dirty twice = %d, want 0", len(got))
	}
	jobs := e.Due(t0)
	e.Complete(jobs[0], fail)
	got := e.TakeDirty()
	if len(got) != 1 || got[0].Spec.UID != jobs[0].Spec.UID || got[0].ConsecutiveFailures != 1 {
		t.Fatalf("dirty after one probe = %+v", got)
	}
}

// TestEngine_Run drives the real loop with an injected probe: a new proxy
// is probed and reaches its verdicts, one added while running is picked up
// at once, a removed one stops being probed, and Run returns when its
// context ends with no probe left running.
func TestEngine_Run(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	healthy := map[string]bool{"10.0.0.1:3128": true, "10.0.0.2:3128": false}
	probes := map[string]int{}
	rec := &recorder{}
	cfg := rec.config(&fakeClock{}, func(ctx context.Context, s Spec) probe.Result {
		addr := s.Address
		mu.Lock()
		defer mu.Unlock()
		probes[addr]++
		if _, ok := ctx.Deadline(); !ok {
			return probe.Result{Reason: "NoDeadline"}
		}
		if healthy[addr] {
			return pass
		}
		return fail
	})
	cfg.Now, cfg.Jitter = time.Now, nil
	e := New(cfg)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()

	a := spec("a")
	a.Interval, a.Timeout = 100*time.Millisecond, 100*time.Millisecond
	e.Upsert(a)
	b := spec("b")
	b.Interval, b.Timeout, b.Address = 100*time.Millisecond, 100*time.Millisecond, "10.0.0.2:3128"
	e.Upsert(b)

	waittest.For(t, 10*time.Second, "a healthy and b unhealthy", func() bool {
		trs := rec.transitions()
		var up, down bool
		for _, tr := range trs {
			up = up || (tr.UID == "a" && tr.Healthy)
			down = down || (tr.UID == "b" && !tr.Healthy)
		}
		return up && down
	})

	e.Remove("b")
	mu.Lock()
	before := probes["10.0.0.2:3128"]
	mu.Unlock()
	// a keeps being probed; b never again (at most one already in flight).
	waittest.For(t, 10*time.Second, "a probed ten more times", func() bool { mu.Lock(); defer mu.Unlock(); return probes["10.0.0.1:3128"] > 10 })
	mu.Lock()
	if after := probes["10.0.0.2:3128"]; after > before+1 {
		t.Errorf("b probed %d more times after removal", after-before)
	}
	mu.Unlock()

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
	for _, tr := range rec.transitions() {
		if tr.Reason == "NoDeadline" {
			t.Fatal("a probe ran without a deadline")
		}
	}
}

func TestSpecFor(t *testing.T) {
	t.Parallel()
	d := DefaultDefaults
	managed := func(phase proxyv1.ProxyPhase) *proxyv1.Proxy {
		return &proxyv1.Proxy{Uid: "u1", Name: "p1",
			Spec:   &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: "pve", Port: 3129},
			Status: &proxyv1.ProxyStatus{Phase: phase, Ip: "10.1.2.3", Port: 3129, ProviderId: "vms/100/x"}}
	}
	external := &proxyv1.Proxy{Uid: "u2", Name: "ext",
		Spec: &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_EXTERNAL, Endpoint: &proxyv1.Endpoint{Host: "proxy.lan", Port: 8080},
			HealthCheck: &proxyv1.HealthCheckSpec{Interval: durationpb.New(5 * time.Second), Timeout: durationpb.New(10 * time.Second),
				SuccessThreshold: 4, FailureThreshold: 1, LatencyThreshold: durationpb.New(300 * time.Millisecond)}},
		Status: &proxyv1.ProxyStatus{Phase: proxyv1.ProxyPhase_PROXY_PHASE_READY}}
	deleting := managed(proxyv1.ProxyPhase_PROXY_PHASE_READY)
	deleting.DeleteTime = timestamppb.New(t0)
	noIP := managed(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING)
	noIP.Status.Ip = ""
	v6 := managed(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING)
	v6.Status.Ip = "fd00::1"
	tests := []struct {
		name   string
		p      *proxyv1.Proxy
		want   bool
		addr   string
		verify func(t *testing.T, s Spec)
	}{
		{name: "managed running", p: managed(proxyv1.ProxyPhase_PROXY_PHASE_RUNNING), want: true, addr: "10.1.2.3:3129",
			verify: func(t *testing.T, s Spec) {
				if s.Interval != d.Interval || s.SuccessThreshold != d.SuccessThreshold || s.ProviderID != "vms/100/x" || s.LatencyThreshold != 0 {
					t.Errorf("spec = %+v, want the defaults", s)
				}
			}},
		{name: "managed ready", p: managed(proxyv1.ProxyPhase_PROXY_PHASE_READY), want: true, addr: "10.1.2.3:3129"},
		{name: "managed provisioning", p: managed(proxyv1.ProxyPhase_PROXY_PHASE_PROVISIONING)},
		{name: "managed pending", p: managed(proxyv1.ProxyPhase_PROXY_PHASE_PENDING)},
		{name: "managed failed", p: managed(proxyv1.ProxyPhase_PROXY_PHASE_FAILED)},
		{name: "managed deleting phase", p: managed(proxyv1.ProxyPhase_PROXY_PHASE_DELETING)},
		{name: "delete requested", p: deleting},
		{name: "running without an IP", p: noIP},
		{name: "IPv6", p: v6, want: true, addr: "[fd00::1]:3129"},
		{name: "external, own settings", p: external, want: true, addr: "proxy.lan:8080",
			verify: func(t *testing.T, s Spec) {
				if s.Interval != 5*time.Second || s.Timeout != 5*time.Second || s.SuccessThreshold != 4 || s.FailureThreshold != 1 || s.LatencyThreshold != 300*time.Millisecond {
					t.Errorf("spec = %+v, want the proxy's settings with the timeout capped at the interval", s)
				}
			}},
		{name: "no mode", p: &proxyv1.Proxy{Uid: "u3"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s, ok := SpecFor(tc.p, d)
			if ok != tc.want {
				t.Fatalf("SpecFor ok = %v, want %v", ok, tc.want)
			}
			if ok && s.Address != tc.addr {
				t.Errorf("address = %q, want %q", s.Address, tc.addr)
			}
			if ok && tc.verify != nil {
				tc.verify(t, s)
			}
		})
	}
}

func TestDefaults_Validate(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name string
		d    Defaults
		ok   bool
	}{
		{"service defaults", DefaultDefaults, true},
		{"interval too short", Defaults{Interval: 50 * time.Millisecond, Timeout: 10 * time.Millisecond, SuccessThreshold: 1, FailureThreshold: 1}, false},
		{"timeout over interval", Defaults{Interval: time.Second, Timeout: 2 * time.Second, SuccessThreshold: 1, FailureThreshold: 1}, false},
		{"zero timeout", Defaults{Interval: time.Second, SuccessThreshold: 1, FailureThreshold: 1}, false},
		{"zero threshold", Defaults{Interval: time.Second, Timeout: time.Second, FailureThreshold: 1}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if err := tc.d.Validate(); (err == nil) != tc.ok {
				t.Errorf("Validate() = %v, want ok=%v", err, tc.ok)
			}
		})
	}
}
