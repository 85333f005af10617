package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/proto"

	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

func proxiesCommand(o *options) *cobra.Command {
	c := &cobra.Command{Use: "proxies", Aliases: []string{"proxy", "px"}, Short: "Proxies on the orchestrator"}
	c.AddCommand(proxiesCreate(o), proxiesGet(o), proxiesList(o), proxiesDelete(o), proxiesDrain(o), proxiesWatch(o), proxiesRotateCredentials(o))
	return c
}

func (o *options) proxyClient() (proxyv1.ProxyServiceClient, func(), error) {
	conn, err := o.dial("orchestrator", o.orchestrator)
	if err != nil {
		return nil, nil, err
	}
	return proxyv1.NewProxyServiceClient(conn), func() { conn.Close() }, nil
}

func phaseName(p proxyv1.ProxyPhase) string {
	s := strings.TrimPrefix(p.String(), "PROXY_PHASE_")
	if s == "UNSPECIFIED" {
		return ""
	}
	return strings.ToUpper(s[:1]) + strings.ToLower(s[1:])
}

func modeName(m proxyv1.ProxyMode) string {
	s := strings.TrimPrefix(m.String(), "PROXY_MODE_")
	return strings.ToUpper(s[:1]) + strings.ToLower(s[1:])
}

func proxyTable(tw *tabwriter.Writer, proxies []*proxyv1.Proxy) {
	fmt.Fprintln(tw, "NAME\tMODE\tPROVIDER\tPHASE\tADDRESS\tHEALTHY\tREASON\tAGE")
	for _, p := range proxies {
		st := p.GetStatus()
		addr := ""
		if st.GetIp() != "" {
			addr = net.JoinHostPort(st.GetIp(), strconv.Itoa(int(st.GetPort())))
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%v\t%s\t%s\n", p.GetName(), modeName(p.GetSpec().GetMode()),
			p.GetSpec().GetProvider(), phaseName(st.GetPhase()), addr, st.GetHealthy(), st.GetReason(), age(p.GetCreateTime().AsTime()))
	}
}

func (o *options) printProxies(proxies []*proxyv1.Proxy, single bool) error {
	return o.printMessages(messages(proxies), single, func(tw *tabwriter.Writer) { proxyTable(tw, proxies) })
}

