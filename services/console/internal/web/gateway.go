package web

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// GatewayMetrics reads the gateway's request and byte counters from its
// Prometheus endpoint, and turns two readings into rates. The gateway
// owns the figures; the console only divides.
type GatewayMetrics struct {
	// URL is the gateway's metrics endpoint (http://gateway:8181/metrics).
	URL string
	// Requests and Bytes name the counters summed over all their series.
	Requests, Bytes string
	Client          *http.Client

	mu    sync.Mutex
	last  *gatewayReading
	rates *GatewayRates
}

type gatewayReading struct {
	at              time.Time
	requests, bytes float64
}

// GatewayRates is what the overview shows of the gateway.
type GatewayRates struct {
	RequestsPerSecond float64
	BytesPerSecond    float64
	Requests, Bytes   float64
	// Warming is true until two readings exist.
	Warming bool
	Error   string
}

// Rates reads the counters now and returns the rates since the previous
// reading (of any page: every open overview shares the readings).
func (g *GatewayMetrics) Rates(ctx context.Context) *GatewayRates {
	cur, err := g.read(ctx)
	if err != nil {
		return &GatewayRates{Error: err.Error()}
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	prev := g.last
	if prev != nil && cur.at.Sub(prev.at) < time.Second && g.rates != nil {
		// Another page read a moment ago: its rates stand.
		return g.rates
	}
	out := &GatewayRates{Requests: cur.requests, Bytes: cur.bytes, Warming: prev == nil}
	// A counter that went down restarted: no rate this time.
	if prev != nil {
		if dt := cur.at.Sub(prev.at).Seconds(); dt > 0 && cur.requests >= prev.requests && cur.bytes >= prev.bytes {
			out.RequestsPerSecond = (cur.requests - prev.requests) / dt
			out.BytesPerSecond = (cur.bytes - prev.bytes) / dt
		}
	}
	g.last, g.rates = cur, out
	return out
}

func (g *GatewayMetrics) read(ctx context.Context) (*gatewayReading, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, g.URL, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
	c := g.Client
	if c == nil {
		c = http.DefaultClient
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, fmt.Errorf("the gateway's metrics cannot be read: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("the gateway's metrics answered %s", resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(http.MaxBytesReader(nil, resp.Body, 16<<20))
	if err != nil {
		return nil, fmt.Errorf("the gateway's metrics do not parse: %w", err)
	}
	r := &gatewayReading{at: time.Now()}
	var found bool
	if r.requests, found = sum(families[g.Requests]); !found {
		return nil, fmt.Errorf("the gateway exports no %s", g.Requests)
	}
	if r.bytes, found = sum(families[g.Bytes]); !found {
		return nil, fmt.Errorf("the gateway exports no %s", g.Bytes)
	}
	return r, nil
}

func sum(f *dto.MetricFamily) (float64, bool) {
	if f == nil {
		return 0, false
	}
	var total float64
	for _, m := range f.GetMetric() {
		total += m.GetCounter().GetValue()
	}
	return total, true
}

func fmtRate(v float64, unit string) string {
	switch {
	case unit == "B" && v >= 1<<30:
		return fmt.Sprintf("%.1f GiB/s", v/(1<<30))
	case unit == "B" && v >= 1<<20:
		return fmt.Sprintf("%.1f MiB/s", v/(1<<20))
	case unit == "B" && v >= 1<<10:
		return fmt.Sprintf("%.1f KiB/s", v/(1<<10))
	case unit == "B":
		return fmt.Sprintf("%.0f B/s", v)
	}
	return fmt.Sprintf("%.1f/s", v)
}
