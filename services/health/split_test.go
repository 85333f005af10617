package main

import (
	"fmt"
	"strings"
	"testing"
	"time"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/service/servicetest"
	"github.com/egress-proxies/egress-proxies/pkg/waittest"
	"github.com/egress-proxies/egress-proxies/services/health/internal/proxytest"
)

// TestReplicaSplit runs two health processes on one database and NATS:
// every proxy is probed by exactly one of them (the proxies see who probes
// them through the User-Agent), and when one is killed the other takes
// every proxy within the membership TTL plus a little.
func TestReplicaSplit(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	const n = 12
	proxies := make([]*proxytest.Proxy, n)
	for i := range proxies {
		proxies[i] = proxytest.StartProxy(t, proxytest.Behaviour{})
		e.publish(t, proxyv1.ChangeType_CHANGE_TYPE_CREATED, external(t, fmt.Sprintf("uid-%02d", i), fmt.Sprintf("proxy-%02d", i), proxies[i].Addr()))
	}
	events := e.followHealth(t)
	// A high failure threshold: a probe timing out on a loaded machine must
	// not flip anything, so every transition below is a first verdict or a
	// takeover's doing.
	a, _ := servicetest.Start(t, ".", e.args("replica-a", "--provider-check-interval=0", "--failure-threshold=20"))
	b, _ := servicetest.Start(t, ".", e.args("replica-b", "--provider-check-interval=0", "--failure-threshold=20"))
	bothSeen := func(m map[string]any) bool {
		members, _ := m["members"].([]any)
		return m["msg"] == "health replica set changed" && len(members) == 2
	}
	a.WaitLog(t, 20*time.Second, bothSeen)
	b.WaitLog(t, 20*time.Second, bothSeen)

	const uaA, uaB = "egress-health/replica-a", "egress-health/replica-b"
	// observe forgets what the proxies saw, waits until each was probed
	// several times since, and returns who probed each.
	observe := func() []map[string]int {
		for _, p := range proxies {
			p.ResetAgents()
		}
		waittest.For(t, 20*time.Second, "every proxy probed four times", func() bool {
			for _, p := range proxies {
				total := 0
				for _, c := range p.Agents() {
					total += c
				}
				if total < 4 {
					return false
				}
			}
			return true
		})
		out := make([]map[string]int, n)
		for i, p := range proxies {
			out[i] = p.Agents()
		}
		return out
	}

	// The split settles as soon as both see both; a probe started just
	// before may still land, so the first window is discarded.
	observe()
	perReplica := map[string]int{}
	for i, agents := range observe() {
		if len(agents) != 1 {
			t.Errorf("proxy-%02d probed by %v, want exactly one replica", i, agents)
		}
		for ua := range agents {
			perReplica[ua]++
		}
	}
	if perReplica[uaA] == 0 || perReplica[uaB] == 0 || perReplica[uaA]+perReplica[uaB] != n {
		t.Errorf("proxies per replica = %v, want all %d split between both", perReplica, n)
	}

	// Kill a: b takes every proxy within the TTL (2s) plus a heartbeat.
	killed := time.Now()
	a.Kill(t)
	waittest.For(t, 15*time.Second, "replica-b probing every proxy", func() bool {
		for _, p := range proxies {
			if p.Agents()[uaB] == 0 {
				return false
			}
		}
		return true
	})
	took := time.Since(killed)
	for i, agents := range observe() {
		if len(agents) != 1 || agents[uaB] == 0 {
			t.Errorf("after the kill proxy-%02d probed by %v, want only replica-b", i, agents)
		}
	}
	t.Logf("replica-b took over all %d proxies %s after replica-a was killed", n, took.Round(10*time.Millisecond))
	if took > 10*time.Second {
		t.Errorf("takeover took %s, want within the 2s membership TTL plus a few seconds of a loaded machine", took)
	}
	// A proxy taken over keeps the verdict its earlier prober reached:
	// neither b joining nor a dying made anyone publish the same verdict
	// again (a new first verdict would). Each proxy's transitions alternate
	// and end healthy.
	last := map[string]*bool{}
	for _, ev := range events.all() {
		tr := ev.GetTransition()
		if prev := last[tr.GetProxyUid()]; prev != nil && *prev == tr.GetHealthy() {
			t.Errorf("%s: verdict healthy=%v published again (sequence %d)", tr.GetProxyName(), tr.GetHealthy(), tr.GetSequence())
		}
		h := tr.GetHealthy()
		last[tr.GetProxyUid()] = &h
	}
	for i := range n {
		if v := last[fmt.Sprintf("uid-%02d", i)]; v == nil || !*v {
			t.Errorf("proxy-%02d: last verdict %v, want healthy", i, v)
		}
	}
	if out := b.Output(); strings.Contains(out, "panic") {
		t.Errorf("replica-b output has a panic:\n%s", out)
	}
}
