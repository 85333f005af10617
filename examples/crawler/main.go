// Command crawler is a small crawler on the egress-proxies Go client: it
// fetches pages breadth-first from start URLs, following links on the same
// host, every request through a proxy leased for its host. Bans (403, 429,
// captcha pages) are reported and the request goes out again through
// another proxy; while no proxy is free it waits with backoff.
//
//	crawler --lease localhost:8110 --insecure https://shop.example.com/
//	crawler --lease localhost:8110 --insecure --demo-site
//
// --demo-site serves a small site on this machine and crawls it, answering
// 403 to every --demo-ban-every-th request, so a suite without internet
// access (make run) shows the whole cycle.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/html"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "crawler:", err)
		os.Exit(1)
	}
}

type config struct {
	leaseAddr   string
	token       string
	insecure    bool
	caFile      string
	serverName  string
	targetCA    string
	labels      labelFlag
	ttl         time.Duration
	maxPages    int
	concurrency int
	timeout     time.Duration
	demo        bool
	demoBan     int
	demoPages   int
}

func run(args []string, stdout, stderr io.Writer) error {
	var c config
	fs := flag.NewFlagSet("crawler", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&c.leaseAddr, "lease", "localhost:8110", "gRPC address of the lease service")
	fs.StringVar(&c.token, "token", os.Getenv("EGRESS_TOKEN"), "crawler token (default $EGRESS_TOKEN; empty for a suite with auth disabled)")
	fs.BoolVar(&c.insecure, "insecure", false, "talk to the lease service without TLS (a local suite)")
	fs.StringVar(&c.caFile, "ca-file", "", "PEM bundle verifying the lease service (default: the system roots)")
	fs.StringVar(&c.serverName, "server-name", "", "name expected in the lease service's certificate")
	fs.StringVar(&c.targetCA, "target-ca-file", "", "PEM bundle verifying the crawled sites (default: the system roots)")
	fs.Var(&c.labels, "label", "only proxies with this label, key=value (repeatable)")
	fs.DurationVar(&c.ttl, "ttl", 2*time.Minute, "lease TTL (renewed in the background)")
	fs.IntVar(&c.maxPages, "max-pages", 20, "stop after this many pages")
	fs.IntVar(&c.concurrency, "concurrency", 2, "pages fetched at once")
	fs.DurationVar(&c.timeout, "timeout", 5*time.Minute, "give up after this long")
	fs.BoolVar(&c.demo, "demo-site", false, "serve a demo site on this machine and crawl it")
	fs.IntVar(&c.demoBan, "demo-ban-every", 6, "the demo site answers 403 to every n-th request (0: never)")
	fs.IntVar(&c.demoPages, "demo-pages", 10, "pages of the demo site")
	if err := fs.Parse(args); err != nil {
		return err
	}
	switch {
	case c.maxPages < 1:
		return errors.New("--max-pages must be at least 1")
	case c.concurrency < 1:
		return errors.New("--concurrency must be at least 1")
	case c.demoBan < 0 || c.demoPages < 1:
		return errors.New("--demo-ban-every must be 0 or more and --demo-pages at least 1")
	}
	var start []*url.URL
	for _, a := range fs.Args() {
		u, err := url.Parse(a)
		if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
			return fmt.Errorf("start URL %q: want an absolute http or https URL", a)
		}
		start = append(start, u)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()

	if c.demo {
		site, err := serveDemo(c.demoPages, c.demoBan)
		if err != nil {
			return err
		}
		defer site.Close()
		fmt.Fprintf(stdout, "demo site on %s (403 to every %d-th request)\n", site.URL, c.demoBan)
		u, _ := url.Parse(site.URL + "/")
		start = append(start, u)
	}
	if len(start) == 0 {
		return errors.New("give start URLs or --demo-site")
	}

	base := http.DefaultTransport.(*http.Transport).Clone()
	if c.targetCA != "" {
		pem, err := os.ReadFile(c.targetCA)
		if err != nil {
			return fmt.Errorf("--target-ca-file: %w", err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return fmt.Errorf("--target-ca-file %s: no PEM certificate in it", c.targetCA)
		}
		base.TLSClientConfig = &tls.Config{RootCAs: pool}
	}
	client, err := egress.New(c.leaseAddr, egress.Options{
		Token: c.token, Insecure: c.insecure, CAFile: c.caFile, ServerName: c.serverName,
		BaseTransport: base,
		Logger:        slog.New(slog.NewTextHandler(stderr, nil)),
	})
	if err != nil {
		return err
	}
	defer client.Close()

	var mu sync.Mutex
	say := func(format string, a ...any) {
		mu.Lock()
		defer mu.Unlock()
		fmt.Fprintf(stdout, format+"\n", a...)
	}
	st := &stats{}
	var via sync.Map // URL → the proxy of its last attempt
	rt := &egress.RoundTripper{
		Client: client, TTL: c.ttl, Selector: egress.Selector{Labels: c.labels.m},
		OnVerdict: func(req *http.Request, l *egress.Lease, v egress.Verdict) {
			via.Store(req.URL.String(), l.ProxyName)
			if v.Ban() {
				st.bans.Add(1)
				say("ban     %s via %s: %s; reported, moving to another proxy", req.URL, l.ProxyName, v.Outcome)
			}
		},
	}
	// Every lease is released whichever way the crawl ends.
	defer rt.Close()

	crawl(ctx, &http.Client{Transport: rt, Timeout: time.Minute}, &via, st, start, c.maxPages, c.concurrency, say)
	say("crawled %d pages, %d failed, %d bans moved past", st.ok.Load(), st.failed.Load(), st.bans.Load())
	if st.ok.Load() == 0 {
		return errors.New("no page could be fetched")
	}
	return ctx.Err()
}

type stats struct{ ok, failed, bans atomic.Int64 }

// crawl fetches pages breadth-first from start, following links on the
// same hosts, until maxPages were fetched or no link is left.
func crawl(ctx context.Context, hc *http.Client, via *sync.Map, st *stats, start []*url.URL, maxPages, workers int, say func(string, ...any)) {
	hosts := map[string]bool{}
	for _, u := range start {
		hosts[u.Host] = true
	}
	var (
		mu      sync.Mutex
		seen    = map[string]bool{}
		queue   []*url.URL
		pending int
		wake    = sync.NewCond(&mu)
	)
	push := func(u *url.URL) {
		u.Fragment = ""
		if seen[u.String()] || len(seen) >= maxPages || !hosts[u.Host] {
			return
		}
		seen[u.String()] = true
		queue = append(queue, u)
		wake.Signal()
	}
	mu.Lock()
	for _, u := range start {
		push(u)
	}
	mu.Unlock()
	go func() {
		<-ctx.Done()
		mu.Lock()
		wake.Broadcast()
		mu.Unlock()
	}()

	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				mu.Lock()
				for len(queue) == 0 && pending > 0 && ctx.Err() == nil {
					wake.Wait()
				}
				if len(queue) == 0 || ctx.Err() != nil {
					wake.Broadcast()
					mu.Unlock()
					return
				}
				u := queue[0]
				queue = queue[1:]
				pending++
				mu.Unlock()

				links := fetch(ctx, hc, via, u, st, say)

				mu.Lock()
				pending--
				for _, l := range links {
					push(l)
				}
				wake.Broadcast()
				mu.Unlock()
			}
		})
	}
	wg.Wait()
}