func proxiesCreate(o *options) *cobra.Command {
	var (
		mode, provider, region, zone, machineType, image, endpoint, cloudInitFile string
		credentials, endpointUser, endpointPasswordFile                           string
		port, maxLeases                                                           uint32
		labels                                                                    []string
		skipCleanup, wait, serviceOnly                                            bool
	)
	c := &cobra.Command{
		Use:   "create NAME",
		Short: "Create a proxy (idempotent on name)",
		Example: `  egressctl proxies create p1 --provider pve-home --zone pv1-1 --machine-type small --image debian-13 --wait
  egressctl proxies create ext1 --mode external --endpoint 203.0.113.7:3128`,
		Args: exactName,
		RunE: func(cmd *cobra.Command, args []string) error {
			spec := &proxyv1.ProxySpec{Provider: provider, Port: port}
			switch strings.ToLower(mode) {
			case "managed":
				spec.Mode = proxyv1.ProxyMode_PROXY_MODE_MANAGED
			case "external":
				spec.Mode = proxyv1.ProxyMode_PROXY_MODE_EXTERNAL
			default:
				return usagef("--mode %q: want managed or external", mode)
			}
			if region+zone+machineType+image != "" {
				spec.Placement = &proxyv1.Placement{Region: region, Zone: zone, MachineType: machineType, Image: image}
			}
			if endpoint != "" {
				host, p, err := net.SplitHostPort(endpoint)
				n, perr := strconv.ParseUint(p, 10, 16)
				if err != nil || perr != nil {
					return usagef("--endpoint %q: want host:port", endpoint)
				}
				spec.Endpoint = &proxyv1.Endpoint{Host: host, Port: uint32(n)}
			}
			if cloudInitFile != "" {
				b, err := readFile(cloudInitFile, cmd.InOrStdin())
				if err != nil {
					return usagef("--cloud-init-file: %v", err)
				}
				spec.CloudInit = string(b)
			}
			switch strings.ToLower(credentials) {
			case "", "generated":
			case "none":
				spec.Credentials = proxyv1.CredentialsPolicy_CREDENTIALS_POLICY_NONE
			default:
				return usagef("--credentials %q: want generated or none", credentials)
			}
			spec.CredentialsServiceOnly = serviceOnly
			if (endpointUser == "") != (endpointPasswordFile == "") {
				return usagef("--endpoint-user and --endpoint-password-file go together")
			}
			if endpointUser != "" {
				b, err := readFile(endpointPasswordFile, cmd.InOrStdin())
				if err != nil {
					return usagef("--endpoint-password-file: %v", err)
				}
				spec.EndpointCredentials = &proxyv1.ProxyCredentials{Username: endpointUser, Password: strings.TrimRight(string(b), "\r\n")}
			}
			if cmd.Flags().Changed("max-leases") {
				spec.Lease = &proxyv1.LeaseSpec{MaxLeases: &maxLeases}
			}
			lbls, err := parseLabels("label", labels)
			if err != nil {
				return err
			}
			return call(o, o.proxyClient, func(ctx context.Context, client proxyv1.ProxyServiceClient) error {
				resp, err := client.CreateProxy(ctx, &proxyv1.CreateProxyRequest{Name: args[0], Labels: lbls, Spec: spec, SkipCleanup: skipCleanup})
				if err != nil {
					return err
				}
				if !wait {
					return o.printProxies([]*proxyv1.Proxy{resp.GetProxy()}, true)
				}
				return o.waitReady(client, resp.GetProxy())
			})
		},
	}
	f := c.Flags()
	f.StringVar(&mode, "mode", "managed", "managed (provisioned on --provider) or external (--endpoint)")
	f.StringVar(&provider, "provider", "", "provider name from the providers config (managed)")
	f.StringVar(&region, "region", "", "placement region")
	f.StringVar(&zone, "zone", "", "placement zone (GCE zone, KVM host, Proxmox node)")
	f.StringVar(&machineType, "machine-type", "", "placement machine type")
	f.StringVar(&image, "image", "", "placement image or template")
	f.Uint32Var(&port, "port", 0, "port the proxy listens on in the instance (default 3128)")
	f.StringVar(&endpoint, "endpoint", "", "host:port of an external proxy")
	f.StringVar(&cloudInitFile, "cloud-init-file", "", "cloud-init user-data file (- for stdin)")
	f.StringVar(&credentials, "credentials", "generated", "generated (random credentials, handed out with leases) or none (the proxy serves anyone who reaches it; managed)")
	f.BoolVar(&serviceOnly, "credentials-service-only", false, "hand the proxy's credentials only to service-role callers (the gateway), never to crawlers")
	f.StringVar(&endpointUser, "endpoint-user", "", "user name the external proxy demands (with --endpoint-password-file)")
	f.StringVar(&endpointPasswordFile, "endpoint-password-file", "", "file holding the external proxy's password (- for stdin)")
	f.Uint32Var(&maxLeases, "max-leases", 0, "most concurrent leases (0: no limit; unset: the lease service default)")
	f.StringArrayVarP(&labels, "label", "l", nil, "label key=value (repeatable)")
	f.BoolVar(&skipCleanup, "skip-cleanup", false, "abandon the instance when the proxy is deleted")
	f.BoolVar(&wait, "wait", false, "show progress until the proxy is Ready (or Failed)")
	return c
}

func readFile(path string, stdin io.Reader) ([]byte, error) {
	if path == "-" {
		return io.ReadAll(stdin)
	}
	return os.ReadFile(path)
}

func exactName(_ *cobra.Command, args []string) error {
	if len(args) != 1 {
		return usagef("want exactly one proxy NAME, got %d arguments", len(args))
	}
	return nil
}

