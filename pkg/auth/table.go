package auth

import (
	"fmt"
	"slices"
	"strings"

	gatewayv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/gateway/v1"
	healthv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/health/v1"
	identityv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/identity/v1"
	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
)

// Role is what a token may do; a token holds one or more.
type Role string

// The roles.
const (
	// Admin writes proxies and may read them with their cloud-init (the
	// FULL view); it may also read everything and lease.
	Admin Role = "admin"
	// Viewer reads proxies (never their cloud-init), health and the
	// leasable pool.
	Viewer Role = "viewer"
	// Crawler leases proxies and lists the leasable ones; nothing else.
	Crawler Role = "crawler"
	// Service is what one service of the suite needs of another: lease
	// resyncs its pool from the orchestrator's ListProxies/WatchProxies,
	// health checks the provisioners' backends, the gateway leases and
	// follows the lease changes, and only services call the provisioners'
	// ProvisionerService.
	Service Role = "service"
)

// AllRoles lists every role.
func AllRoles() []Role { return []Role{Admin, Viewer, Crawler, Service} }

// ParseRoles parses a comma-separated role list.
func ParseRoles(s string) ([]Role, error) {
	var out []Role
	for _, r := range strings.Split(s, ",") {
		role := Role(strings.TrimSpace(r))
		if !slices.Contains(AllRoles(), role) {
			return nil, fmt.Errorf("role %q: want one of %s", r, roleList(AllRoles()))
		}
		if !slices.Contains(out, role) {
			out = append(out, role)
		}
	}
	return out, nil
}

func roleList(roles []Role) string {
	s := make([]string, len(roles))
	for i, r := range roles {
		s[i] = string(r)
	}
	return strings.Join(s, ", ")
}

// Limit names the per-client rate limit a method counts against.
type Limit string

// The rate-limited method classes.
const (
	// NoLimit: the method is not rate limited.
	NoLimit Limit = ""
	// LeaseLimit covers acquiring, renewing, releasing and reporting.
	LeaseLimit Limit = "lease"
	// ProxyWriteLimit covers creating, updating and deleting proxies.
	ProxyWriteLimit Limit = "proxy-writes"
)

// Rule says who may call a method and which rate limit it counts against.
type Rule struct {
	Roles []Role
	Limit Limit
}

func rule(limit Limit, roles ...Role) Rule { return Rule{Roles: roles, Limit: limit} }

