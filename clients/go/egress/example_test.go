package egress_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/egress-proxies/egress-proxies/clients/go/egress"
)

// Connecting with a crawler token over TLS: the service's CA and the name
// in its certificate. Without CAFile the system roots verify it.
func ExampleNew() {
	c, err := egress.New("lease.egress.svc:8110", egress.Options{
		Token:      os.Getenv("EGRESS_TOKEN"),
		CAFile:     "/etc/egress/ca.pem",
		ServerName: "lease.egress.svc",
	})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
}

// One lease used by hand: acquire for a target (waiting while every proxy
// is busy or cooling down, up to the context's deadline), fetch through
// it, report how the target answered, release on every exit path. The
// lease renews itself meanwhile.
func ExampleClient_Acquire() {
	c, err := egress.New("localhost:8110", egress.Options{Token: os.Getenv("EGRESS_TOKEN"), Insecure: true})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	l, err := c.Acquire(ctx, "shop.example.com", egress.Selector{Labels: map[string]string{"pool": "eu"}}, 2*time.Minute)
	if err != nil {
		log.Fatal(err) // the context ended before a proxy was free
	}
	defer l.Release()

	client := &http.Client{Transport: l.Transport(), Timeout: 30 * time.Second}
	resp, err := client.Get("https://shop.example.com/catalog")
	if err != nil {
		// The proxy failed, not the target: a short cooldown for every
		// target.
		_, _ = l.Report(ctx, egress.Error)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusForbidden {
		// The target refused this proxy: a cooldown for this target only.
		_, _ = l.Report(ctx, egress.Blocked)
		return
	}
	select {
	case <-l.Done():
		log.Printf("lost the proxy mid-crawl: %v", l.Err())
	default:
	}
}

// The RoundTripper does the lease work per target host: a crawler just
// uses an http.Client. A 403, a 429 or a captcha page is reported as a ban
// and the request goes out again through another proxy.
func ExampleRoundTripper() {
	c, err := egress.New("localhost:8110", egress.Options{Token: os.Getenv("EGRESS_TOKEN"), Insecure: true})
	if err != nil {
		log.Fatal(err)
	}
	defer c.Close()
	rt := &egress.RoundTripper{Client: c, TTL: 2 * time.Minute}
	defer rt.Close()

	client := &http.Client{Transport: rt, Timeout: 2 * time.Minute}
	for _, page := range []string{"https://shop.example.com/a", "https://news.example.org/b"} {
		resp, err := client.Get(page)
		if err != nil {
			log.Print(err)
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}

// A site's own sign of a ban added to the default rules: this one answers
// 200 with an "Access denied" page. It keeps the proxy away from the site
// for six hours.
func ExampleClassifierFunc() {
	classifier := egress.ClassifierFunc(func(req *http.Request, resp *http.Response, err error) egress.Verdict {
		if err == nil && resp.Header.Get("X-Denied") == "1" {
			return egress.Verdict{Outcome: egress.Banned, Cooldown: 6 * time.Hour}
		}
		return egress.DefaultClassifier.Classify(req, resp, err)
	})

	answer := func(code int, header, body string) *http.Response {
		r := &http.Response{StatusCode: code, Header: http.Header{"Content-Type": {"text/html"}}, Body: io.NopCloser(strings.NewReader(body))}
		if header != "" {
			r.Header.Set("X-Denied", header)
		}
		return r
	}
	for _, tc := range []struct {
		name string
		resp *http.Response
		err  error
	}{
		{"catalog page", answer(200, "", "<h1>Catalog</h1>"), nil},
		{"access denied page", answer(200, "1", "<h1>Access denied</h1>"), nil},
		{"403", answer(403, "", "Forbidden"), nil},
		{"429", answer(429, "", "Too many requests"), nil},
		{"captcha page", answer(200, "", `<div class="g-recaptcha">`), nil},
		{"proxy refused", nil, errors.New("proxyconnect tcp: connection refused")},
	} {
		v := classifier.Classify(nil, tc.resp, tc.err)
		fmt.Printf("%-18s %-8s ban=%v cooldown=%v\n", tc.name, v.Outcome, v.Ban(), v.Cooldown)
	}
	// Output:
	// catalog page       success  ban=false cooldown=0s
	// access denied page banned   ban=true cooldown=6h0m0s
	// 403                blocked  ban=true cooldown=0s
	// 429                banned   ban=true cooldown=0s
	// captcha page       captcha  ban=true cooldown=0s
	// proxy refused      error    ban=true cooldown=0s
}
