// Package cli is egressctl's commands. Every command talks gRPC to one
// service, prints a table for people or the messages as JSON or YAML with
// -o, and fails with one line naming what went wrong.
package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"go.yaml.in/yaml/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/egress-proxies/egress-proxies/pkg/service"
)

// options are the global flags.
type options struct {
	orchestrator string
	lease        string
	health       string
	token        string
	tokenFile    string
	caFile       string
	serverName   string
	tls          bool
	output       string
	timeout      time.Duration

	out, errOut io.Writer
	// target names the service the command talks to, for errors.
	target string
}

// usageError is bad input: its message is printed as is.
type usageError struct{ msg string }

func (e *usageError) Error() string { return e.msg }

func usagef(format string, args ...any) error { return &usageError{fmt.Sprintf(format, args...)} }

// Main runs egressctl with args and returns the exit code.
func Main(args []string, out, errOut io.Writer) int {
	o := &options{out: out, errOut: errOut}
	root := newRoot(o)
	root.SetArgs(args)
	root.SetOut(out)
	root.SetErr(errOut)
	if err := root.Execute(); err != nil {
		fmt.Fprintln(errOut, "egressctl: "+describe(err, o))
		return 1
	}
	return 0
}

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func newRoot(o *options) *cobra.Command {
	root := &cobra.Command{
		Use:           "egressctl",
		Short:         "Manage egress proxies, leases and health",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	f := root.PersistentFlags()
	f.StringVar(&o.orchestrator, "orchestrator", envOr("EGRESS_ORCHESTRATOR_ADDR", "localhost:8100"), "orchestrator gRPC address (env EGRESS_ORCHESTRATOR_ADDR)")
	f.StringVar(&o.lease, "lease", envOr("EGRESS_LEASE_ADDR", "localhost:8110"), "lease service gRPC address (env EGRESS_LEASE_ADDR)")
	f.StringVar(&o.health, "health", envOr("EGRESS_HEALTH_ADDR", "localhost:8120"), "health service gRPC address (env EGRESS_HEALTH_ADDR)")
	f.StringVar(&o.token, "token", os.Getenv("EGRESS_TOKEN"), "bearer token (env EGRESS_TOKEN); prefer --token-file, which keeps it out of the process list")
	f.StringVar(&o.tokenFile, "token-file", os.Getenv("EGRESS_TOKEN_FILE"), "file holding the bearer token (env EGRESS_TOKEN_FILE)")
	f.StringVar(&o.caFile, "ca-file", os.Getenv("EGRESS_CA_FILE"), "PEM CA file that verifies the services' TLS certificates; setting it dials over TLS (env EGRESS_CA_FILE)")
	f.StringVar(&o.serverName, "server-name", os.Getenv("EGRESS_SERVER_NAME"), "name the service's TLS certificate must carry (default: the host of its address; env EGRESS_SERVER_NAME)")
	f.BoolVar(&o.tls, "tls", os.Getenv("EGRESS_TLS") == "true", "dial over TLS verified by the system's CAs (env EGRESS_TLS=true); implied by --ca-file")
	f.StringVarP(&o.output, "output", "o", "table", "output format: table, json or yaml")
	f.DurationVar(&o.timeout, "timeout", 30*time.Second, "time limit of one call")
	root.PersistentPreRunE = func(*cobra.Command, []string) error {
		switch o.output {
		case "table", "json", "yaml":
			return nil
		}
		return usagef("--output %q: want table, json or yaml", o.output)
	}
	root.AddCommand(proxiesCommand(o), poolsCommand(o), leasesCommand(o), healthCommand(o))
	return root
}

// dial connects to the service at addr with TLS and the token as the
// flags say.
func (o *options) dial(name, addr string) (*grpc.ClientConn, error) {
	o.target = name + " at " + addr
	if o.token != "" && o.tokenFile != "" {
		return nil, usagef("--token and --token-file: give one")
	}
	c := service.Client{Addr: addr, CAFile: o.caFile, TLS: o.tls, ServerName: o.serverName, TokenFile: o.tokenFile, Token: o.token}
	conn, err := c.Dial()
	if err != nil {
		return nil, usagef("%v", err)
	}
	return conn, nil
}

func (o *options) ctx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), o.timeout)
}

