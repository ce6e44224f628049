package store

import (
	"context"
	"math"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redistest"
)

// fairClock is a store on a real server whose clock the test moves.
func fairClock(t *testing.T) (*Store, *atomic.Int64, *redis.Client) {
	t.Helper()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }, Channel: "quota:control"})
	return s, &now, rdb
}

// Two tenants weighted 3 and 1 that both keep asking share a saturated
// bucket 3 to 1, each admitted only on its turn and only while the queue
// is short; when the heavier one stops, the lighter one has the whole
// rate. Without tenants, the same asks share it as they arrive.
func TestTenantsShareByWeight(t *testing.T) {
	for _, fair := range []bool{true, false} {
		name := "weighted"
		if !fair {
			name = "control"
		}
		t.Run(name, func(t *testing.T) {
			s, now, _ := fairClock(t)
			ctx := context.Background()
			b := New("quota:", "tenants", []Limit{{Rate: 20, Burst: 1}})
			type tenant struct {
				name    string
				weight  float64
				next    time.Duration // when it asks again, from the start
				granted int
				asks    int
				since   int64 // when its take was first held, as a Limiter sends it
			}
			// Each tenant has eight callers, each asking again when its
			// grant is due: without the gate, they would share the rate
			// half and half.
			var ts []*tenant
			for range 8 {
				ts = append(ts, &tenant{name: "heavy", weight: 3})
			}
			for range 8 {
				ts = append(ts, &tenant{name: "light", weight: 1})
			}
			start := now.Load()
			// As in a Limiter, the callers of a tenant wait in line and the
			// first of them asks until it is granted.
			head := map[string]*tenant{}
			run := func(from, to time.Duration, who []*tenant) (heavy, light int) {
				for at := from; at < to; at += time.Millisecond {
					now.Store(start + int64(at))
					for _, x := range who {
						if h := head[x.name]; x.next > at || h != nil && h != x {
							continue
						}
						c := Cost{N: 1}
						if fair {
							c.Tenant, c.Weight, c.Since = x.name, x.weight, x.since
						}
						x.asks++
						g, err := s.takeOne(ctx, b, c, time.Hour)
						if err != nil {
							t.Fatal(err)
						}
						switch {
						case g.Granted():
							// The caller sleeps on its grant, and its next
							// request asks then.
							x.next, head[x.name], x.since = at+g.Wait, nil, 0
							x.granted++
							if x.name == "heavy" {
								heavy++
							} else {
								light++
							}
						case g.Outcome == Held && fair:
							if g.Wait <= 0 || g.Wait > 250*time.Millisecond {
								t.Fatalf("held for %v, want (0, 250ms]", g.Wait)
							}
							x.next, head[x.name] = at+g.Wait, x
							if x.since == 0 {
								x.since = g.Now
							}
						default:
							t.Fatalf("%s: %+v", x.name, g)
						}
					}
				}
				return heavy, light
			}
			heavy, light := run(0, 10*time.Second, ts)
			share := float64(heavy) / float64(heavy+light)
			t.Logf("both asking, 10 s: heavy %d, light %d (%.3f of the grants to the heavy one)", heavy, light, share)
			if total := heavy + light; fair && (total < 195 || total > 206) {
				t.Errorf("%d grants in 10 s at 20/s, burst 1, want 195 to 206 (those admitted by 10 s are due by 10.25 s)", total)
			}
			if fair && math.Abs(share-0.75) > 0.02 {
				t.Errorf("the heavy tenant had %.3f of the grants, want 0.75 ± 0.02", share)
			}
			if !fair && math.Abs(share-0.5) > 0.05 {
				t.Errorf("without tenants, the heavy one had %.3f of the grants, want about 0.5", share)
			}
			// The heavy tenant stops: from 300 ms on, the light one has it all.
			run(10*time.Second, 10*time.Second+300*time.Millisecond, ts[8:])
			_, light = run(10*time.Second+300*time.Millisecond, 12*time.Second+300*time.Millisecond, ts[8:])
			asks, grants := 0, 0
			for _, x := range ts {
				asks, grants = asks+x.asks, grants+x.granted
			}
			t.Logf("light alone, from 300 ms on, 2 s: %d grants; %.1f asks a grant", light, float64(asks)/float64(grants))
			if fair && float64(asks)/float64(grants) > 3 {
				t.Errorf("%d asks for about %d grants: the held takes ask too often", asks, grants)
			}
			switch {
			case fair && light < 39:
				t.Errorf("the light tenant alone had %d grants in 2 s, want 40 at 20/s", light)
			case !fair && light >= 39:
				t.Errorf("without tenants, the light one had %d grants in the 2 s after the heavy one stopped: the heavy one's queue should have held it back", light)
			}
		})
	}
}

