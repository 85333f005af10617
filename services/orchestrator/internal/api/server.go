// Package api serves ProxyService: validated CRUD on proxies, paginated
// listing, and Watch over the change log. Requests reach it checked against
// the contract's rules (pkg/validate, installed on every server by
// pkg/service); the handlers check what depends on the configuration or on
// several fields.
package api

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"log/slog"
	"maps"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	busv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/bus/v1"
	proxyv1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/proxy/v1"
	"github.com/egress-proxies/egress-proxies/pkg/auth"
	"github.com/egress-proxies/egress-proxies/pkg/providers"
	"github.com/egress-proxies/egress-proxies/pkg/telemetry"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/dispatch"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/lifecycle"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/spec"
	"github.com/egress-proxies/egress-proxies/services/orchestrator/internal/store"
)

// DefaultPageSize is the page size of a ListProxies that sets none; the
// contract caps page_size at 1000.
const DefaultPageSize = 100

// Server implements ProxyService.
type Server struct {
	proxyv1.UnimplementedProxyServiceServer
	Store *store.Store
	// Providers is the providers config in effect (asked at each use: it
	// is reloaded on change).
	Providers providers.Source
	// Changes fires after every committed write (from store.Listen).
	Changes *store.Signal
	// WatchPoll bounds how long a watcher waits without a notification.
	WatchPoll time.Duration
	// Log takes the WARNINGs about proxies without credentials; slog's
	// default when nil.
	Log *slog.Logger
	// FirstCommands, when set, decides each new proxy's first command in
	// the transaction that creates it and publishes it after the commit,
	// so a new proxy needs no claim; without it new proxies wait for one.
	FirstCommands FirstCommands

	initOnce sync.Once
	createQ  chan *pendingCreate
}

func (s *Server) configured(name string) bool {
	_, ok := s.Providers.Current().Get(name)
	return ok
}

func internal(err error) error {
	if errors.Is(err, context.Canceled) {
		return status.Error(codes.Canceled, "request cancelled")
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return status.Error(codes.DeadlineExceeded, "deadline exceeded")
	}
	if errors.Is(err, store.ErrNoKeyring) {
		return status.Error(codes.FailedPrecondition, "this orchestrator keeps no secrets (cloud-init, proxy credentials): it runs without --cloud-init-key-file; create MANAGED proxies with spec.credentials CREDENTIALS_POLICY_NONE or configure a keyring")
	}
	return status.Error(codes.Unavailable, "the store is unavailable; retry")
}

// CreateProxy implements ProxyService. Concurrent creates are written in
// shared transactions by Run (one commit for many), which is what lets
// creation outpace the database's commit rate.
func (s *Server) CreateProxy(ctx context.Context, req *proxyv1.CreateProxyRequest) (*proxyv1.CreateProxyResponse, error) {
	var v spec.Violations
	spec.ValidateLabels(&v, "labels", req.GetLabels())
	spec.Validate(&v, req.GetSpec(), s.configured, s.Providers.Current().Names())
	if err := v.Err(); err != nil {
		return nil, err
	}
	c := &pendingCreate{req: req, want: spec.Normalize(req.GetSpec()), traceParent: telemetry.TraceParent(ctx), done: make(chan struct{})}
	select {
	case s.creates() <- c:
	case <-ctx.Done():
		return nil, internal(ctx.Err())
	}
	select {
	case <-c.done:
	case <-ctx.Done():
		// The create may still commit; a retry finds it (idempotent).
		return nil, internal(ctx.Err())
	}
	if c.err != nil {
		if _, ok := status.FromError(c.err); ok {
			return nil, c.err
		}
		return nil, internal(c.err)
	}
	return &proxyv1.CreateProxyResponse{Proxy: c.out, Created: c.created}, nil
}

// FirstCommands decides and publishes new proxies' first commands
// (dispatch.Dispatcher).
type FirstCommands interface {
	// DecideNew decides p, created by the calling transaction, and
	// returns the command to publish after the commit (nil for none).
	DecideNew(p *lifecycle.Proxy, now time.Time) *busv1.Command
	// PublishNew publishes the commands of a committed transaction that
	// started at start.
	PublishNew(ctx context.Context, start time.Time, cmds []dispatch.NewCommand)
}

