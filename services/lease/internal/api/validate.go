package api

import (
	"net/netip"
	"strings"

	"github.com/google/uuid"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
	"github.com/egress-proxies/egress-proxies/pkg/validate"
	"github.com/egress-proxies/egress-proxies/services/lease/internal/store"
)

// invalid is an INVALID_ARGUMENT naming the field, in the message and as a
// google.rpc.BadRequest field violation: the shape of every validation error
// of the suite.
func invalid(field, problem string) error {
	return validate.Field(field, "%s", problem)
}

// leaseID checks a lease id is a UUID and returns its canonical form.
func leaseID(id string) (string, error) {
	if id == "" {
		return "", invalid("lease_id", "is required")
	}
	u, err := uuid.Parse(id)
	if err != nil || len(id) != 36 {
		return "", invalid("lease_id", "must be a UUID such as 123e4567-e89b-12d3-a456-426614174000")
	}
	return u.String(), nil
}

// targetHost checks an optional target host: a DNS name or an IP address,
// without scheme, port or path. It returns the lowercase form without a
// trailing dot, so "Shop.Example.COM." and "shop.example.com" share
// cooldowns.
func targetHost(h string) (string, error) {
	if h == "" {
		return "", nil
	}
	const field = "target_host"
	if strings.Contains(h, "://") || strings.ContainsAny(h, "/?#@") {
		return "", invalid(field, "must be a host name or IP address, not a URL")
	}
	if a, err := netip.ParseAddr(strings.Trim(h, "[]")); err == nil {
		return a.String(), nil
	}
	host := strings.TrimSuffix(strings.ToLower(h), ".")
	if len(host) == 0 || len(host) > 253 {
		return "", invalid(field, "must be a host name of 1 to 253 characters")
	}
	for _, label := range strings.Split(host, ".") {
		if len(label) == 0 || len(label) > 63 {
			return "", invalid(field, "must be a host name whose dot-separated labels have 1 to 63 characters (no port)")
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			ok := c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_'
			if !ok {
				return "", invalid(field, "must be a host name of letters, digits, '-' and '.' (no port)")
			}
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return "", invalid(field, "host name labels must not start or end with '-'")
		}
	}
	return host, nil
}

// selector converts a selector; its lengths and characters are checked by
// the contract (lease.proto).
func selector(s *leasev1.ProxySelector) (store.Selector, error) {
	return store.Selector{
		Provider: s.GetProvider(),
		Region:   s.GetRegion(),
		Zone:     s.GetZone(),
		Labels:   s.GetLabels(),
		Pool:     s.GetPool(),
	}, nil
}