// waitReady follows the proxy's changes, printing each new phase, until it
// is Ready or Failed.
func (o *options) waitReady(client proxyv1.ProxyServiceClient, p *proxyv1.Proxy) error {
	ctx, cancel := o.ctx()
	defer cancel()
	list, err := client.ListProxies(ctx, &proxyv1.ListProxiesRequest{PageSize: 1})
	if err != nil {
		return err
	}
	// The creation happened before the list, so start from the proxy's own
	// state and follow changes after the list's revision.
	cur, err := client.GetProxy(ctx, &proxyv1.GetProxyRequest{Name: p.GetName()})
	if err != nil {
		return err
	}
	last := proxyv1.ProxyPhase_PROXY_PHASE_UNSPECIFIED
	report := func(p *proxyv1.Proxy) (done bool, err error) {
		st := p.GetStatus()
		if st.GetPhase() != last {
			last = st.GetPhase()
			detail := st.GetReason()
			if st.GetMessage() != "" {
				detail += ": " + st.GetMessage()
			}
			fmt.Fprintf(o.errOut, "%s\t%s\t%s\n", p.GetName(), phaseName(last), detail)
		}
		switch last {
		case proxyv1.ProxyPhase_PROXY_PHASE_READY:
			return true, nil
		case proxyv1.ProxyPhase_PROXY_PHASE_FAILED:
			return true, fmt.Errorf("proxy %s failed: %s", p.GetName(), st.GetMessage())
		}
		return false, nil
	}
	if done, err := report(cur.GetProxy()); done {
		if err != nil {
			return err
		}
		return o.printProxies([]*proxyv1.Proxy{cur.GetProxy()}, true)
	}
	stream, err := client.WatchProxies(ctx, &proxyv1.WatchProxiesRequest{SinceRevision: list.GetRevision(), Provider: p.GetSpec().GetProvider()})
	if err != nil {
		return err
	}
	for {
		ev, err := stream.Recv()
		if err != nil {
			return err
		}
		if ev.GetProxy().GetUid() != p.GetUid() {
			continue
		}
		if ev.GetType() == proxyv1.ChangeType_CHANGE_TYPE_DELETED {
			return errors.New("the proxy was deleted while waiting")
		}
		done, err := report(ev.GetProxy())
		if err != nil {
			return err
		}
		if done {
			return o.printProxies([]*proxyv1.Proxy{ev.GetProxy()}, true)
		}
	}
}

func proxiesGet(o *options) *cobra.Command {
	var full bool
	c := &cobra.Command{
		Use:   "get NAME",
		Short: "Show one proxy",
		Args:  exactName,
		RunE: func(_ *cobra.Command, args []string) error {
			req := &proxyv1.GetProxyRequest{Name: args[0]}
			if full {
				req.View = proxyv1.ProxyView_PROXY_VIEW_FULL
			}
			return call(o, o.proxyClient, func(ctx context.Context, client proxyv1.ProxyServiceClient) error {
				resp, err := client.GetProxy(ctx, req)
				if err != nil {
					return err
				}
				return o.printProxies([]*proxyv1.Proxy{resp.GetProxy()}, true)
			})
		},
	}
	c.Flags().BoolVar(&full, "full", false, "the FULL view, with spec.cloudInit (needs the admin role; shown with -o json or yaml)")
	return c
}

func proxiesList(o *options) *cobra.Command {
	var provider, phase string
	var labels []string
	c := &cobra.Command{
		Use:   "list",
		Short: "List proxies (every page)",
		Args:  cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			req := &proxyv1.ListProxiesRequest{Provider: provider, PageSize: 1000}
			if phase != "" {
				v, ok := proxyv1.ProxyPhase_value["PROXY_PHASE_"+strings.ToUpper(phase)]
				if !ok {
					return usagef("--phase %q: want pending, provisioning, running, ready, failed or deleting", phase)
				}
				req.Phase = proxyv1.ProxyPhase(v)
			}
			var err error
			if req.Labels, err = parseLabels("label", labels); err != nil {
				return err
			}
			client, closeConn, err := o.proxyClient()
			if err != nil {
				return err
			}
			defer closeConn()
			var all []*proxyv1.Proxy
			for {
				ctx, cancel := o.ctx()
				resp, err := client.ListProxies(ctx, req)
				cancel()
				if err != nil {
					return err
				}
				all = append(all, resp.GetProxies()...)
				if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
					break
				}
			}
			return o.printProxies(all, false)
		},
	}
	c.Flags().StringVar(&provider, "provider", "", "only proxies on this provider")
	c.Flags().StringVar(&phase, "phase", "", "only proxies in this phase")
	c.Flags().StringArrayVarP(&labels, "label", "l", nil, "only proxies with label key=value (repeatable)")
	return c
}

func proxiesDelete(o *options) *cobra.Command {
	var skipCleanup bool
	c := &cobra.Command{
		Use:   "delete NAME",
		Short: "Delete a proxy and its instance",
		Args:  exactName,
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.proxyClient, func(ctx context.Context, client proxyv1.ProxyServiceClient) error {
				resp, err := client.DeleteProxy(ctx, &proxyv1.DeleteProxyRequest{Name: args[0], SkipCleanup: skipCleanup})
				if err != nil {
					return err
				}
				return o.printProxies([]*proxyv1.Proxy{resp.GetProxy()}, true)
			})
		},
	}
	c.Flags().BoolVar(&skipCleanup, "skip-cleanup", false, "abandon the instance instead of deleting it")
	return c
}