type pendingCreate struct {
	req  *proxyv1.CreateProxyRequest
	want *proxyv1.ProxySpec
	// traceParent is the call's trace, stored with a new proxy.
	traceParent string
	done        chan struct{}
	out         *proxyv1.Proxy
	created     bool
	err         error
}

// MaxCreateBatch is the most creates one transaction takes.
const MaxCreateBatch = 128

func (s *Server) creates() chan *pendingCreate {
	s.initOnce.Do(func() { s.createQ = make(chan *pendingCreate, MaxCreateBatch) })
	return s.createQ
}

// Run writes queued creates until ctx ends: it takes whatever queued up
// while the previous batch committed (at most MaxCreateBatch) and writes it
// in one transaction. The batch's first commands are published while the
// next batch is written.
func (s *Server) Run(ctx context.Context) error {
	q := s.creates()
	published := make(chan firstCommands, 1)
	var publishing sync.WaitGroup
	publishing.Go(func() {
		for f := range published {
			s.FirstCommands.PublishNew(ctx, f.start, f.cmds)
		}
	})
	defer publishing.Wait()
	defer close(published)
	for {
		var batch []*pendingCreate
		select {
		case <-ctx.Done():
			return nil
		case c := <-q:
			batch = append(batch, c)
		}
	drain:
		for len(batch) < MaxCreateBatch {
			select {
			case c := <-q:
				batch = append(batch, c)
			default:
				break drain
			}
		}
		if f := s.writeCreates(ctx, batch); len(f.cmds) > 0 {
			published <- f
		}
	}
}

// firstCommands are the first commands of a committed batch of creates.
type firstCommands struct {
	start time.Time
	cmds  []dispatch.NewCommand
}

func (s *Server) writeCreates(ctx context.Context, batch []*pendingCreate) firstCommands {
	var rows []*lifecycle.Proxy
	var first firstCommands
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		rows = make([]*lifecycle.Proxy, len(batch))
		first = firstCommands{start: time.Now()}
		err = s.Store.Write(ctx, func(tx *store.Tx) error {
			first.cmds = first.cmds[:0]
			names := make([]string, len(batch))
			for i, c := range batch {
				names[i] = c.req.GetName()
			}
			// The batch's existing proxies, locked in one query: byName
			// then gains every proxy the batch creates.
			byName, err := tx.LockByNames(ctx, names)
			if err != nil {
				return err
			}
			for i, c := range batch {
				c.out, c.created, c.err = nil, false, nil
				name := c.req.GetName()
				existing := byName[name]
				switch {
				case existing == nil:
				case existing.Deleting():
					c.err = status.Errorf(codes.AlreadyExists, "proxy %q is being deleted; create it again once it is gone", name)
					continue
				case proto.Equal(existing.Spec, withoutEndpointCredentials(c.want)) && maps.Equal(existing.Labels, c.req.GetLabels()) && existing.SkipCleanup == c.req.GetSkipCleanup():
					rows[i] = existing
					continue
				default:
					c.err = status.Errorf(codes.AlreadyExists, "proxy %q already exists with a different spec or labels", name)
					continue
				}
				r := lifecycle.New(name, c.req.GetLabels(), c.want, c.req.GetSkipCleanup(), tx.Now())
				r.TraceParent = c.traceParent
				tx.Insert(r)
				s.warnOpen(r)
				byName[name] = r
				rows[i] = r
				c.created = true
				if s.FirstCommands != nil {
					// The proxy as decided is the change after its
					// creation: the caller and every watcher see it
					// created (PENDING), then decided, as when a claim
					// decided it.
					decided := *r
					if cmd := s.FirstCommands.DecideNew(&decided, tx.Now()); cmd != nil {
						tx.Update(&decided)
						first.cmds = append(first.cmds, dispatch.NewCommand{Command: cmd, TraceParent: decided.TraceParent})
					}
				}
			}
			return nil
		})
		if !errors.Is(err, store.ErrExists) {
			break // a concurrent create of a name in the batch won: write again and compare
		}
	}
	for i, c := range batch {
		switch {
		case err != nil:
			c.err, c.created = err, false
		case c.err == nil:
			c.out = rows[i].Proto(false)
		}
		close(c.done)
	}
	if err != nil {
		return firstCommands{}
	}
	return first
}

