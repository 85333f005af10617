package app

import (
	"flag"
	"io"
	"strings"
	"testing"
	"time"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/api"
)

func TestConfigFlags(t *testing.T) {
	t.Parallel()
	base := []string{"--database-url=postgres://db/x", "--nats-url=nats://n:4222"}
	cases := []struct {
		name    string
		args    []string
		wantErr string
		check   func(t *testing.T, c Config)
	}{
		{name: "defaults", check: func(t *testing.T, c Config) {
			if c.DefaultMaxLeases != 1 || c.API.DefaultTTL != 5*time.Minute || c.SweepInterval != time.Second {
				t.Errorf("%+v", c)
			}
			if d := c.API.Cooldowns[leasev1.Outcome_OUTCOME_BANNED]; d != (api.CooldownDefault{Duration: time.Hour}) {
				t.Errorf("banned default %+v", d)
			}
		}},
		{name: "cooldown override with scope", args: []string{"--cooldown-banned=6h,global", "--cooldown-timeout=10s"}, check: func(t *testing.T, c Config) {
			if d := c.API.Cooldowns[leasev1.Outcome_OUTCOME_BANNED]; d != (api.CooldownDefault{Duration: 6 * time.Hour, Global: true}) {
				t.Errorf("banned %+v", d)
			}
			if d := c.API.Cooldowns[leasev1.Outcome_OUTCOME_TIMEOUT]; d != (api.CooldownDefault{Duration: 10 * time.Second, Global: true}) {
				t.Errorf("timeout %+v", d)
			}
		}},
		{name: "bad cooldown", args: []string{"--cooldown-banned=forever"}, wantErr: "cooldown-banned"},
		{name: "bad cooldown scope", args: []string{"--cooldown-banned=1h,everywhere"}, wantErr: "scope"},
		{name: "no database", args: []string{"--database-url="}, wantErr: "--database-url is required"},
		{name: "no nats", args: []string{"--nats-url="}, wantErr: "--nats-url is required"},
		{name: "negative capacity", args: []string{"--default-max-leases=-1"}, wantErr: "--default-max-leases"},
		{name: "default ttl out of bounds", args: []string{"--default-ttl=2h"}, wantErr: "--default-ttl"},
		{name: "min above max", args: []string{"--min-ttl=2h"}, wantErr: "--min-ttl"},
		{name: "token without address", args: []string{"--orchestrator-token-file=/x"}, wantErr: "--orchestrator-addr"},
		{name: "no connections", args: []string{"--database-max-conns=0"}, wantErr: "--database-max-conns"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			c := DefaultConfig()
			fs := flag.NewFlagSet("lease", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			c.RegisterFlags(fs)
			err := fs.Parse(append(append([]string{}, base...), tc.args...))
			if err == nil {
				err = c.validate()
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one mentioning %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tc.check(t, c)
		})
	}
}
