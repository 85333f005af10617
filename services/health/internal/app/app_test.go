package app

import (
	"flag"
	"strings"
	"testing"
	"time"
)

func parse(t *testing.T, args ...string) (*Config, error) {
	t.Helper()
	var c Config
	fs := flag.NewFlagSet("health", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	return &c, c.Validate()
}

func TestConfig_Validate(t *testing.T) {
	t.Parallel()
	base := []string{"--database-url=postgres://db/x", "--nats-url=nats://n:4222", "--probe-target=https://probe.internal/ok"}
	tests := []struct {
		name    string
		args    []string
		wantErr string
	}{
		{name: "defaults", args: base},
		{name: "no database", args: []string{"--probe-target=https://probe.internal/ok"}, wantErr: "--database-url"},
		{name: "no NATS", args: []string{"--database-url=postgres://db/x", "--probe-target=https://probe.internal/ok"}, wantErr: "--nats-url is required"},
		{name: "no probe target: no third-party default", args: []string{"--database-url=postgres://db/x"}, wantErr: "--probe-target is required"},
		{name: "probe timeout over interval", args: append(base, "--probe-interval=1s", "--probe-timeout=2s"), wantErr: "--probe-timeout"},
		{name: "provider checks too frequent", args: append(base, "--provider-check-interval=5s"), wantErr: "--provider-check-interval"},
		{name: "provider checks off", args: append(base, "--provider-check-interval=0")},
		{name: "provider check timeout over interval", args: append(base, "--provider-check-interval=10s", "--provider-check-timeout=11s"), wantErr: "--provider-check-timeout"},
		{name: "membership TTL too short", args: append(base, "--membership-ttl=500ms"), wantErr: "--membership-ttl"},
		{name: "fast interval over the interval: capped by it", args: append(base, "--probe-fast-interval=2s")},
		{name: "fast interval too short", args: append(base, "--probe-fast-interval=10ms"), wantErr: "--probe-fast-interval"},
		{name: "fixed cadence", args: append(base, "--probe-fast-interval=0")},
		{name: "TLS 1.3 allowed", args: append(base, "--probe-tls-max-version=1.3")},
		{name: "TLS version unknown", args: append(base, "--probe-tls-max-version=1.1"), wantErr: "--probe-tls-max-version"},
		{name: "bad provisioner", args: append(base, "--provisioner=pve"), wantErr: "provider=host:port"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			_, err := parse(t, tc.args...)
			if tc.wantErr == "" && err != nil {
				t.Fatalf("unexpected error: %v", err)
			}
			if tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("error = %v, want one mentioning %q", err, tc.wantErr)
			}
		})
	}
}

func TestConfig_provisioners(t *testing.T) {
	t.Parallel()
	c, err := parse(t, "--database-url=postgres://db/x", "--nats-url=nats://n:4222", "--probe-target=https://probe.internal/ok",
		"--provisioner=pve=pve-prov:8130", "--provisioner", "kvm=kvm-prov:8140, gcp=gcp-prov:8150")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"pve": "pve-prov:8130", "kvm": "kvm-prov:8140", "gcp": "gcp-prov:8150"}
	if len(c.Provisioners) != len(want) {
		t.Fatalf("provisioners = %v, want %v", c.Provisioners, want)
	}
	for k, v := range want {
		if c.Provisioners[k] != v {
			t.Errorf("provisioner %s = %q, want %q", k, c.Provisioners[k], v)
		}
	}
	if c.ProviderCheckInterval != time.Minute || c.Defaults.Interval != time.Second {
		t.Errorf("defaults: provider checks every %s, probes every %s", c.ProviderCheckInterval, c.Defaults.Interval)
	}
	if c.membershipTTL() != time.Second {
		t.Errorf("membership TTL = %s, want the probe interval", c.membershipTTL())
	}
	c, _ = parse(t, "--database-url=postgres://db/x", "--probe-target=https://probe.internal/ok", "--probe-interval=300ms", "--probe-timeout=300ms", "--probe-fast-interval=100ms")
	if c.membershipTTL() != time.Second {
		t.Errorf("membership TTL = %s, want at least 1s", c.membershipTTL())
	}
}
