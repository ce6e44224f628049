package store

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// A take of a higher class queues behind the classes at and above its
// own and what is committed, and pushes the grants of the lower classes
// due later back by what it takes; the reply tells each class's pushes.
// Without a lower queue beyond the commit point it pushes nothing. Every
// class is held by a pause, which moves their tails with the queue.
func TestClassesJumpTheQueue(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }, Channel: "quota:control"})
	ctx := context.Background()
	b := New("quota:", "classes", []Limit{{Rate: 20, Burst: 2}}) // 50 ms a token, 100 ms full
	take := func(n Cost) Grant {
		t.Helper()
		g, err := s.takeOne(ctx, b, n, time.Hour)
		if err != nil || !g.Granted() {
			t.Fatalf("take %+v: %+v, %v", n, g, err)
		}
		return g
	}
	// A queue of class 0: 20 takes, the last due 0.9 s from now.
	var last Grant
	for range 20 {
		last = take(Tokens(1))
	}
	if last.Wait != 900*time.Millisecond {
		t.Fatalf("the 20th take of class 0 waits %v, want 900ms", last.Wait)
	}
	// Class 2 queues behind the commit point (100 ms), and takes one token.
	hi := take(Cost{N: 1, Class: 2})
	if hi.Wait != 150*time.Millisecond {
		t.Errorf("a take of class 2 waits %v, want 150ms: the commit point and its token", hi.Wait)
	}
	if len(hi.Pushed) != 2 || hi.Pushed[0] != 50_000 || hi.Pushed[1] != 0 {
		t.Errorf("its reply's pushes are %v, want [50000 0]: class 0 pushed by one token, class 1 not", hi.Pushed)
	}
	hi2 := take(Cost{N: 1, Class: 2})
	if hi2.Wait != 200*time.Millisecond {
		t.Errorf("the next take of class 2 waits %v, want 200ms: behind the one before, first come first served", hi2.Wait)
	}
	mid := take(Cost{N: 1, Class: 1})
	if mid.Wait != 250*time.Millisecond {
		t.Errorf("a take of class 1 waits %v, want 250ms: behind class 2, ahead of class 0", mid.Wait)
	}
	lo := take(Tokens(1))
	if lo.Wait != 1100*time.Millisecond {
		t.Errorf("a take of class 0 waits %v, want 1.1s: behind the 20 and the 3 that jumped them", lo.Wait)
	}
	if lo.Pushed[0] != 150_000 {
		t.Errorf("class 0 was pushed %d µs, want 150000", lo.Pushed[0])
	}
	// A batch is served from the highest class down.
	qs := []*queuedTake{
		{ctx: ctx, n: Tokens(1), maxWait: time.Hour, done: make(chan struct{})},
		{ctx: ctx, n: Cost{N: 1, Class: 3}, maxWait: time.Hour, done: make(chan struct{})},
	}
	s.batches = &batches{}
	s.batches.send(s, b.Keys[0], b, qs)
	if qs[1].g.Wait != 150*time.Millisecond || qs[0].g.Wait != 1200*time.Millisecond {
		t.Errorf("a batch of class 0 then class 3 waits %v and %v, want 1.2s and 150ms: class 3 first, ahead of every class", qs[0].g.Wait, qs[1].g.Wait)
	}
	if p := qs[0].g.Pushed; len(p) != 3 || p[0] != 200_000 || p[1] != 100_000 || p[2] != 50_000 {
		t.Errorf("the batch's pushes are %v, want [200000 100000 50000]: class 3 pushed every class below it", p)
	}
	s.batches = nil

	// The queue drains: with nothing beyond the commit point, a take of a
	// higher class pushes nothing.
	now.Add(int64(2 * time.Second))
	before := take(Cost{N: 1, Class: 2}).Pushed
	take(Tokens(1))
	after := take(Cost{N: 1, Class: 2}).Pushed
	if before != nil && after != nil && after[0] != before[0] {
		t.Errorf("pushes went from %v to %v on a bucket without a queue, want none", before, after)
	}

	// A pause holds every class, and moves the tails with the queue.
	if err := s.Pause(ctx, b, time.Second); err != nil {
		t.Fatal(err)
	}
	if g := take(Cost{N: 1, Class: 3}); g.Wait < time.Second {
		t.Errorf("a take of class 3 in a pause of 1s waits %v, want at least the pause", g.Wait)
	}
	if ttl, _ := rdb.PTTL(ctx, b.Call[1]).Result(); ttl <= 0 {
		t.Errorf("the control record's TTL is %v, want one: the classes leave nothing behind", ttl)
	}
}