func fetch(ctx context.Context, hc *http.Client, via *sync.Map, u *url.URL, st *stats, say func(string, ...any)) []*url.URL {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		st.failed.Add(1)
		return nil
	}
	resp, err := hc.Do(req)
	if err != nil {
		st.failed.Add(1)
		say("error   %s: %v", u, err)
		return nil
	}
	defer resp.Body.Close()
	proxy, _ := via.Load(u.String())
	if resp.StatusCode != http.StatusOK {
		st.failed.Add(1)
		say("%d     %s via %s", resp.StatusCode, u, proxy)
		return nil
	}
	st.ok.Add(1)
	say("200     %s via %s", u, proxy)
	return links(u, io.LimitReader(resp.Body, 4<<20))
}

// links are the absolute http(s) targets of the page's <a href>s.
func links(page *url.URL, body io.Reader) []*url.URL {
	var out []*url.URL
	z := html.NewTokenizer(body)
	for {
		switch z.Next() {
		case html.ErrorToken:
			return out
		case html.StartTagToken, html.SelfClosingTagToken:
			name, hasAttr := z.TagName()
			if string(name) != "a" {
				continue
			}
			for hasAttr {
				var k, v []byte
				k, v, hasAttr = z.TagAttr()
				if string(k) != "href" {
					continue
				}
				if ref, err := page.Parse(string(v)); err == nil && (ref.Scheme == "http" || ref.Scheme == "https") {
					out = append(out, ref)
				}
			}
		}
	}
}

// serveDemo serves pages /, /p/1 … /p/n-1 each linking to two others, on
// a loopback port. Every banEvery-th request gets 403 instead, whichever
// proxy it came through.
func serveDemo(n, banEvery int) (*demoSite, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	var count atomic.Int64
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if banEvery > 0 && count.Add(1)%int64(banEvery) == 0 {
			http.Error(w, "Forbidden: your address is banned", http.StatusForbidden)
			return
		}
		page := 0
		if _, err := fmt.Sscanf(r.URL.Path, "/p/%d", &page); err != nil && r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(w, "<html><body><h1>page %d</h1><a href=\"/p/%d\">next</a> <a href=\"/p/%d\">skip</a></body></html>",
			page, (page+1)%n, (page*3+2)%n)
	})}
	go func() { _ = srv.Serve(ln) }()
	return &demoSite{URL: "http://" + ln.Addr().String(), srv: srv}, nil
}

type demoSite struct {
	URL string
	srv *http.Server
}

func (d *demoSite) Close() { _ = d.srv.Close() }

// labelFlag collects repeated key=value flags.
type labelFlag struct{ m map[string]string }

func (l *labelFlag) String() string {
	var parts []string
	for k, v := range l.m {
		parts = append(parts, k+"="+v)
	}
	return strings.Join(parts, ",")
}

func (l *labelFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, "=")
	if !ok || k == "" {
		return fmt.Errorf("%q: want key=value", s)
	}
	if l.m == nil {
		l.m = map[string]string{}
	}
	l.m[k] = v
	return nil
}
