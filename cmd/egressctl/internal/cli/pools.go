package cli

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

func poolsCommand(o *options) *cobra.Command {
	c := &cobra.Command{Use: "pools", Aliases: []string{"pool"}, Short: "Proxy pools on the orchestrator"}
	c.AddCommand(poolsCreate(o), poolsGet(o), poolsList(o), poolsScale(o), poolsDelete(o), poolsWatch(o))
	return c
}

func (o *options) poolClient() (proxyv1.ProxyPoolServiceClient, func(), error) {
	conn, err := o.dial("orchestrator", o.orchestrator)
	if err != nil {
		return nil, nil, err
	}
	return proxyv1.NewProxyPoolServiceClient(conn), func() { conn.Close() }, nil
}

func poolTable(tw *tabwriter.Writer, pools []*proxyv1.ProxyPool) {
	fmt.Fprintln(tw, "NAME\tDESIRED\tCURRENT\tREADY\tUPDATED\tDRAINING\tLAST SCALING\tAGE")
	for _, p := range pools {
		st := p.GetStatus()
		last := ""
		if d := st.GetLastScalingDecision(); d != nil {
			last = fmt.Sprintf("%d->%d %s", d.GetFromReplicas(), d.GetToReplicas(), d.GetReason())
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", p.GetName(), st.GetDesiredReplicas(), st.GetCurrentReplicas(),
			st.GetReadyReplicas(), st.GetUpdatedReplicas(), st.GetDrainingReplicas(), last, age(p.GetCreateTime().AsTime()))
	}
}

func (o *options) printPools(pools []*proxyv1.ProxyPool, single bool) error {
	return o.printMessages(messages(pools), single, func(tw *tabwriter.Writer) { poolTable(tw, pools) })
}

// parseSpread reads provider[/zone][=weight].
func parseSpread(entries []string) ([]*proxyv1.SpreadTarget, error) {
	var out []*proxyv1.SpreadTarget
	for _, e := range entries {
		target, weight, hasWeight := strings.Cut(e, "=")
		provider, zone, _ := strings.Cut(target, "/")
		t := &proxyv1.SpreadTarget{Provider: provider, Zone: zone}
		if hasWeight {
			w, err := strconv.ParseUint(weight, 10, 32)
			if err != nil {
				return nil, usagef("--spread %q: the weight after '=' must be a number", e)
			}
			t.Weight = uint32(w)
		}
		if provider == "" {
			return nil, usagef("--spread %q: want provider[/zone][=weight]", e)
		}
		out = append(out, t)
	}
	return out, nil
}

