package orchtest

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// Script answers one command; nil means no answer (a lost command).
type Script func(cmd *busv1.Command) *busv1.CommandResult

// Provisioner consumes a provider's real command stream as a provisioner
// replica does (the shared durable consumer) and answers with its script,
// recording what it received.
type Provisioner struct {
	mu       sync.Mutex
	received []*busv1.Command
	script   Script
}

// StartProvisioner answers the commands of provider with s until the test
// ends. The result carries the command's identity, as a real provisioner's
// does.
func (h *Harness) StartProvisioner(provider string, s Script) *Provisioner {
	h.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.t.Cleanup(cancel)
	cons, err := h.JS.CreateOrUpdateConsumer(ctx, h.Names.CommandStream(), jetstream.ConsumerConfig{
		Durable: h.Names.ProvisionerConsumer(provider), FilterSubject: h.Names.CommandSubject(provider),
		AckPolicy: jetstream.AckExplicitPolicy,
	})
	if err != nil {
		h.t.Fatal(err)
	}
	p := &Provisioner{script: s}
	done := make(chan struct{})
	// Stop before the NATS server does (cleanups run last-in first-out),
	// so a fetch in progress ends normally.
	h.t.Cleanup(func() { cancel(); <-done })
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			batch, err := cons.Fetch(64, jetstream.FetchMaxWait(100*time.Millisecond))
			if err != nil {
				continue
			}
			for m := range batch.Messages() {
				cmd := &busv1.Command{}
				if _, err := bus.Decode(ctx, m, cmd); err != nil {
					_ = m.Term()
					continue
				}
				p.mu.Lock()
				p.received = append(p.received, cmd)
				sc := p.script
				p.mu.Unlock()
				if res := sc(cmd); res != nil {
					res.CommandId, res.ProxyUid, res.Provider = cmd.GetCommandId(), cmd.GetProxyUid(), cmd.GetProvider()
					res.SpecHash, res.Operation, res.Purpose = cmd.GetSpecHash(), cmd.GetOperation(), cmd.GetPurpose()
					if _, err := bus.Publish(ctx, h.JS, h.Names.ResultSubject(provider), res); err != nil && ctx.Err() == nil {
						h.t.Errorf("publishing a result: %v", err)
					}
				}
				_ = m.Ack()
			}
		}
	}()
	return p
}

// SetScript answers the next commands with s.
func (p *Provisioner) SetScript(s Script) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.script = s
}

// Count returns how many commands of op were received for uid ("" = any).
func (p *Provisioner) Count(op busv1.Operation, uid string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, c := range p.received {
		if c.GetOperation() == op && (uid == "" || c.GetProxyUid() == uid) {
			n++
		}
	}
	return n
}

// Received returns every command received so far, in order.
func (p *Provisioner) Received() []*busv1.Command {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.received)
}

// Cloud is a scripted backend whose instances exist until deleted: Create
// is idempotent per proxy UID, Get answers NotFound once the instance is
// gone, every instance runs at 10.0.0.1.
type Cloud struct {
	mu        sync.Mutex
	instances map[string]string // uid -> spec hash of the live instance
	created   map[string]int
}

// NewCloud is an empty backend.
func NewCloud() *Cloud {
	return &Cloud{instances: map[string]string{}, created: map[string]int{}}
}

// Answer is the backend's Script.
func (c *Cloud) Answer(cmd *busv1.Command) *busv1.CommandResult {
	c.mu.Lock()
	defer c.mu.Unlock()
	uid := cmd.GetProxyUid()
	inst := &provisionerv1.Instance{ProviderId: "vm/" + uid, ProxyUid: uid, State: provisionerv1.InstanceState_INSTANCE_STATE_RUNNING, Ip: "10.0.0.1"}
	switch cmd.GetOperation() {
	case busv1.Operation_OPERATION_CREATE:
		if _, ok := c.instances[uid]; !ok {
			c.created[uid]++
		}
		c.instances[uid] = cmd.GetSpecHash()
		return &busv1.CommandResult{Outcome: &busv1.CommandResult_Create{Create: &provisionerv1.CreateInstanceResponse{Instance: inst}}}
	case busv1.Operation_OPERATION_GET:
		if _, ok := c.instances[uid]; !ok {
			return Failure(errclass.NotFound, "instance gone")
		}
		return &busv1.CommandResult{Outcome: &busv1.CommandResult_Get{Get: &provisionerv1.GetInstanceResponse{Instance: inst}}}
	case busv1.Operation_OPERATION_DELETE:
		_, existed := c.instances[uid]
		delete(c.instances, uid)
		return &busv1.CommandResult{Outcome: &busv1.CommandResult_Delete{Delete: &provisionerv1.DeleteInstanceResponse{Deleted: existed}}}
	case busv1.Operation_OPERATION_UPDATE_CREDENTIALS:
		// As a VM backend: credentials are read once, at first boot.
		return Failure(errclass.Unsupported, "this backend cannot change an instance's credentials in place")
	}
	return Failure(errclass.Permanent, "unexpected operation")
}

// Live reports whether uid's instance exists, and its spec hash.
func (c *Cloud) Live(uid string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	h, ok := c.instances[uid]
	return h, ok
}

// Created is how many instances were created for uid.
func (c *Cloud) Created(uid string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.created[uid]
}

// Lose deletes uid's instance behind the orchestrator's back.
func (c *Cloud) Lose(uid string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.instances, uid)
}

// Failure is a result failing with an error of class.
func Failure(class errclass.Class, msg string) *busv1.CommandResult {
	return &busv1.CommandResult{Outcome: &busv1.CommandResult_Error{Error: errclass.ToCommandError(errclass.New(class, "%s", msg))}}
}

// StartCloud answers provider's commands from a new Cloud.
func (h *Harness) StartCloud(provider string) (*Cloud, *Provisioner) {
	h.t.Helper()
	c := NewCloud()
	return c, h.StartProvisioner(provider, c.Answer)
}