// table is the one place that says which roles may call each RPC of the
// suite, by full gRPC method name. A method missing here is denied to
// everyone, and a service whose gRPC server registers such a method does
// not start (CheckCovered).
var table = map[string]Rule{
	// The orchestrator. Reads return the BASIC view (no cloud-init); the
	// FULL view additionally needs Admin, checked by the handler.
	proxyv1.ProxyService_CreateProxy_FullMethodName:   rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyService_UpdateProxy_FullMethodName:   rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyService_DeleteProxy_FullMethodName:   rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyService_GetProxy_FullMethodName:      rule(NoLimit, Admin, Viewer),
	proxyv1.ProxyService_ListProxies_FullMethodName:   rule(NoLimit, Admin, Viewer, Service),
	proxyv1.ProxyService_WatchProxies_FullMethodName:  rule(NoLimit, Admin, Viewer, Service),
	proxyv1.ProxyService_ListProviders_FullMethodName: rule(NoLimit, Admin, Viewer),
	proxyv1.ProxyService_DrainProxy_FullMethodName:    rule(ProxyWriteLimit, Admin),
	// A proxy's history (the web console's timeline): the BASIC view.
	proxyv1.ProxyService_ListProxyChanges_FullMethodName: rule(NoLimit, Admin, Viewer),
	// New random credentials for a proxy; the old ones stop working.
	proxyv1.ProxyService_RotateCredentials_FullMethodName: rule(ProxyWriteLimit, Admin),
	// A proxy's credentials in plain text: only the suite's own services
	// (lease, health, the gateway, provisioners), never a person's token.
	proxyv1.ProxyService_GetProxyCredentials_FullMethodName: rule(NoLimit, Service),

	// Pools, on the orchestrator: admins write them, viewers read them.
	proxyv1.ProxyPoolService_CreateProxyPool_FullMethodName: rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyPoolService_UpdateProxyPool_FullMethodName: rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyPoolService_ScaleProxyPool_FullMethodName:  rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyPoolService_DeleteProxyPool_FullMethodName: rule(ProxyWriteLimit, Admin),
	proxyv1.ProxyPoolService_GetProxyPool_FullMethodName:    rule(NoLimit, Admin, Viewer),
	proxyv1.ProxyPoolService_ListProxyPools_FullMethodName:  rule(NoLimit, Admin, Viewer),
	proxyv1.ProxyPoolService_WatchProxyPools_FullMethodName: rule(NoLimit, Admin, Viewer),

	// The lease service. The gateway (service) leases on behalf of the
	// crawlers it serves.
	leasev1.LeaseService_ListProxies_FullMethodName:   rule(NoLimit, Admin, Viewer, Crawler),
	leasev1.LeaseService_AcquireLease_FullMethodName:  rule(LeaseLimit, Admin, Crawler, Service),
	leasev1.LeaseService_RenewLease_FullMethodName:    rule(LeaseLimit, Admin, Crawler, Service),
	leasev1.LeaseService_ReleaseLease_FullMethodName:  rule(LeaseLimit, Admin, Crawler, Service),
	leasev1.LeaseService_ReportOutcome_FullMethodName: rule(LeaseLimit, Admin, Crawler, Service),
	// Every client's leases and the cooldowns, for operators (the web
	// console); crawlers never list other clients' leases. The gateway
	// (service) watches the changes and lists the cooldowns to lease
	// from its own cache of the fleet.
	leasev1.LeaseService_ListLeases_FullMethodName:    rule(NoLimit, Admin, Viewer),
	leasev1.LeaseService_ListCooldowns_FullMethodName: rule(NoLimit, Admin, Viewer, Service),
	leasev1.LeaseService_WatchLeases_FullMethodName:   rule(NoLimit, Admin, Viewer, Service),

	// The health service.
	healthv1.HealthService_GetProxyHealth_FullMethodName:    rule(NoLimit, Admin, Viewer),
	healthv1.HealthService_ListProxyHealth_FullMethodName:   rule(NoLimit, Admin, Viewer),
	healthv1.HealthService_WatchProxyHealth_FullMethodName:  rule(NoLimit, Admin, Viewer),
	healthv1.HealthService_GetProviderHealth_FullMethodName: rule(NoLimit, Admin, Viewer),
	// The orchestrator's pool controller polls the providers' health.
	healthv1.HealthService_ListProviderHealth_FullMethodName: rule(NoLimit, Admin, Viewer, Service),

	// The gateway's admin API: a crawler sees, ends and reports on its
	// own sessions (the handler narrows to the caller unless it is an
	// admin or viewer).
	gatewayv1.GatewayService_ListSessions_FullMethodName:  rule(NoLimit, Admin, Viewer, Crawler),
	gatewayv1.GatewayService_GetSession_FullMethodName:    rule(NoLimit, Admin, Viewer, Crawler),
	gatewayv1.GatewayService_EndSession_FullMethodName:    rule(LeaseLimit, Admin, Crawler),
	gatewayv1.GatewayService_ReportOutcome_FullMethodName: rule(LeaseLimit, Admin, Crawler),
	gatewayv1.GatewayService_GetStatus_FullMethodName:     rule(NoLimit, Admin, Viewer, Crawler, Service),

	// Every service: any authenticated caller may ask who it is.
	identityv1.IdentityService_GetIdentity_FullMethodName: rule(NoLimit, Admin, Viewer, Crawler, Service),

	// Every provisioner: only the suite's own services. The orchestrator
	// reaches provisioners through NATS commands; health calls
	// CheckBackend here.
	provisionerv1.ProvisionerService_CreateInstance_FullMethodName:    rule(NoLimit, Service),
	provisionerv1.ProvisionerService_GetInstance_FullMethodName:       rule(NoLimit, Service),
	provisionerv1.ProvisionerService_DeleteInstance_FullMethodName:    rule(NoLimit, Service),
	provisionerv1.ProvisionerService_ListInstances_FullMethodName:     rule(NoLimit, Service),
	provisionerv1.ProvisionerService_CheckBackend_FullMethodName:      rule(NoLimit, Service),
	provisionerv1.ProvisionerService_UpdateCredentials_FullMethodName: rule(NoLimit, Service),
}

// RuleFor returns the rule of a full method name, and whether the table
// has one.
func RuleFor(fullMethod string) (Rule, bool) {
	r, ok := table[fullMethod]
	return r, ok
}

// Methods lists every method in the table, sorted.
func Methods() []string {
	out := make([]string, 0, len(table))
	for m := range table {
		out = append(out, m)
	}
	slices.Sort(out)
	return out
}

// Allowed reports whether a caller with roles may call fullMethod.
func Allowed(fullMethod string, roles []Role) bool {
	r, ok := table[fullMethod]
	if !ok {
		return false
	}
	for _, have := range roles {
		if slices.Contains(r.Roles, have) {
			return true
		}
	}
	return false
}