func poolsCreate(o *options) *cobra.Command {
	var (
		provider, zone, machineType, image, cloudInitFile            string
		port, maxLeases, target                                      uint32
		labels, tmplLabels, spread                                   []string
		replicas, maxSurge, maxUnavailable, minReplicas, maxReplicas int32
		maxAge, unhealthyGrace, drainTimeout, stabilization          time.Duration
	)
	c := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a pool (idempotent on name)",
		Example: `  egressctl pools create web --spread pve-home=3 --spread gce-eu/europe-west1-b=1 \
      --machine-type small --image debian-13 --replicas 10 --max-age 24h --max-surge 2
  egressctl pools create burst --provider local --replicas 2 --min 2 --max 50`,
		Args: exactName,
		RunE: func(cmd *cobra.Command, args []string) error {
			ps := &proxyv1.ProxySpec{Mode: proxyv1.ProxyMode_PROXY_MODE_MANAGED, Provider: provider, Port: port}
			if zone+machineType+image != "" {
				ps.Placement = &proxyv1.Placement{Zone: zone, MachineType: machineType, Image: image}
			}
			if cloudInitFile != "" {
				b, err := readFile(cloudInitFile, cmd.InOrStdin())
				if err != nil {
					return usagef("--cloud-init-file: %v", err)
				}
				ps.CloudInit = string(b)
			}
			if cmd.Flags().Changed("max-leases") {
				ps.Lease = &proxyv1.LeaseSpec{MaxLeases: &maxLeases}
			}
			tl, err := parseLabels("template-label", tmplLabels)
			if err != nil {
				return err
			}
			pl, err := parseLabels("label", labels)
			if err != nil {
				return err
			}
			sp, err := parseSpread(spread)
			if err != nil {
				return err
			}
			spec := &proxyv1.ProxyPoolSpec{
				Template: &proxyv1.ProxyTemplate{Labels: tl, Spec: ps},
				Replicas: replicas, Spread: sp, MaxSurge: maxSurge, MaxUnavailable: maxUnavailable,
			}
			f := cmd.Flags()
			if f.Changed("max-age") {
				spec.MaxAge = durationpb.New(maxAge)
			}
			if f.Changed("unhealthy-grace") {
				spec.UnhealthyGrace = durationpb.New(unhealthyGrace)
			}
			if f.Changed("drain-timeout") {
				spec.DrainTimeout = durationpb.New(drainTimeout)
			}
			if f.Changed("max") {
				spec.Autoscaling = &proxyv1.Autoscaling{MinReplicas: minReplicas, MaxReplicas: maxReplicas, TargetUtilizationPercent: target}
				if f.Changed("stabilization") {
					spec.Autoscaling.ScaleDownStabilization = durationpb.New(stabilization)
				}
			} else if f.Changed("min") || f.Changed("target-utilization") || f.Changed("stabilization") {
				return usagef("--min, --target-utilization and --stabilization need --max (autoscaling)")
			}
			return call(o, o.poolClient, func(ctx context.Context, client proxyv1.ProxyPoolServiceClient) error {
				resp, err := client.CreateProxyPool(ctx, &proxyv1.CreateProxyPoolRequest{Name: args[0], Labels: pl, Spec: spec})
				if err != nil {
					return err
				}
				return o.printPools([]*proxyv1.ProxyPool{resp.GetPool()}, true)
			})
		},
	}
	f := c.Flags()
	f.StringVar(&provider, "provider", "", "the one provider of the pool (without --spread)")
	f.StringArrayVar(&spread, "spread", nil, "provider[/zone][=weight] to spread over (repeatable)")
	f.StringVar(&zone, "zone", "", "placement zone of the template")
	f.StringVar(&machineType, "machine-type", "", "placement machine type")
	f.StringVar(&image, "image", "", "placement image or template")
	f.Uint32Var(&port, "port", 0, "port the proxies listen on (default 3128)")
	f.StringVar(&cloudInitFile, "cloud-init-file", "", "cloud-init user-data file (- for stdin)")
	f.Uint32Var(&maxLeases, "max-leases", 0, "most concurrent leases per proxy")
	f.StringArrayVarP(&labels, "label", "l", nil, "label key=value of the pool (repeatable)")
	f.StringArrayVar(&tmplLabels, "template-label", nil, "label key=value of every proxy (repeatable)")
	f.Int32Var(&replicas, "replicas", 0, "desired number of proxies")
	f.Int32Var(&maxSurge, "max-surge", 0, "proxies a rollout may add beyond replicas (0 with --max-unavailable 0: 1)")
	f.Int32Var(&maxUnavailable, "max-unavailable", 0, "proxies a rollout may take below replicas")
	f.DurationVar(&maxAge, "max-age", 0, "replace proxies older than this (at least 1m)")
	f.DurationVar(&unhealthyGrace, "unhealthy-grace", 0, "replace a proxy not Ready for this long (default 5m)")
	f.DurationVar(&drainTimeout, "drain-timeout", 0, "delete a draining proxy after this even with leases (default 10m)")
	f.Int32Var(&minReplicas, "min", 0, "autoscaling: fewest proxies")
	f.Int32Var(&maxReplicas, "max", 0, "autoscaling: most proxies (turns autoscaling on)")
	f.Uint32Var(&target, "target-utilization", 0, "autoscaling: leased percent of capacity to aim at (default 80)")
	f.DurationVar(&stabilization, "stabilization", 0, "autoscaling: how long demand must stay low before scaling down (default 5m)")
	return c
}

func poolsGet(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "get NAME",
		Short: "Show one pool",
		Args:  exactName,
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.poolClient, func(ctx context.Context, client proxyv1.ProxyPoolServiceClient) error {
				resp, err := client.GetProxyPool(ctx, &proxyv1.GetProxyPoolRequest{Name: args[0]})
				if err != nil {
					return err
				}
				if o.output == "table" {
					if err := o.printPools([]*proxyv1.ProxyPool{resp.GetPool()}, true); err != nil {
						return err
					}
					poolDetail(o, resp.GetPool())
					return nil
				}
				return o.printPools([]*proxyv1.ProxyPool{resp.GetPool()}, true)
			})
		},
	}
}

// poolDetail prints the spread, the conditions and the last decision.
func poolDetail(o *options, p *proxyv1.ProxyPool) {
	st := p.GetStatus()
	tw := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\nPROVIDER\tZONE\tDESIRED\tCURRENT\tREADY\tFAILING")
	for _, s := range st.GetSpread() {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%v\n", s.GetProvider(), s.GetZone(), s.GetDesired(), s.GetCurrent(), s.GetReady(), s.GetFailing())
	}
	fmt.Fprintln(tw, "\nCONDITION\tSTATUS\tREASON\tMESSAGE")
	for _, c := range st.GetConditions() {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", c.GetType(), strings.TrimPrefix(c.GetStatus().String(), "CONDITION_STATUS_"), c.GetReason(), c.GetMessage())
	}
	_ = tw.Flush()
	if d := st.GetLastScalingDecision(); d != nil {
		fmt.Fprintf(o.out, "\nLast scaling: %d -> %d (%s) %s ago: %s\n", d.GetFromReplicas(), d.GetToReplicas(), d.GetReason(),
			age(d.GetTime().AsTime()), d.GetMessage())
	}
}

