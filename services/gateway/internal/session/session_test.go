package session

import (
	"testing"
	"time"
)

func TestRegistry(t *testing.T) {
	t.Parallel()
	r := NewRegistry()
	now := time.Unix(1000, 0)
	r.now = func() time.Time { return now }
	k := Key{ClientID: "c", ID: "s"}
	c := r.Use(k, "gw/c/s", "l1", "p1", "127.0.0.1:3128", "web", time.Minute, "")
	c.Add(10, 100)
	c.Done()
	c = r.Use(k, "gw/c/s", "l2", "p2", "127.0.0.2:3128", "web", time.Minute, "cooling_down")
	c.Add(1, 2)
	got, ok := r.Get(k)
	if !ok || got.LeaseID != "l2" || got.ProxyName != "p2" || got.Moves != 1 || got.LastMove != "cooling_down" ||
		got.Requests != 2 || got.BytesUp != 11 || got.BytesDown != 102 || got.ActiveConn != 1 {
		t.Fatalf("session = %+v", got)
	}
	if _, ok := r.ByLease("l2"); !ok {
		t.Fatal("ByLease")
	}
	r.Use(Key{ClientID: "d", ID: "s"}, "gw/d/s", "l3", "p3", "", "", time.Minute, "").Done()
	if l := r.List("c"); len(l) != 1 || l[0].Key != k {
		t.Fatalf("List(c) = %+v", l)
	}
	if l := r.List(""); len(l) != 2 || l[0].Key.ClientID != "c" || l[1].Key.ClientID != "d" {
		t.Fatalf("List() = %+v", l)
	}
	// Past its lifetime: a session with nothing open is forgotten, one
	// with a tunnel open is kept.
	now = now.Add(2 * time.Minute)
	if _, ok := r.Get(Key{ClientID: "d", ID: "s"}); ok {
		t.Fatal("an idle session outlived its lifetime")
	}
	if _, ok := r.Get(k); !ok {
		t.Fatal("a session with an open tunnel was forgotten")
	}
	c.Done()
	if _, ok := r.Get(k); ok {
		t.Fatal("the session outlived its lifetime once its tunnel closed")
	}
	r.Forget(k)
	var none *Counters
	none.Add(1, 1)
	none.Done()
}