// A change of the Limit rescales each class's tail with the queue, and a
// refund leaves no tail beyond the layer's.
func TestClassesRescale(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	ctx := context.Background()
	b := New("quota:", "rescaled", []Limit{{Rate: 20, Burst: 2}})
	for range 20 {
		if _, err := s.takeOne(ctx, b, Tokens(1), time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	for range 2 { // class 2's tail at now + 300 ms
		if _, err := s.takeOne(ctx, b, Cost{N: 1, Class: 2}, time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	// The operator doubles the rate: the tail, 6 tokens owed, is owed at
	// 40/s from now, 150 ms; a take of class 2 then queues behind it and
	// the commit point, 150 ms in tat terms at 40/s burst 2, and waits
	// 125 ms (275 ms behind a tail left as it was).
	if err := rdb.HSet(ctx, b.Call[1], "seen", "20 2").Err(); err != nil { // as the Limiters' reads write it
		t.Fatal(err)
	}
	if _, err := s.Record(ctx, b.Keys, RecordOp{Op: "limit", Limit: Limit{Rate: 40, Burst: 2}}); err != nil {
		t.Fatal(err)
	}
	b40 := New("quota:", "rescaled", []Limit{{Rate: 40, Burst: 2}})
	g, err := s.takeOne(ctx, b40, Cost{N: 1, Class: 2}, time.Hour)
	if err != nil || g.Wait != 125*time.Millisecond {
		t.Errorf("a take of class 2 after the change waits %v (%v), want 125ms: its class's tail rescaled with the queue", g.Wait, err)
	}
	// A refund of that take hands back what nothing is queued behind in
	// its class, and its tail goes no further than the layer's.
	if err := s.Refund(ctx, b40, Cost{N: 1, Class: 2}, g.Tats); err != nil {
		t.Fatal(err)
	}
	tail, _ := rdb.HGet(ctx, b.Call[1], "t2:").Float64()
	tat, _ := rdb.Get(ctx, b.Keys[0]).Float64()
	if tail > tat {
		t.Errorf("class 2's tail %v is beyond the layer's tat %v after a refund", tail, tat)
	}
}

// A class given a minimum share is pushed by at most the rest of the
// time that passes: under a flood of a higher class, five times the rate,
// class 0 with a share of 25% is pushed 0.75 s a second, and the takes
// the share has no room for are refused, taking nothing, with how long
// until it has. The control, without a share, is pushed five seconds a
// second.
func TestClassesMinimumShare(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	for _, share := range []float64{0.25, 0} {
		var now atomic.Int64
		now.Store(time.Now().UnixNano())
		s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
		ctx := context.Background()
		b := New("quota:", fmt.Sprint("share", share), []Limit{{Rate: 20, Burst: 1}}) // 50 ms a token
		take := func(n Cost) Grant {
			t.Helper()
			g, err := s.takeOne(ctx, b, n, time.Hour)
			if err != nil || g.Outcome != Granted && g.Outcome != Crowded {
				t.Fatalf("take %+v: %+v, %v", n, g, err)
			}
			return g
		}
		var tat Grant
		for range 200 { // a queue of 10 s
			tat = take(Tokens(1))
		}
		const steps, step = 500, 10 * time.Millisecond // 5 s of a take of class 2 every 10 ms
		var pushes []int64
		crowded := 0
		for range steps {
			g := take(Cost{N: 1, Class: 2, Shares: []float64{share}})
			if g.Outcome == Crowded {
				crowded++
				if g.Wait <= 0 || g.Wait > 100*time.Millisecond {
					t.Fatalf("a take the share refused is told to wait %v, want up to a token's time over the share (67ms)", g.Wait)
				}
			} else {
				pushes = g.Pushed
			}
			now.Add(int64(step))
		}
		elapsed := steps * step
		pushed := time.Duration(pushes[0]) * time.Microsecond
		t.Logf("share %v: class 0 pushed %v in %v (%.2f of the time); %d of %d takes of class 2 refused", share, pushed, elapsed, pushed.Seconds()/elapsed.Seconds(), crowded, steps)
		if share > 0 {
			if most := time.Duration((1-share)*float64(elapsed)) + 150*time.Millisecond; pushed > most || pushed < most-300*time.Millisecond {
				t.Errorf("class 0 with a share of %v was pushed %v in %v; want about %v of the time (at most %v)", share, pushed, elapsed, 1-share, most)
			}
			// The refused took nothing: class 0's next take queues behind
			// the 200, the pushes and itself.
			next := take(Tokens(1))
			want := time.Duration(tat.Wait) + pushed + 50*time.Millisecond - elapsed
			if d := next.Wait - want; d < -time.Millisecond || d > time.Millisecond {
				t.Errorf("class 0's next take waits %v, want %v: the refused takes took nothing", next.Wait, want)
			}
		} else if pushed < elapsed || crowded > 0 {
			t.Errorf("without a share, class 0 was pushed %v in %v and %d takes refused; want the whole flood pushing it", pushed, elapsed, crowded)
		}
	}
}
