package local

import (
	"context"
	"os"
	"path/filepath"

	provisionerv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/provisioner/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/errclass"
	"github.com/egress-proxies/egress-proxies/pkg/squid"
)

// htpasswdFile is the instance's credentials file in its directory: one
// line "user:bcrypt-hash", which basic_ncsa_auth checks through crypt(3).
// It never holds the password itself.
const htpasswdFile = "htpasswd"

// setCredentials makes s's instance demand c (nil: nobody's), writing its
// htpasswd file and recording it in s. Only squid instances can demand
// credentials: for any other, credentials are a Permanent error, so that
// no instance runs open when it should not. Errors never show c.
func (b *Backend) setCredentials(s *state, c *proxyv1.ProxyCredentials) error {
	path := filepath.Join(b.instDir(s.UID), htpasswdFile)
	if c == nil {
		if !s.Auth {
			return nil
		}
		s.Auth = false
		_ = os.Remove(path)
		return b.write(s)
	}
	if s.Kind != "squid" || b.ncsaAuth == "" {
		return errclass.New(errclass.Permanent,
			"the proxy has credentials, and this local provider's %s proxy cannot demand them (install squid, which brings basic_ncsa_auth)", s.Kind)
	}
	file, err := squid.HTPasswd(c.GetUsername(), c.GetPassword())
	if err != nil {
		return errclass.New(errclass.Permanent, "%s", err.Error())
	}
	tmp := path + ".new"
	// squid runs its helper under its own user: readable by all; it holds
	// only a bcrypt hash.
	if err := os.WriteFile(tmp, file, 0o644); err != nil {
		return errclass.Wrap(errclass.Transient, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return errclass.Wrap(errclass.Transient, err)
	}
	if s.Auth {
		return nil
	}
	s.Auth = true
	return b.write(s)
}

// UpdateCredentials implements provisioner.CredentialsUpdater: the
// instance's htpasswd file gets the new credentials, and its squid is
// restarted at the same address. A restart rather than a reconfigure,
// because squid keeps a verdict on a credential for a minute
// (credentialsttl) and a tunnel opened with the old ones lives on: after
// the restart nothing the old credentials opened is left.
func (b *Backend) UpdateCredentials(ctx context.Context, req *provisionerv1.UpdateCredentialsRequest) (*provisionerv1.Instance, error) {
	uid, err := uidFromProviderID(req.GetProviderId(), req.GetProxyUid())
	if err != nil {
		return nil, err
	}
	unlock, err := b.lock()
	if err != nil {
		return nil, err
	}
	s, err := b.read(uid)
	if err == nil && s.foreignInstallation(req.GetInstallation()) {
		err = errclass.New(errclass.NotFound, "instance %s is installation %s's", req.GetProviderId(), s.Installation)
	}
	if err == nil {
		err = b.setCredentials(s, req.GetCredentials())
	}
	unlock()
	if err != nil {
		return nil, err
	}
	if err := b.stop(ctx, s); err != nil {
		return nil, err
	}
	if err := b.ensureRunning(ctx, s); err != nil {
		return nil, err
	}
	b.log.Info("local instance's credentials changed; proxy restarted", "name", s.Name, "provider_id", providerID(uid))
	return b.instance(s, provisionerv1.InstanceState_INSTANCE_STATE_RUNNING), nil
}
