package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

func leasesCommand(o *options) *cobra.Command {
	c := &cobra.Command{Use: "leases", Aliases: []string{"lease"}, Short: "Leases on the lease service"}
	c.AddCommand(leasesProxies(o), leasesAcquire(o), leasesRenew(o), leasesRelease(o), leasesReport(o))
	return c
}

func (o *options) leaseClient() (leasev1.LeaseServiceClient, func(), error) {
	conn, err := o.dial("lease service", o.lease)
	if err != nil {
		return nil, nil, err
	}
	return leasev1.NewLeaseServiceClient(conn), func() { conn.Close() }, nil
}

func (o *options) printLease(l *leasev1.Lease) error {
	return o.printMessages([]proto.Message{l}, true, func(tw *tabwriter.Writer) {
		fmt.Fprintln(tw, "LEASE\tPROXY\tADDRESS\tTARGET\tEXPIRES")
		a := l.GetAddress()
		fmt.Fprintf(tw, "%s\t%s\t%s://%s\t%s\t%s\n", l.GetLeaseId(), l.GetProxyName(), a.GetScheme(),
			net.JoinHostPort(a.GetHost(), strconv.Itoa(int(a.GetPort()))), l.GetTargetHost(),
			l.GetExpireTime().AsTime().Local().Format(time.RFC3339))
	})
}

func ttlFlag(d time.Duration) *durationpb.Duration {
	if d == 0 {
		return nil
	}
	return durationpb.New(d)
}

func exactLease(_ *cobra.Command, args []string) error {
	if len(args) != 1 {
		return usagef("want exactly one LEASE_ID, got %d arguments", len(args))
	}
	return nil
}

// leasesProxies lists the proxies the lease service would hand out now: it
// shows the lease service's own view, which lags the orchestrator's by the
// event stream.
func leasesProxies(o *options) *cobra.Command {
	var provider, region, zone string
	var labels []string
	c := &cobra.Command{
		Use:     "proxies",
		Short:   "List the proxies leasable now",
		Example: "  egressctl leases proxies --provider pve-home -l pool=eu",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			lbls, err := parseLabels("label", labels)
			if err != nil {
				return err
			}
			return call(o, o.leaseClient, func(ctx context.Context, client leasev1.LeaseServiceClient) error {
				// Pages of 1,000: one reply for a large pool would pass
				// gRPC's 4 MiB message limit.
				req := &leasev1.ListProxiesRequest{
					Selector: &leasev1.ProxySelector{Provider: provider, Region: region, Zone: zone, Labels: lbls},
					PageSize: 1000,
				}
				var proxies []*leasev1.LeasableProxy
				for {
					resp, err := client.ListProxies(ctx, req)
					if err != nil {
						return err
					}
					proxies = append(proxies, resp.GetProxies()...)
					if resp.GetNextPageToken() == "" {
						break
					}
					req.PageToken = resp.GetNextPageToken()
				}
				return o.printMessages(messages(proxies), false, func(tw *tabwriter.Writer) {
					fmt.Fprintln(tw, "PROXY\tPROVIDER\tADDRESS\tLEASES\tFREE")
					for _, p := range proxies {
						a := p.GetAddress()
						free := "unlimited"
						if p.GetFreeCapacity() >= 0 {
							free = strconv.Itoa(int(p.GetFreeCapacity()))
						}
						fmt.Fprintf(tw, "%s\t%s\t%s://%s\t%d\t%s\n", p.GetProxyName(), p.GetProvider(), a.GetScheme(),
							net.JoinHostPort(a.GetHost(), strconv.Itoa(int(a.GetPort()))), p.GetActiveLeases(), free)
					}
				})
			})
		},
	}
	f := c.Flags()
	f.StringVar(&provider, "provider", "", "only proxies on this provider")
	f.StringVar(&region, "region", "", "only proxies in this region")
	f.StringVar(&zone, "zone", "", "only proxies in this zone")
	f.StringArrayVarP(&labels, "label", "l", nil, "only proxies with label key=value (repeatable)")
	return c
}

func leasesAcquire(o *options) *cobra.Command {
	var target, provider, region, zone string
	var ttl time.Duration
	var labels []string
	var showCredentials bool
	c := &cobra.Command{
		Use:     "acquire",
		Short:   "Lease a proxy",
		Example: "  egressctl leases acquire --target shop.example.com --ttl 5m --label pool=eu",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			lbls, err := parseLabels("label", labels)
			if err != nil {
				return err
			}
			return call(o, o.leaseClient, func(ctx context.Context, client leasev1.LeaseServiceClient) error {
				resp, err := client.AcquireLease(ctx, &leasev1.AcquireLeaseRequest{
					TargetHost: target, Ttl: ttlFlag(ttl),
					Selector: &leasev1.ProxySelector{Provider: provider, Region: region, Zone: zone, Labels: lbls},
				})
				if err != nil {
					return explainExhausted(err)
				}
				if showCredentials {
					// Only the URL, so that it can be used as is:
					// HTTPS_PROXY=$(egressctl leases acquire --show-credentials).
					_, err := fmt.Fprintln(o.out, resp.GetProxyUrl())
					return err
				}
				return o.printLease(resp.GetLease())
			})
		},
	}
	f := c.Flags()
	f.StringVar(&target, "target", "", "host the crawler will fetch (skips proxies cooling down for it)")
	f.DurationVar(&ttl, "ttl", 0, "lease duration (default: the service's)")
	f.StringVar(&provider, "provider", "", "only proxies on this provider")
	f.StringVar(&region, "region", "", "only proxies in this region")
	f.StringVar(&zone, "zone", "", "only proxies in this zone")
	f.StringArrayVarP(&labels, "label", "l", nil, "only proxies with label key=value (repeatable)")
	f.BoolVar(&showCredentials, "show-credentials", false, "print only the proxy URL, with the lease's credentials in it (http://user:password@host:port)")
	return c
}

