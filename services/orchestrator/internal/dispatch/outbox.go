package dispatch

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/postgres"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// outboxLockKey is the advisory lock the ProxyEvent publisher holds.
var outboxLockKey = postgres.LockKey("orchestrator", "outbox")

// RunOutbox publishes stored changes as ProxyEvents, in revision order, from
// one replica at a time (a postgres.Singleton), resuming from the stored
// cursor.
func (d *Dispatcher) RunOutbox(ctx context.Context) error {
	s := &postgres.Singleton{Pool: d.Store.Pool(), Key: outboxLockKey, Name: "ProxyEvent outbox", Log: d.Log, Retry: d.poll()}
	return s.Run(ctx, d.outbox)
}

// cursorSaveInterval is how often, at most, the outbox stores its cursor
// while changes keep coming (when they stop it stores it at once): each
// store is a commit of its own, and a commit per batch competed with the
// writers' commits for the WAL. A new holder of the outbox resends what
// was published after the stored cursor; consumers ignore revisions they
// have.
const cursorSaveInterval = time.Second

func (d *Dispatcher) outbox(ctx context.Context) error {
	conn := d.Store.Pool()
	var cursor, saved int64
	var refreshed time.Time
	if err := conn.QueryRow(ctx, "SELECT revision, refresh_time FROM orchestrator.event_cursor").Scan(&cursor, &refreshed); err != nil {
		return err
	}
	saved = cursor
	savedAt := time.Now()
	save := func() error {
		if _, err := conn.Exec(ctx, "UPDATE orchestrator.event_cursor SET revision = $1", cursor); err != nil {
			return err
		}
		saved, savedAt = cursor, time.Now()
		return nil
	}
	for ctx.Err() == nil {
		wake := d.Changes.Wait()
		changes, err := d.Store.EncodedChanges(ctx, cursor, 1000)
		if errors.Is(err, store.ErrCompacted) {
			d.Log.Warn("event outbox fell behind the change log; consumers resync from their own lists", "cursor", cursor)
			rev, rerr := d.Store.Revision(ctx)
			if rerr != nil {
				return rerr
			}
			cursor = rev
			continue
		}
		if err != nil {
			return err
		}
		if len(changes) > 0 {
			if err := d.publishChanges(ctx, changes); err != nil {
				return err
			}
			cursor = changes[len(changes)-1].Revision
			d.Metrics.EventsPublished.Add(float64(len(changes)))
			if time.Since(savedAt) >= cursorSaveInterval {
				if err := save(); err != nil {
					return err
				}
			}
			if len(changes) == 1000 {
				continue
			}
		}
		if len(changes) == 0 && cursor != saved {
			if err := save(); err != nil {
				return err
			}
		}
		if time.Since(refreshed) >= d.eventRefresh() {
			if err := d.refreshEvents(ctx, cursor); err != nil {
				return err
			}
			refreshed = time.Now()
			if _, err := conn.Exec(ctx, "UPDATE orchestrator.event_cursor SET refresh_time = $1", refreshed); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
		case <-wake:
		case <-time.After(d.poll()):
		}
	}
	return nil
}

// publishEvents publishes evs in order, each on its proxy's subject, and
// waits until JetStream has stored them all.
func (d *Dispatcher) publishEvents(ctx context.Context, evs []*busv1.ProxyEvent) error {
	futures := make([]jetstream.PubAckFuture, 0, len(evs))
	for _, ev := range evs {
		m, err := bus.Message(ctx, d.Names.ProxyEventSubject(ev.GetProxy().GetUid()), ev)
		if err != nil {
			return err
		}
		f, err := d.JS.PublishMsgAsync(m)
		if err != nil {
			return err
		}
		futures = append(futures, f)
	}
	return bus.WaitAcks(ctx, futures)
}

// publishChanges publishes changes as ProxyEvents, in order, each on its
// proxy's subject, and waits until JetStream has stored them all. Each
// snapshot goes into its event as the change log stores it, never decoded
// (encodeEvent).
func (d *Dispatcher) publishChanges(ctx context.Context, changes []store.EncodedChange) error {
	futures := make([]jetstream.PubAckFuture, 0, len(changes))
	for _, c := range changes {
		data, err := encodeEvent(c)
		if err != nil {
			return err
		}
		f, err := d.JS.PublishMsgAsync(bus.EncodedMessage(ctx, d.Names.ProxyEventSubject(c.UID), data))
		if err != nil {
			return err
		}
		futures = append(futures, f)
	}
	return bus.WaitAcks(ctx, futures)
}

// encodeEvent is the encoding of c's ProxyEvent with its snapshot (an
// encoded proxyv1.Proxy) as stored: proto.Marshal encodes the event's
// other fields, and the proxy field, an embedded message, is appended as
// its tag and length-delimited bytes, which is how it travels whatever its
// position among the fields. The snapshot is never decoded and encoded
// again.
func encodeEvent(c store.EncodedChange) ([]byte, error) {
	b, err := proto.MarshalOptions{}.MarshalAppend(make([]byte, 0, len(c.Snapshot)+32),
		&busv1.ProxyEvent{Revision: c.Revision, Type: c.Type, ChangeTime: timestamppb.New(c.Time)})
	if err != nil {
		return nil, fmt.Errorf("encoding the event of revision %d: %w", c.Revision, err)
	}
	b = protowire.AppendTag(b, eventProxyField, protowire.BytesType)
	return protowire.AppendBytes(b, c.Snapshot), nil
}

// eventProxyField is ProxyEvent's proxy field number.
var eventProxyField = (&busv1.ProxyEvent{}).ProtoReflect().Descriptor().Fields().ByName("proxy").Number()

// refreshEvents publishes again the current state of every proxy whose
// latest change is at cursor or older (already published). The streams
// keep a proxy's last event for bus.EventRetention only, and a proxy can
// go unchanged for longer; a consumer starting afterwards (a health or
// lease replica) would never learn of it. The events carry the revision of
// the proxy's latest change, so consumers that have it ignore them. Only
// the outbox calls this, between two batches: no newer event of a proxy
// can have been sent before its refreshed one.
func (d *Dispatcher) refreshEvents(ctx context.Context, cursor int64) error {
	const page = 500
	after, n := "", 0
	for {
		rows, err := d.Store.Published(ctx, after, cursor, page)
		if err != nil {
			return err
		}
		evs := make([]*busv1.ProxyEvent, len(rows))
		for i, r := range rows {
			evs[i] = &busv1.ProxyEvent{Revision: r.Revision, Type: proxyv1.ChangeType_CHANGE_TYPE_UPDATED, Proxy: r.Proto(false), ChangeTime: timestamppb.New(r.UpdateTime)}
		}
		if err := d.publishEvents(ctx, evs); err != nil {
			return err
		}
		n += len(rows)
		if len(rows) < page {
			d.Log.Info("republished the current state of every proxy on the event stream", "proxies", n, "revision", cursor)
			return nil
		}
		after = rows[len(rows)-1].UID
	}
}
