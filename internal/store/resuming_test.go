package store

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// A bucket held for a resume grants nothing before the instant, to a take
// alone or in a batch, whatever wait it accepts, and takes nothing; at
// the instant it grants as before. Of two instants, the later stands, and
// one already past holds nothing.
func TestResumingHoldsEveryTake(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	ctx := context.Background()
	b := New("quota:", "resuming", []Limit{{Rate: 10, Burst: 5}, {Rate: 100, Burst: 50}})
	at := now.Load()/1000 + 500_000 // µs: half a second from now
	if err := s.Resuming(ctx, b, at); err != nil {
		t.Fatal(err)
	}
	if err := s.Resuming(ctx, b, at-200_000); err != nil { // earlier: the later stands
		t.Fatal(err)
	}
	if err := s.Resuming(ctx, b, now.Load()/1000-1); err != nil { // past: holds nothing
		t.Fatal(err)
	}
	g, err := s.takeOne(ctx, b, Tokens(1), time.Hour)
	if err != nil || g.Outcome != Resuming {
		t.Fatalf("a take before the instant: %+v, %v; want held for the resume", g, err)
	}
	qs := []*queuedTake{{ctx: ctx, n: Tokens(1), maxWait: time.Hour}, {ctx: ctx, n: Tokens(2), maxWait: 0}}
	if err := s.takeAll(ctx, b, qs); err != nil {
		t.Fatal(err)
	}
	for i, q := range qs {
		if q.g.Outcome != Resuming {
			t.Errorf("batched take %d before the instant: %+v, want held for the resume", i+1, q.g)
		}
	}
	if n, _ := rdb.Exists(ctx, b.Keys[0], b.Keys[1]).Result(); n != 0 {
		t.Errorf("%d layer keys after the held takes, want none: they took nothing", n)
	}
	now.Add(int64(300 * time.Millisecond)) // past the earlier instant, before the later
	if g, _ := s.takeOne(ctx, b, Tokens(1), time.Hour); g.Outcome != Resuming {
		t.Errorf("a take between the instants: %+v, want held: the later stands", g)
	}
	now.Add(int64(200 * time.Millisecond))
	g, err = s.takeOne(ctx, b, Tokens(5), 0)
	if err != nil || !g.Granted() {
		t.Errorf("a take at the instant: %+v, %v; want the whole burst granted at once", g, err)
	}
	if ttl, _ := rdb.PTTL(ctx, b.Call[len(b.Call)-1]).Result(); ttl <= 0 {
		t.Errorf("the control record's TTL is %v, want one: a held bucket leaves nothing behind", ttl)
	}
}
