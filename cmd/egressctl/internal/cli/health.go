package cli

import (
	"context"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
)

func healthCommand(o *options) *cobra.Command {
	c := &cobra.Command{Use: "health", Short: "Health on the health service"}
	c.AddCommand(healthProxies(o), healthProviders(o))
	return c
}

func (o *options) healthClient() (healthv1.HealthServiceClient, func(), error) {
	conn, err := o.dial("health service", o.health)
	if err != nil {
		return nil, nil, err
	}
	return healthv1.NewHealthServiceClient(conn), func() { conn.Close() }, nil
}

func healthProxies(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "proxies [NAME]",
		Short: "Probe verdicts of every proxy, or of one",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			client, closeConn, err := o.healthClient()
			if err != nil {
				return err
			}
			defer closeConn()
			var all []*healthv1.ProxyHealth
			if len(args) == 1 {
				ctx, cancel := o.ctx()
				defer cancel()
				resp, err := client.GetProxyHealth(ctx, &healthv1.GetProxyHealthRequest{ProxyName: args[0]})
				if err != nil {
					return err
				}
				all = append(all, resp.GetHealth())
			} else {
				req := &healthv1.ListProxyHealthRequest{PageSize: 1000}
				for {
					ctx, cancel := o.ctx()
					resp, err := client.ListProxyHealth(ctx, req)
					cancel()
					if err != nil {
						return err
					}
					all = append(all, resp.GetProxies()...)
					if req.PageToken = resp.GetNextPageToken(); req.PageToken == "" {
						break
					}
				}
			}
			return o.printMessages(messages(all), len(args) == 1, func(tw *tabwriter.Writer) {
				fmt.Fprintln(tw, "NAME\tADDRESS\tHEALTHY\tREASON\tLATENCY\tPROBER\tMESSAGE")
				for _, h := range all {
					healthy := fmt.Sprint(h.GetHealthy())
					if !h.GetVerdictKnown() {
						healthy = "unknown"
					}
					fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", h.GetProxyName(), h.GetAddress(), healthy, h.GetReason(),
						h.GetLatency().AsDuration(), h.GetProber(), h.GetMessage())
				}
			})
		},
	}
}

func healthProviders(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "providers [NAME]",
		Short: "Backend checks of every provider, or of one with its targets",
		Args:  cobra.MaximumNArgs(1),
		RunE: func(_ *cobra.Command, args []string) error {
			return call(o, o.healthClient, func(ctx context.Context, client healthv1.HealthServiceClient) error {
				var all []*healthv1.ProviderHealth
				if len(args) == 1 {
					resp, err := client.GetProviderHealth(ctx, &healthv1.GetProviderHealthRequest{Provider: args[0]})
					if err != nil {
						return err
					}
					all = append(all, resp.GetHealth())
				} else {
					resp, err := client.ListProviderHealth(ctx, &healthv1.ListProviderHealthRequest{})
					if err != nil {
						return err
					}
					all = resp.GetProviders()
				}
				return o.printMessages(messages(all), len(args) == 1, func(tw *tabwriter.Writer) {
					fmt.Fprintln(tw, "PROVIDER\tTYPE\tREADY\tREASON\tTARGETS\tLAST CHECK")
					for _, h := range all {
						ready := strings.TrimPrefix(h.GetReadiness().String(), "PROVIDER_READINESS_")
						fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", h.GetProvider(), h.GetType(), ready, h.GetReason(),
							h.GetTargetsReady(), age(h.GetLastCheckTime().AsTime()))
					}
					if len(args) == 1 && len(all) == 1 {
						fmt.Fprintln(tw)
						fmt.Fprintln(tw, "TARGET\tADDRESS\tREADY\tREASON\tLATENCY\tMESSAGE")
						for _, t := range all[0].GetTargets() {
							fmt.Fprintf(tw, "%s\t%s\t%v\t%s\t%s\t%s\n", t.GetName(), t.GetAddress(), t.GetReady(), t.GetReason(),
								t.GetLatency().AsDuration(), t.GetMessage())
						}
					}
				})
			})
		},
	}
}
