package pool

import (
	"context"
	"log/slog"
	"strings"

	"github.com/nats-io/nats.go/jetstream"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
)

// ConsumeDemand records every pool's demand reports in book until ctx ends:
// first the latest report of each pool, then each new one. Every replica
// runs it, so whichever owns a pool next has its history.
func ConsumeDemand(ctx context.Context, js jetstream.JetStream, names bus.Names, book *Book, log *slog.Logger) error {
	bus.KeepConsuming(ctx, js, log, "pool demand", func(ctx context.Context) error {
		cons, err := js.OrderedConsumer(ctx, names.DemandStream(), jetstream.OrderedConsumerConfig{
			FilterSubjects: []string{names.DemandSubjects()},
			DeliverPolicy:  jetstream.DeliverLastPerSubjectPolicy,
		})
		if err != nil {
			return err
		}
		cc, err := cons.Consume(func(m jetstream.Msg) {
			ev := &busv1.PoolDemandEvent{}
			if _, err := bus.Decode(ctx, m, ev); err != nil {
				log.Error("dropping an undecodable pool demand report", "subject", m.Subject(), "error", err)
				return
			}
			pool := ev.GetPool()
			if strings.HasSuffix(m.Subject(), "."+bus.NoPool) {
				pool = ""
			}
			leases := make(map[string]int, len(ev.GetLeasesByProxy()))
			for uid, n := range ev.GetLeasesByProxy() {
				leases[uid] = int(n)
			}
			book.Record(pool, ev.GetDemand(), leases)
		}, bus.ConsumeOpts()...)
		if err != nil {
			return err
		}
		<-ctx.Done()
		cc.Stop()
		return nil
	})
	return nil
}
