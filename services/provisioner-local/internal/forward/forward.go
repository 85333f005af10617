// Package forward is the built-in forward proxy the local backend runs when
// squid is not installed: HTTP CONNECT tunnels and plain-HTTP forwarding,
// from github.com/elazarl/goproxy.
package forward

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/elazarl/goproxy"
)

// Serve runs the proxy on addr until ctx ends.
func Serve(ctx context.Context, addr string, log *slog.Logger) error {
	p := goproxy.NewProxyHttpServer()
	p.Verbose = false
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: p, ReadHeaderTimeout: 30 * time.Second}
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
	}()
	log.Info("forward proxy listening", "address", lis.Addr().String())
	if err := srv.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}