func poolsList(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "list",
		Short: "List pools (every page)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			client, closeConn, err := o.poolClient()
			if err != nil {
				return err
			}
			defer closeConn()
			req := &proxyv1.ListProxyPoolsRequest{PageSize: 1000}
			var all []*proxyv1.ProxyPool
			for {
				ctx, cancel := o.ctx()
				resp, err := client.ListProxyPools(ctx, req)
				cancel()
				if err != nil {
					return err
				}
				all = append(all, resp.GetPools()...)
				if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
					break
				}
			}
			return o.printPools(all, false)
		},
	}
}

func poolsScale(o *options) *cobra.Command {
	return &cobra.Command{
		Use:     "scale NAME REPLICAS",
		Short:   "Set a pool's desired count",
		Example: "  egressctl pools scale web 20",
		Args: func(_ *cobra.Command, args []string) error {
			if len(args) != 2 {
				return usagef("want a pool NAME and a REPLICAS count, got %d arguments", len(args))
			}
			return nil
		},
		RunE: func(_ *cobra.Command, args []string) error {
			n, err := strconv.ParseInt(args[1], 10, 32)
			if err != nil || n < 0 {
				return usagef("REPLICAS %q: want a count, 0 or above", args[1])
			}
			return call(o, o.poolClient, func(ctx context.Context, client proxyv1.ProxyPoolServiceClient) error {
				resp, err := client.ScaleProxyPool(ctx, &proxyv1.ScaleProxyPoolRequest{Name: args[0], Replicas: int32(n)})
				if err != nil {
					return err
				}
				return o.printPools([]*proxyv1.ProxyPool{resp.GetPool()}, true)
			})
		},
	}
}

func poolsDelete(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "delete NAME",
		Short: "Delete a pool: its proxies drain, then it goes",
		Args:  exactName,
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.poolClient, func(ctx context.Context, client proxyv1.ProxyPoolServiceClient) error {
				resp, err := client.DeleteProxyPool(ctx, &proxyv1.DeleteProxyPoolRequest{Name: args[0]})
				if err != nil {
					return err
				}
				return o.printPools([]*proxyv1.ProxyPool{resp.GetPool()}, true)
			})
		},
	}
}

func poolsWatch(o *options) *cobra.Command {
	var since int64
	c := &cobra.Command{
		Use:   "watch [NAME]",
		Short: "Stream pool changes (Ctrl-C stops)",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			if since < 0 {
				return usagef("--since %d: want a revision, 0 or above", since)
			}
			client, closeConn, err := o.poolClient()
			if err != nil {
				return err
			}
			defer closeConn()
			req := &proxyv1.WatchProxyPoolsRequest{SinceRevision: since}
			if len(args) == 1 {
				req.Name = args[0]
			}
			stream, err := client.WatchProxyPools(signalContext(), req)
			if err != nil {
				return err
			}
			if _, err := stream.Header(); err != nil {
				if isCancel(err) {
					return nil
				}
				return err
			}
			if o.output == "table" {
				fmt.Fprintln(o.out, "REVISION  CHANGE   NAME  DESIRED  CURRENT  READY  UPDATED  DRAINING")
			}
			for {
				ev, err := stream.Recv()
				if err != nil {
					if isCancel(err) {
						return nil
					}
					return err
				}
				if o.output != "table" {
					if err := o.printMessages([]proto.Message{ev}, true, nil); err != nil {
						return err
					}
					continue
				}
				st := ev.GetPool().GetStatus()
				fmt.Fprintf(o.out, "%d  %s  %s  %d  %d  %d  %d  %d\n", ev.GetRevision(), strings.TrimPrefix(ev.GetType().String(), "CHANGE_TYPE_"),
					ev.GetPool().GetName(), st.GetDesiredReplicas(), st.GetCurrentReplicas(), st.GetReadyReplicas(), st.GetUpdatedReplicas(), st.GetDrainingReplicas())
			}
		},
	}
	c.Flags().Int64Var(&since, "since", 0, "show every change after this pool revision first (0: only changes from now on)")
	return c
}

func proxiesDrain(o *options) *cobra.Command {
	var timeout time.Duration
	var cancel bool
	c := &cobra.Command{
		Use:   "drain NAME",
		Short: "Stop leasing a proxy and delete it once its leases end (or after --timeout)",
		Args:  exactName,
		RunE: func(cmd *cobra.Command, args []string) error {
			req := &proxyv1.DrainProxyRequest{Name: args[0], Cancel: cancel}
			if cmd.Flags().Changed("timeout") {
				if cancel {
					return errors.New("--timeout and --cancel exclude each other")
				}
				req.DrainTimeout = durationpb.New(timeout)
			}
			return call(o, o.proxyClient, func(ctx context.Context, client proxyv1.ProxyServiceClient) error {
				resp, err := client.DrainProxy(ctx, req)
				if err != nil {
					return err
				}
				return o.printProxies([]*proxyv1.Proxy{resp.GetProxy()}, true)
			})
		},
	}
	c.Flags().DurationVar(&timeout, "timeout", 0, "delete the proxy after this even with leases (default 10m)")
	c.Flags().BoolVar(&cancel, "cancel", false, "end draining: the proxy takes leases again")
	return c
}
