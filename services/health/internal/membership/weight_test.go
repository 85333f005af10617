package membership

import (
	"fmt"
	"hash/fnv"
	"testing"
)

// The hand-written weight is FNV-1a over member, a zero byte and UID,
// mixed: the owner of every proxy stays what it was.
func TestWeight_isFNV1a(t *testing.T) {
	t.Parallel()
	for i := range 1000 {
		id, uid := fmt.Sprintf("health-%d", i%13), fmt.Sprintf("3f1c2a9e-%04d-4d1e-9c7a-%012d", i%7, i)
		h := fnv.New64a()
		_, _ = h.Write([]byte(id))
		_, _ = h.Write([]byte{0})
		_, _ = h.Write([]byte(uid))
		if _, got := NewRing([]string{id}).Owner(uid); got != mix(h.Sum64()) {
			want := mix(h.Sum64())
			t.Fatalf("weight(%q, %q) = %x, want %x", id, uid, got, want)
		}
	}
}

func BenchmarkOwner(b *testing.B) {
	members := make([]string, 10)
	for i := range members {
		members[i] = fmt.Sprintf("health-%d-%d", i, 4000+i)
	}
	uids := make([]string, 1000)
	for i := range uids {
		uids[i] = fmt.Sprintf("3f1c2a9e-%04d-4d1e-9c7a-%012d", i%7, i)
	}
	r := NewRing(members)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		_, _ = r.Owner(uids[i%len(uids)])
		i++
	}
}
