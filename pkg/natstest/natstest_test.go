package natstest_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/egress-proxies/egress-proxies/pkg/natstest"
)

// Two tests running at the same time use the same stream and subject names
// and still see only their own messages.
func TestParallelServersAreIsolated(t *testing.T) {
	var published sync.WaitGroup
	published.Add(2)
	for name, count := range map[string]int{"alpha": 3, "beta": 5} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			js := natstest.New(t).JetStream(t)
			stream, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "COMMANDS", Subjects: []string{"egress.cmd.>"}})
			if err != nil {
				t.Fatal(err)
			}
			for i := range count {
				if _, err := js.Publish(ctx, "egress.cmd.local", fmt.Appendf(nil, "%s-%d", name, i)); err != nil {
					t.Fatal(err)
				}
			}
			published.Done()
			published.Wait()
			info, err := stream.Info(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if info.State.Msgs != uint64(count) {
				t.Errorf("stream holds %d messages, want %d", info.State.Msgs, count)
			}
			msg, err := stream.GetMsg(ctx, 1)
			if err != nil {
				t.Fatal(err)
			}
			if string(msg.Data) != name+"-0" {
				t.Errorf("first message = %q, want %s-0", msg.Data, name)
			}
		})
	}
}

func TestDurableConsumerWorks(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	js := natstest.New(t).JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
		t.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, "S", jetstream.ConsumerConfig{Durable: "workers", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.x", []byte("hello")); err != nil {
		t.Fatal(err)
	}
	msg, err := cons.Next(jetstream.FetchMaxWait(5 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if string(msg.Data()) != "hello" {
		t.Errorf("got %q", msg.Data())
	}
	if err := msg.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
}

// A restart drops the clients, which reconnect to the same port, and keeps
// the streams with their messages.
func TestRestartKeepsStreams(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	srv := natstest.New(t)
	url := srv.URL()
	js := srv.JetStream(t)
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "S", Subjects: []string{"s.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "s.a", []byte("before")); err != nil {
		t.Fatal(err)
	}
	srv.Restart(t)
	if srv.URL() != url {
		t.Errorf("restarted at %s, want %s", srv.URL(), url)
	}
	// The first connection reconnects by itself.
	var ack *jetstream.PubAck
	var err error
	for ack == nil && ctx.Err() == nil {
		if ack, err = js.Publish(ctx, "s.a", []byte("after")); err != nil {
			time.Sleep(100 * time.Millisecond) // waiting for the reconnect
		}
	}
	if ack == nil {
		t.Fatalf("publishing after the restart: %v", err)
	}
	if ack.Sequence != 2 {
		t.Errorf("the message after the restart has sequence %d, want 2 (the stream kept the first)", ack.Sequence)
	}
}