// explainExhausted adds the NoProxyAvailable counts to "no proxy".
func explainExhausted(err error) error {
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.ResourceExhausted {
		return err
	}
	for _, d := range st.Details() {
		if n, ok := d.(*leasev1.NoProxyAvailable); ok {
			return fmt.Errorf("no proxy available: %d matching, %d unhealthy, %d at capacity, %d cooling down for the target, %d cooling down globally",
				n.GetMatching(), n.GetUnhealthy(), n.GetAtCapacity(), n.GetCoolingDownTarget(), n.GetCoolingDownGlobal())
		}
	}
	return err
}

func leasesRenew(o *options) *cobra.Command {
	var ttl time.Duration
	c := &cobra.Command{
		Use:   "renew LEASE_ID",
		Short: "Extend an active lease",
		Args:  exactLease,
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.leaseClient, func(ctx context.Context, client leasev1.LeaseServiceClient) error {
				resp, err := client.RenewLease(ctx, &leasev1.RenewLeaseRequest{LeaseId: args[0], Ttl: ttlFlag(ttl)})
				if err != nil {
					return err
				}
				return o.printLease(resp.GetLease())
			})
		},
	}
	c.Flags().DurationVar(&ttl, "ttl", 0, "new duration from now (default: the service's)")
	return c
}

func leasesRelease(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "release LEASE_ID",
		Short: "End a lease (idempotent)",
		Args:  exactLease,
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.leaseClient, func(ctx context.Context, client leasev1.LeaseServiceClient) error {
				resp, err := client.ReleaseLease(ctx, &leasev1.ReleaseLeaseRequest{LeaseId: args[0]})
				if err != nil {
					return err
				}
				return o.printMessages([]proto.Message{resp}, true, func(tw *tabwriter.Writer) {
					if resp.GetReleased() {
						fmt.Fprintf(tw, "lease %s released\n", args[0])
					} else {
						fmt.Fprintf(tw, "lease %s had already ended\n", args[0])
					}
				})
			})
		},
	}
}

func leasesReport(o *options) *cobra.Command {
	var outcome, scope string
	var cooldown time.Duration
	c := &cobra.Command{
		Use:     "report LEASE_ID --outcome OUTCOME",
		Short:   "Report how the target treated the proxy",
		Example: "  egressctl leases report 7f9c… --outcome banned --cooldown 30m",
		Args:    exactLease,
		RunE: func(cmd *cobra.Command, args []string) error {
			v, ok := leasev1.Outcome_value["OUTCOME_"+strings.ToUpper(outcome)]
			if !ok || v == 0 {
				return usagef("--outcome %q: want success, blocked, banned, captcha, timeout or error", outcome)
			}
			req := &leasev1.ReportOutcomeRequest{LeaseId: args[0], Outcome: leasev1.Outcome(v)}
			if cmd.Flags().Changed("cooldown") {
				req.Cooldown = durationpb.New(cooldown)
			}
			switch strings.ToLower(scope) {
			case "":
			case "target":
				req.Scope = leasev1.CooldownScope_COOLDOWN_SCOPE_TARGET
			case "global":
				req.Scope = leasev1.CooldownScope_COOLDOWN_SCOPE_GLOBAL
			default:
				return usagef("--scope %q: want target or global", scope)
			}
			return call(o, o.leaseClient, func(ctx context.Context, client leasev1.LeaseServiceClient) error {
				resp, err := client.ReportOutcome(ctx, req)
				if err != nil {
					return err
				}
				return o.printMessages([]proto.Message{resp}, true, func(tw *tabwriter.Writer) {
					cd := resp.GetCooldown()
					if cd == nil {
						fmt.Fprintln(tw, "reported; no cooldown")
						return
					}
					where := "globally"
					if cd.GetTargetHost() != "" {
						where = "for " + cd.GetTargetHost()
					}
					fmt.Fprintf(tw, "reported; the proxy cools down %s until %s\n", where, cd.GetExpireTime().AsTime().Local().Format(time.RFC3339))
				})
			})
		},
	}
	c.Flags().StringVar(&outcome, "outcome", "", "success, blocked, banned, captcha, timeout or error (required)")
	c.Flags().DurationVar(&cooldown, "cooldown", 0, "cooldown length (default: the outcome's)")
	c.Flags().StringVar(&scope, "scope", "", "target or global (default: the outcome's)")
	return c
}

// signalContext ends on Ctrl-C or SIGTERM, for streaming commands.
func signalContext() context.Context {
	ctx, _ := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	return ctx
}

func isCancel(err error) bool {
	return status.Code(err) == codes.Canceled || errors.Is(err, context.Canceled)
}