// A tenant's take is held, taking nothing, when another waiting tenant
// starts before it or when the queue is full; a take of a priority above
// 0 is never held but is charged to its tenant; a pause with no end
// refuses as it does every take; a refund of a take for a tenant hands
// its tokens back; tenants beyond the cap are one tenant.
func TestTenantsEdges(t *testing.T) {
	s, now, rdb := fairClock(t)
	ctx := context.Background()
	b := New("quota:", "edges", []Limit{{Rate: 20, Burst: 1}})
	// As in a Limiter, a tenant's take that was held says when it was
	// first held when it asks again.
	since := map[string]int64{}
	take := func(c Cost) Grant {
		t.Helper()
		if c.Class == 0 {
			c.Since = since[c.Tenant]
		}
		g, err := s.takeOne(ctx, b, c, time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		switch {
		case c.Class > 0:
		case g.Outcome == Held && since[c.Tenant] == 0:
			since[c.Tenant] = g.Now
		case g.Outcome != Held:
			since[c.Tenant] = 0
		}
		return g
	}
	a := Cost{N: 1, Tenant: "a", Weight: 1}
	bb := Cost{N: 1, Tenant: "b", Weight: 1}
	// The queue fills to 250 ms: a's 7th take is held for room.
	for i := range 6 {
		if g := take(a); !g.Granted() || g.Wait != time.Duration(i)*50*time.Millisecond {
			t.Fatalf("a's take %d: %+v", i, g)
		}
	}
	g := take(a)
	if g.Outcome != Held || g.Wait != 50*time.Millisecond {
		t.Fatalf("a's 7th take, the queue full: %+v, want held for 50ms", g)
	}
	// b, which has taken nothing, starts before a: a is held for its turn
	// even once there is room, and b is admitted.
	now.Add(int64(40 * time.Millisecond))
	if g := take(bb); g.Outcome != Held {
		t.Fatalf("b's take with the queue full: %+v, want held", g)
	}
	now.Add(int64(20 * time.Millisecond))
	if g := take(a); g.Outcome != Held {
		t.Errorf("a's take, with b waiting and due before it: %+v, want held", g)
	}
	if g := take(bb); !g.Granted() {
		t.Errorf("b's take on its turn: %+v, want granted", g)
	}
	// A take of priority 3 is not held, and a's next take of priority 0
	// waits for the time it was charged.
	if g := take(Cost{N: 1, Class: 3, Tenant: "b", Weight: 1}); !g.Granted() {
		t.Errorf("b's take of priority 3: %+v, want granted", g)
	}
	// A refund of a take for a tenant.
	g = take(Cost{N: 1, Class: 3, Tenant: "a", Weight: 1})
	if !g.Granted() {
		t.Fatalf("a's take of priority 3: %+v", g)
	}
	if err := s.Refund(ctx, b, Cost{N: 1, Class: 3, Tenant: "a", Weight: 1}, g.Tats); err != nil {
		t.Errorf("refund of a take for a tenant: %v", err)
	}
	// The cap: with 2 tenants kept apart, a third is the others.
	now.Add(int64(10 * time.Second))
	for _, name := range []string{"x", "y", "z"} {
		if g := take(Cost{N: 1, Tenant: name, Weight: 1, TenantCap: 2}); !g.Granted() && g.Outcome != Held {
			t.Fatalf("%s: %+v", name, g)
		}
	}
	h, err := rdb.HGetAll(ctx, b.Keys[0]+":ctl").Result()
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for f := range h {
		if len(f) > 2 && f[:2] == "f:" || f == "f:" {
			names[f] = true
		}
	}
	if len(names) > 3 || !names["f:"] {
		t.Errorf("the record keeps tenants %v, want at most 3 with the others (f:) among them", names)
	}
	// A pause with no end refuses a tenant's take as any other.
	if _, err := rdb.HSet(ctx, b.Keys[0]+":ctl", "since", now.Load()/1000, "until", "forever", "shifted", 0).Result(); err != nil {
		t.Fatal(err)
	}
	if g := take(a); g.Outcome != Paused {
		t.Errorf("a tenant's take under a pause until resumed: %+v, want paused", g)
	}
	// A weight that is no number is an error, not a take.
	if _, err := s.takeOne(ctx, b, Cost{N: 1, Tenant: "a", Weight: math.Inf(1)}, time.Hour); err == nil {
		t.Error("a take of infinite weight: no error")
	}
}
