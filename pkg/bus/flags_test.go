package bus_test

import (
	"context"
	"flag"
	"io"
	"log/slog"
	"strings"
	"testing"

	"github.com/egress-proxies/egress-proxies/pkg/bus"
	"github.com/egress-proxies/egress-proxies/pkg/natstest"
	"github.com/egress-proxies/egress-proxies/pkg/service"
)

// Every service shares these flags: their names, defaults, environment
// variables and the errors that name them.
func TestFlags(t *testing.T) {
	cases := []struct {
		name    string
		args    []string
		env     map[string]string
		want    bus.Flags
		wantErr string
	}{
		{name: "defaults", args: []string{"--nats-url=nats://n:4222"},
			want: bus.Flags{URL: "nats://n:4222", Prefix: bus.DefaultPrefix, StreamReplicas: 1}},
		{name: "from the environment", env: map[string]string{"EGRESS_NATS_URL": "nats://a:4222,nats://b:4222", "EGRESS_NATS_PREFIX": "p1", "EGRESS_NATS_STREAM_REPLICAS": "3"},
			want: bus.Flags{URL: "nats://a:4222,nats://b:4222", Prefix: "p1", StreamReplicas: 3}},
		{name: "no URL: no default to fall back on", wantErr: "--nats-url is required"},
		{name: "too many replicas", args: []string{"--nats-url=nats://n:4222", "--nats-stream-replicas=6"}, wantErr: "--nats-stream-replicas must be between 1 and 5"},
		{name: "no replicas", args: []string{"--nats-url=nats://n:4222", "--nats-stream-replicas=0"}, wantErr: "--nats-stream-replicas"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			var f bus.Flags
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			f.Register(fs)
			err := service.Parse(fs, tc.args)
			if err == nil {
				err = f.Validate()
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one with %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if f != tc.want {
				t.Fatalf("flags %+v, want %+v", f, tc.want)
			}
		})
	}
}

// Connect through the flags ensures the streams of their prefix, and
// refuses flags Validate refuses before dialling.
func TestFlagsConnect(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	srv := natstest.New(t)
	f := bus.Flags{URL: srv.URL(), Prefix: "flags-test", StreamReplicas: 1}
	nc, js, err := f.Connect(ctx, "flags-test", slog.New(slog.DiscardHandler), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := js.Stream(ctx, f.Names().CommandStream()); err != nil {
		t.Fatalf("stream %s: %v", f.Names().CommandStream(), err)
	}
	if _, _, err := (&bus.Flags{URL: srv.URL(), StreamReplicas: 9}).Connect(ctx, "x", nil, nil); err == nil || !strings.Contains(err.Error(), "--nats-stream-replicas") {
		t.Fatalf("Connect with 9 replicas: %v", err)
	}
}
