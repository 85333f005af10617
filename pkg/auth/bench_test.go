package auth

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/metadata"

	leasev1 "github.com/egress-proxies/egress-proxies/pkg/api/egress/lease/v1"
)

// What every authenticated call pays: the token's hash and lookup, the
// role check and the rate-limit bucket (here an AcquireLease, limited).
func BenchmarkAuthorize(b *testing.B) {
	path := filepath.Join(b.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("fleet tok-crawler-0123456789abcdef crawler\n"), 0o600); err != nil {
		b.Fatal(err)
	}
	a, err := New(Config{TokenFile: path}, quiet())
	if err != nil {
		b.Fatal(err)
	}
	if err := a.SetLimits(Limits{Lease: RateLimit{Rate: 1e9, Burst: 1 << 30}}); err != nil {
		b.Fatal(err)
	}
	ctx := metadata.NewIncomingContext(context.Background(), metadata.Pairs("authorization", "Bearer tok-crawler-0123456789abcdef"))
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, err := a.Authorize(ctx, leasev1.LeaseService_AcquireLease_FullMethodName); err != nil {
				b.Fatal(err)
			}
		}
	})
}