// withoutEndpointCredentials is want as a proxy stores it: its endpoint
// credentials are kept apart, sealed.
func withoutEndpointCredentials(want *proxyv1.ProxySpec) *proxyv1.ProxySpec {
	if want.GetEndpointCredentials() == nil {
		return want
	}
	bare := proto.Clone(want).(*proxyv1.ProxySpec)
	bare.EndpointCredentials = nil
	return bare
}

// fullView checks the view a read asks for: BASIC (the default) leaves
// cloud-init out; FULL returns it and needs the admin role.
func fullView(ctx context.Context, v *spec.Violations, view proxyv1.ProxyView) (bool, error) {
	switch view {
	case proxyv1.ProxyView_PROXY_VIEW_UNSPECIFIED, proxyv1.ProxyView_PROXY_VIEW_BASIC:
		return false, nil
	case proxyv1.ProxyView_PROXY_VIEW_FULL:
		if !auth.HasRole(ctx, auth.Admin) {
			return false, status.Errorf(codes.PermissionDenied, "view FULL returns spec.cloud_init and needs the role %s; ask for view BASIC", auth.Admin)
		}
		return true, nil
	}
	v.Add("view", "unknown view %d; want BASIC or FULL", view)
	return false, nil
}

// GetProxy implements ProxyService.
func (s *Server) GetProxy(ctx context.Context, req *proxyv1.GetProxyRequest) (*proxyv1.GetProxyResponse, error) {
	var v spec.Violations
	full, err := fullView(ctx, &v, req.GetView())
	if err != nil {
		return nil, err
	}
	if err := v.Err(); err != nil {
		return nil, err
	}
	r, err := s.Store.Get(ctx, req.GetName())
	if errors.Is(err, store.ErrNotFound) {
		return nil, status.Errorf(codes.NotFound, "proxy %q not found", req.GetName())
	}
	if err != nil {
		return nil, internal(err)
	}
	return &proxyv1.GetProxyResponse{Proxy: r.Proto(full)}, nil
}

// ListProxyChanges implements ProxyService: the retained changes of the
// proxy that has the name now, newest first, in the BASIC view (the change
// log never holds cloud-init).
func (s *Server) ListProxyChanges(ctx context.Context, req *proxyv1.ListProxyChangesRequest) (*proxyv1.ListProxyChangesResponse, error) {
	r, err := s.Store.Get(ctx, req.GetName())
	if errors.Is(err, store.ErrNotFound) {
		return nil, status.Errorf(codes.NotFound, "proxy %q not found", req.GetName())
	}
	if err != nil {
		return nil, internal(err)
	}
	limit := int(req.GetPageSize())
	if limit == 0 {
		limit = 100
	}
	changes, err := s.Store.ChangesOf(ctx, r.UID, req.GetBeforeRevision(), limit)
	if err != nil {
		return nil, internal(err)
	}
	resp := &proxyv1.ListProxyChangesResponse{Changes: make([]*proxyv1.WatchProxiesResponse, 0, len(changes))}
	for _, c := range changes {
		resp.Changes = append(resp.Changes, &proxyv1.WatchProxiesResponse{
			Revision: c.Revision, Type: c.Type, Proxy: c.Proxy, ChangeTime: timestamppb.New(c.Time),
		})
	}
	return resp, nil
}

// pageToken carries where a listing stopped and which filter it was for.
type pageToken struct {
	After  string `json:"a"`
	Filter string `json:"f"`
}

func filterKey(req *proxyv1.ListProxiesRequest) string {
	b, _ := json.Marshal([]any{req.GetProvider(), req.GetPhase(), req.GetLabels()})
	return string(b)
}