// call connects with connect, runs fn under the call timeout, and closes
// the connection.
func call[C any](o *options, connect func() (C, func(), error), fn func(context.Context, C) error) error {
	client, closeConn, err := connect()
	if err != nil {
		return err
	}
	defer closeConn()
	ctx, cancel := o.ctx()
	defer cancel()
	return fn(ctx, client)
}

// describe turns an error into one line a person can act on.
func describe(err error, o *options) string {
	var ue *usageError
	if errors.As(err, &ue) {
		return ue.msg
	}
	st, ok := status.FromError(err)
	if !ok {
		return err.Error()
	}
	switch st.Code() {
	case codes.Unavailable:
		msg := st.Message()
		var opErr *net.OpError
		if errors.As(err, &opErr) || strings.Contains(msg, "connection refused") || strings.Contains(msg, "connection error") {
			return "cannot reach the " + o.target + ": " + shorten(msg)
		}
		return "the " + o.target + " is unavailable: " + msg
	case codes.Unauthenticated:
		return st.Message() + " (set --token-file, EGRESS_TOKEN_FILE, --token or EGRESS_TOKEN)"
	case codes.DeadlineExceeded:
		return fmt.Sprintf("no answer within %s (--timeout)", o.timeout)
	}
	return strings.ToLower(st.Code().String()[:1]) + st.Code().String()[1:] + ": " + st.Message()
}

// shorten keeps the useful end of gRPC's connection errors, e.g.
// "dial tcp 127.0.0.1:8100: connect: connection refused".
func shorten(msg string) string {
	if i := strings.Index(msg, "dial tcp"); i >= 0 {
		return strings.TrimSuffix(msg[i:], `"`)
	}
	return msg
}

// printMessages prints msgs as JSON or YAML, or calls table for people.
// messages turns a slice of one message type into the []proto.Message
// printMessages takes.
func messages[M proto.Message](ms []M) []proto.Message {
	out := make([]proto.Message, len(ms))
	for i, m := range ms {
		out[i] = m
	}
	return out
}

func (o *options) printMessages(msgs []proto.Message, single bool, table func(*tabwriter.Writer)) error {
	switch o.output {
	case "json", "yaml":
		// An empty list prints as [] rather than null.
		values := make([]any, 0, len(msgs))
		for _, m := range msgs {
			b, err := protojson.MarshalOptions{UseProtoNames: false, EmitUnpopulated: false}.Marshal(m)
			if err != nil {
				return err
			}
			var v any
			if err := json.Unmarshal(b, &v); err != nil {
				return err
			}
			values = append(values, v)
		}
		var doc any = values
		if single && len(values) == 1 {
			doc = values[0]
		}
		if o.output == "json" {
			enc := json.NewEncoder(o.out)
			enc.SetIndent("", "  ")
			return enc.Encode(doc)
		}
		enc := yaml.NewEncoder(o.out)
		enc.SetIndent(2)
		defer enc.Close()
		return enc.Encode(doc)
	}
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	table(tw)
	return tw.Flush()
}

// parseLabels reads k=v pairs.
func parseLabels(flag string, pairs []string) (map[string]string, error) {
	if len(pairs) == 0 {
		return nil, nil
	}
	out := map[string]string{}
	for _, p := range pairs {
		k, v, ok := strings.Cut(p, "=")
		if !ok || k == "" {
			return nil, usagef("--%s %q: want key=value", flag, p)
		}
		out[k] = v
	}
	return out, nil
}

func age(t time.Time) string {
	if t.IsZero() {
		return ""
	}
	d := time.Since(t).Round(time.Second)
	switch {
	case d < time.Minute:
		return d.String()
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}
