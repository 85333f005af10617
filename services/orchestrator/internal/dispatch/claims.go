package dispatch

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// maxClaimGrowth bounds how far a claim grows while proxies are due
// faster than claims of ClaimBatch take them: to this many times
// ClaimBatch.
const maxClaimGrowth = 8

// RunClaims claims due proxies (FOR UPDATE SKIP LOCKED, so replicas never
// take the same one), decides each, stores them and publishes the commands
// after commit, until ctx ends. A claim that found as many due proxies as
// it took is followed at once by one twice its size (up to
// maxClaimGrowth×ClaimBatch), so a backlog takes fewer commits; a claim
// that found fewer sets the size back to ClaimBatch.
func (d *Dispatcher) RunClaims(ctx context.Context) error {
	batch := d.ClaimBatch
	if batch <= 0 {
		batch = 64
	}
	size := batch
	for ctx.Err() == nil {
		wake := d.Work.Wait()
		n, err := d.claimOnce(ctx, size)
		if err != nil && ctx.Err() == nil {
			d.Log.Warn("claiming work failed", "error", err)
		}
		if n == size {
			size = min(2*size, maxClaimGrowth*batch)
			continue // more may be due
		}
		size = batch
		select {
		case <-ctx.Done():
		case <-wake:
		case <-time.After(d.poll()):
		}
	}
	return nil
}

// claimed is a command decided by a claim, with the trace its proxy's
// last API change started.
type claimed struct {
	cmd         *busv1.Command
	traceParent string
}

func (d *Dispatcher) claimOnce(ctx context.Context, batch int) (int, error) {
	var cmds []claimed
	var n int
	start := time.Now()
	err := d.Store.Write(ctx, func(tx *store.Tx) error {
		cmds, n = nil, 0
		rows, err := tx.ClaimDue(ctx, batch)
		if err != nil {
			return err
		}
		n = len(rows)
		for _, r := range rows {
			dec := d.Machine.Decide(r, tx.Now())
			switch {
			case dec.Release:
				tx.Delete(r)
				d.Metrics.reconciled("release")
				continue
			case dec.Command != nil:
				cmds = append(cmds, claimed{dec.Command, r.TraceParent})
				d.Metrics.reconciled(dec.Command.GetOperation().String())
			default:
				d.Metrics.reconciled("wait")
			}
			lifecycle.EndSettledTrace(r)
			tx.Update(r)
		}
		return nil
	})
	if err != nil {
		return 0, err
	}
	if n > 0 {
		d.Metrics.ReconcileDuration.Observe(time.Since(start).Seconds() / float64(n))
	}
	out := make([]outgoing, len(cmds))
	for i, c := range cmds {
		// A child of the API call that set the proxy in motion (a new
		// trace for a periodic resync); the command carries it to the
		// provisioner in its headers.
		sctx, span := tracer.Start(telemetry.WithTraceParent(ctx, c.traceParent), "reconcile.claim",
			trace.WithSpanKind(trace.SpanKindProducer), trace.WithTimestamp(start), trace.WithAttributes(commandAttrs(c.cmd)...))
		out[i] = outgoing{ctx: sctx, cmd: c.cmd, span: span}
	}
	d.publish(ctx, out)
	return n, nil
}