// ListProxies implements ProxyService.
func (s *Server) ListProxies(ctx context.Context, req *proxyv1.ListProxiesRequest) (*proxyv1.ListProxiesResponse, error) {
	var v spec.Violations
	spec.ValidateLabels(&v, "labels", req.GetLabels())
	full, err := fullView(ctx, &v, req.GetView())
	if err != nil {
		return nil, err
	}
	var after string
	if req.GetPageToken() != "" {
		var tok pageToken
		raw, err := base64.RawURLEncoding.DecodeString(req.GetPageToken())
		if err != nil || json.Unmarshal(raw, &tok) != nil {
			v.Add("page_token", "not a token from a previous ListProxies")
		} else if tok.Filter != filterKey(req) {
			v.Add("page_token", "was issued for other filters; keep provider, phase and labels the same across pages")
		}
		after = tok.After
	}
	if err := v.Err(); err != nil {
		return nil, err
	}
	size := int(req.GetPageSize())
	if size == 0 {
		size = DefaultPageSize
	}
	rows, rev, err := s.Store.List(ctx, store.Filter{
		Provider: req.GetProvider(), Phase: req.GetPhase(), Labels: req.GetLabels(), After: after, Limit: size + 1,
	})
	if err != nil {
		return nil, internal(err)
	}
	resp := &proxyv1.ListProxiesResponse{Revision: rev}
	if len(rows) > size {
		rows = rows[:size]
		b, _ := json.Marshal(pageToken{After: rows[size-1].Name, Filter: filterKey(req)})
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString(b)
	}
	for _, r := range rows {
		resp.Proxies = append(resp.Proxies, r.Proto(full))
	}
	return resp, nil
}

// UpdateProxy implements ProxyService.
func (s *Server) UpdateProxy(ctx context.Context, req *proxyv1.UpdateProxyRequest) (*proxyv1.UpdateProxyResponse, error) {
	var v spec.Violations
	spec.ValidateLabels(&v, "labels", req.GetLabels())
	spec.Validate(&v, req.GetSpec(), s.configured, s.Providers.Current().Names())
	if req.GetGeneration() == 0 && req.GetEtag() == "" {
		v.Add("generation", "one of generation or etag is required")
	}
	if err := v.Err(); err != nil {
		return nil, err
	}
	want := spec.Normalize(req.GetSpec())
	var row *lifecycle.Proxy
	err := s.Store.Write(ctx, func(tx *store.Tx) error {
		r, err := tx.LockByName(ctx, req.GetName())
		if errors.Is(err, store.ErrNotFound) {
			return status.Errorf(codes.NotFound, "proxy %q not found", req.GetName())
		}
		if err != nil {
			return err
		}
		if req.GetGeneration() != 0 && req.GetGeneration() != r.Generation {
			return status.Errorf(codes.FailedPrecondition, "proxy %q changed: its generation is %d, not %d; read it again", r.Name, r.Generation, req.GetGeneration())
		}
		if req.GetEtag() != "" && req.GetEtag() != lifecycle.Etag(r.Revision) {
			return status.Errorf(codes.FailedPrecondition, "proxy %q changed: its etag is %s, not %s; read it again", r.Name, lifecycle.Etag(r.Revision), req.GetEtag())
		}
		if r.Deleting() {
			return status.Errorf(codes.FailedPrecondition, "proxy %q is being deleted", r.Name)
		}
		if want.GetMode() != r.Spec.GetMode() {
			return spec.Violations{{Field: "spec.mode", Description: "is immutable; delete the proxy and create it again"}}.Err()
		}
		row = r
		if proto.Equal(r.Spec, want) && maps.Equal(r.Labels, req.GetLabels()) && r.SkipCleanup == req.GetSkipCleanup() {
			return nil
		}
		lifecycle.Update(r, want, req.GetLabels(), req.GetSkipCleanup(), telemetry.TraceParent(ctx), tx.Now())
		tx.Update(r)
		return nil
	})
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		return nil, internal(err)
	}
	// The commit stamped the row with its new revision.
	return &proxyv1.UpdateProxyResponse{Proxy: row.Proto(false)}, nil
}

// DeleteProxy implements ProxyService.
func (s *Server) DeleteProxy(ctx context.Context, req *proxyv1.DeleteProxyRequest) (*proxyv1.DeleteProxyResponse, error) {
	var row *lifecycle.Proxy
	err := s.Store.Write(ctx, func(tx *store.Tx) error {
		r, err := tx.LockByName(ctx, req.GetName())
		if errors.Is(err, store.ErrNotFound) {
			return status.Errorf(codes.NotFound, "proxy %q not found", req.GetName())
		}
		if err != nil {
			return err
		}
		row = r
		if lifecycle.RequestDelete(r, req.GetSkipCleanup(), telemetry.TraceParent(ctx), tx.Now()) {
			tx.Delete(r)
		} else {
			tx.Update(r)
		}
		return nil
	})
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return nil, err
		}
		return nil, internal(err)
	}
	return &proxyv1.DeleteProxyResponse{Proxy: row.Proto(false)}, nil
}