func proxiesWatch(o *options) *cobra.Command {
	var since int64
	var provider string
	var list bool
	c := &cobra.Command{
		Use:   "watch",
		Short: "Stream proxy changes (Ctrl-C stops)",
		Long: `Stream proxy changes as they happen (Ctrl-C stops). Without flags only
changes made from now on are shown; --list first shows every proxy as it
is now (CURRENT), then every change after that listing; --since N shows
every change after revision N (kept for the orchestrator's
--watch-retention), then live ones.`,
		Example: `  egressctl proxies watch --list
  egressctl proxies watch --since 41`,
		Args: cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			if list && since != 0 {
				return errors.New("--list and --since exclude each other: --list watches from the listing's revision")
			}
			if since < 0 {
				return fmt.Errorf("--since %d: want a revision, 0 or above", since)
			}
			client, closeConn, err := o.proxyClient()
			if err != nil {
				return err
			}
			defer closeConn()
			header := func() {
				if o.output == "table" {
					fmt.Fprintln(o.out, "REVISION  CHANGE   NAME  PHASE  REASON")
				}
			}
			if list {
				header()
				// The listing's revision: watching from it misses nothing
				// changed after the listing.
				req := &proxyv1.ListProxiesRequest{Provider: provider}
				for {
					ctx, cancel := o.ctx()
					resp, err := client.ListProxies(ctx, req)
					cancel()
					if err != nil {
						return err
					}
					if since == 0 || resp.GetRevision() < since {
						since = resp.GetRevision()
					}
					for _, p := range resp.GetProxies() {
						if err := o.printChange(&proxyv1.WatchProxiesResponse{Revision: resp.GetRevision(), Proxy: p}); err != nil {
							return err
						}
					}
					if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
						break
					}
				}
			}
			stream, err := client.WatchProxies(signalContext(), &proxyv1.WatchProxiesRequest{SinceRevision: since, Provider: provider})
			if err != nil {
				return err
			}
			// The orchestrator answers with headers once the watch is in
			// place; without --list the table header says so, so anything
			// changed after it shows.
			if _, err := stream.Header(); err != nil {
				if isCancel(err) {
					return nil
				}
				return err
			}
			if !list {
				header()
			}
			for {
				ev, err := stream.Recv()
				if err != nil {
					if isCancel(err) {
						return nil
					}
					return err
				}
				if err := o.printChange(ev); err != nil {
					return err
				}
			}
		},
	}
	c.Flags().Int64Var(&since, "since", 0, "show every change after this revision first (0: only changes from now on)")
	c.Flags().BoolVar(&list, "list", false, "first show every proxy as it is now (CURRENT), then the changes after that listing")
	c.Flags().StringVar(&provider, "provider", "", "only proxies on this provider")
	return c
}

// printChange prints one watched change; a listed proxy (--list) has no
// change type and shows as CURRENT.
func (o *options) printChange(ev *proxyv1.WatchProxiesResponse) error {
	if o.output != "table" {
		return o.printMessages([]proto.Message{ev}, true, nil)
	}
	change := strings.TrimPrefix(ev.GetType().String(), "CHANGE_TYPE_")
	if ev.GetType() == proxyv1.ChangeType_CHANGE_TYPE_UNSPECIFIED {
		change = "CURRENT"
	}
	fmt.Fprintf(o.out, "%d  %s  %s  %s  %s\n", ev.GetRevision(), change,
		ev.GetProxy().GetName(), phaseName(ev.GetProxy().GetStatus().GetPhase()), ev.GetProxy().GetStatus().GetReason())
	return nil
}

func proxiesRotateCredentials(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "rotate-credentials NAME",
		Short: "Give a managed proxy new random credentials; the old ones stop working",
		Long: `Give a managed proxy new random credentials. The provider changes them in
place where it can, otherwise the instance is replaced; either way the old
credentials stop working, and leases acquired afterwards carry the new ones.`,
		Args: exactName,
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.proxyClient, func(ctx context.Context, client proxyv1.ProxyServiceClient) error {
				resp, err := client.RotateCredentials(ctx, &proxyv1.RotateCredentialsRequest{Name: args[0]})
				if err != nil {
					return err
				}
				return o.printProxies([]*proxyv1.Proxy{resp.GetProxy()}, true)
			})
		},
	}
}
