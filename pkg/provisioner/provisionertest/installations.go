package provisionertest

import (
	"testing"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
)

// list is List for installation, by providerID.
func (s *Suite) list(t *testing.T, installation string) map[string]*provisionerv1.Instance {
	t.Helper()
	resp, err := s.main.Client.ListInstances(ctxFor(t), &provisionerv1.ListInstancesRequest{Provider: ProviderName, Installation: installation})
	if err != nil {
		t.Fatalf("List for installation %s: %v", installation, err)
	}
	out := map[string]*provisionerv1.Instance{}
	for _, in := range resp.GetInstances() {
		if got := in.GetInstallation(); got != "" && got != installation {
			t.Errorf("List for installation %s answered %s of installation %s", installation, in.GetProviderId(), got)
		}
		out[in.GetProviderId()] = in
	}
	return out
}

// installations: two installations on one backend. Each List answers its
// own instances only, marked with it; the other installation's instance
// is to Create, Get and Delete what a foreign one is (refused Permanent,
// NotFound, left alone), and stays as it was.
func installations(t *testing.T, s *Suite) {
	uidA, uidB := s.uid(t), s.uid(t)
	a := s.createFor(t, uidA, Installation)
	b := s.createFor(t, uidB, OtherInstallation)
	beforeB := s.observe(t, uidB)

	for _, c := range []struct {
		installation string
		own, other   *provisionerv1.Instance
	}{{Installation, a, b}, {OtherInstallation, b, a}} {
		list := s.list(t, c.installation)
		if in, ok := list[c.own.GetProviderId()]; !ok {
			t.Errorf("List for installation %s lacks its instance %s", c.installation, c.own.GetProviderId())
		} else if in.GetInstallation() != c.installation {
			t.Errorf("List for installation %s answered its instance %s marked with installation %q", c.installation, in.GetProviderId(), in.GetInstallation())
		}
		if _, ok := list[c.other.GetProviderId()]; ok {
			t.Errorf("List for installation %s answered the other installation's %s", c.installation, c.other.GetProviderId())
		}
	}

	ctx := ctxFor(t)
	req := s.request(uidB)
	_, err := s.main.Client.CreateInstance(ctx, req)
	assertClass(t, "Create over the other installation's instance of the same proxy UID", err, errclass.Permanent)
	_, err = s.main.Client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: b.GetProviderId(), ProxyUid: uidB})
	assertClass(t, "Get of the other installation's instance", err, errclass.NotFound)
	del, err := s.main.Client.DeleteInstance(ctx, &provisionerv1.DeleteInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: b.GetProviderId(), ProxyUid: uidB})
	if err != nil || del.GetDeleted() {
		t.Errorf("Delete of the other installation's instance = %v, %v; want deleted false and no error", del, err)
	}
	if got := s.observe(t, uidB); !got.equal(beforeB) {
		t.Errorf("the other installation's instance was touched: the backend holds %+v, held %+v", got, beforeB)
	}
	get, err := s.main.Client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: ProviderName, Installation: OtherInstallation, ProviderId: b.GetProviderId(), ProxyUid: uidB})
	if err != nil {
		t.Fatalf("Get by its own installation after the other's requests: %v", err)
	}
	sameInstance(t, "Get by its own installation", b, get.GetInstance())
}

// legacyClaimed: an instance marked before marks named an installation is
// listed to every installation with none, and its own proxy's Get or
// Create claims it: from then on it is that installation's alone.
func legacyClaimed(t *testing.T, s *Suite) {
	if s.tr.Unclaim == nil {
		t.Skip("the Tester declares no Unclaim")
	}
	ctx := ctxFor(t)
	for _, by := range []string{"Get", "Create"} {
		t.Run(by, func(t *testing.T) {
			uid := s.uid(t)
			in := s.create(t, uid)
			s.tr.Unclaim(t, uid)
			for _, inst := range []string{Installation, OtherInstallation} {
				l, ok := s.list(t, inst)[in.GetProviderId()]
				if !ok || l.GetInstallation() != "" {
					t.Fatalf("List for installation %s answered the unclaimed instance as %v; want it, with no installation", inst, l)
				}
			}
			var got *provisionerv1.Instance
			if by == "Get" {
				resp, err := s.main.Client.GetInstance(ctx, &provisionerv1.GetInstanceRequest{Provider: ProviderName, Installation: Installation, ProviderId: in.GetProviderId(), ProxyUid: uid})
				if err != nil {
					t.Fatalf("Get of the proxy's unclaimed instance: %v", err)
				}
				got = resp.GetInstance()
			} else {
				got = s.create(t, uid)
				if live := s.observe(t, uid); len(live.Instances) != 1 {
					t.Errorf("after Create claimed the instance the backend holds %v, want one instance", live.Instances)
				}
			}
			sameInstance(t, by+" of the unclaimed instance", in, got)
			if l, ok := s.list(t, Installation)[in.GetProviderId()]; !ok || l.GetInstallation() != Installation {
				t.Errorf("after %s, List answered the instance as %v; want it, marked with installation %s", by, l, Installation)
			}
			if _, ok := s.list(t, OtherInstallation)[in.GetProviderId()]; ok {
				t.Errorf("after %s claimed it, the other installation's List still answers %s", by, in.GetProviderId())
			}
		})
	}
}