// WatchRevisionHeader is the response header a watch sends once it is in
// place, holding the revision it watches from.
const WatchRevisionHeader = "x-egress-watch-revision"

// WatchProxies implements ProxyService.
func (s *Server) WatchProxies(req *proxyv1.WatchProxiesRequest, stream proxyv1.ProxyService_WatchProxiesServer) error {
	ctx := stream.Context()
	var v spec.Violations
	full, err := fullView(ctx, &v, req.GetView())
	if err != nil {
		return err
	}
	if err := v.Err(); err != nil {
		return err
	}
	since := req.GetSinceRevision()
	if since == 0 {
		rev, err := s.Store.Revision(ctx)
		if err != nil {
			return internal(err)
		}
		since = rev
	}
	// The header tells the client the watch is in place: every change
	// after it is delivered, so a client may act (and a person may
	// create) once it has arrived.
	if err := stream.SendHeader(metadata.Pairs(WatchRevisionHeader, strconv.FormatInt(since, 10))); err != nil {
		return err
	}
	compacted := func(since int64) error {
		return status.Errorf(codes.OutOfRange, "revision %d is older than the retained change log; list the proxies again and watch from the revision the list returns", since)
	}
	return follow(ctx, s, since, compacted, s.Store.Changes, func(c store.Change) (int64, error) {
		if req.GetProvider() != "" && c.Proxy.GetSpec().GetProvider() != req.GetProvider() {
			return c.Revision, nil
		}
		snapshot := c.Proxy
		if full && c.Type != proxyv1.ChangeType_CHANGE_TYPE_DELETED {
			var err error
			if snapshot, err = s.withCloudInit(ctx, snapshot); err != nil {
				return 0, internal(err)
			}
		}
		return c.Revision, stream.Send(&proxyv1.WatchProxiesResponse{
			Revision: c.Revision, Type: c.Type, Proxy: snapshot, ChangeTime: timestamppb.New(c.Time),
		})
	})
}

// follow streams a change log from since until ctx ends: each page read by
// fetch goes to handle (which sends it, or skips it, and returns its
// revision), then the next page at once or after the next write (or
// WatchPoll). compacted is the answer when since was pruned.
func follow[C any](ctx context.Context, s *Server, since int64, compacted func(since int64) error,
	fetch func(context.Context, int64, int) ([]C, error), handle func(C) (int64, error)) error {
	poll := s.WatchPoll
	if poll <= 0 {
		poll = time.Second
	}
	const page = 500
	for {
		wake := s.Changes.Wait()
		changes, err := fetch(ctx, since, page)
		if errors.Is(err, store.ErrCompacted) {
			return compacted(since)
		}
		if err != nil {
			return internal(err)
		}
		for _, c := range changes {
			rev, err := handle(c)
			if err != nil {
				return err
			}
			since = rev
		}
		if len(changes) == page {
			continue
		}
		select {
		case <-ctx.Done():
			return nil
		case <-wake:
		case <-time.After(poll):
		}
	}
}

// withCloudInit returns the change snapshot p with the cloud-init of the
// proxy's spec when p is of the proxy's current generation: the change log
// never holds cloud-init, and an older generation's is gone.
func (s *Server) withCloudInit(ctx context.Context, p *proxyv1.Proxy) (*proxyv1.Proxy, error) {
	r, err := s.Store.Get(ctx, p.GetName())
	if errors.Is(err, store.ErrNotFound) {
		return p, nil
	}
	if err != nil {
		return nil, err
	}
	if r.UID != p.GetUid() || r.Generation != p.GetGeneration() || r.Spec.GetCloudInit() == "" {
		return p, nil
	}
	out := proto.Clone(p).(*proxyv1.Proxy)
	out.Spec.CloudInit = r.Spec.GetCloudInit()
	return out, nil
}

// ListProviders implements ProxyService.
func (s *Server) ListProviders(context.Context, *proxyv1.ListProvidersRequest) (*proxyv1.ListProvidersResponse, error) {
	resp := &proxyv1.ListProvidersResponse{}
	for _, p := range s.Providers.Current().Providers {
		resp.Providers = append(resp.Providers, &proxyv1.Provider{Name: p.Name, Type: p.Type})
	}
	return resp, nil
}
