package quota

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redistest"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Tests of tenants (tenants.go): WithTenants shares a bucket's rate between
// its tenants by weight and by what they use, with the other features too,
// and a held take is not passed.

// tenantRun is what two tenants' processes did on one bucket (see
// runTenants).
type tenantRun struct {
	share     float64 // the heavy tenant's part of the grants while both ran
	both      int     // the grants while both ran
	window    time.Duration
	busiest   int     // the most grants whose callers woke in any 1 s
	lightRate float64 // the light tenant's rate from 0.5 s after the heavy one stopped
	calls     float64 // script calls a grant
}

// runTenants runs 2 processes of 15 goroutines for a heavy tenant and 2
// for a light one on a bucket of lim, all backlogged; the heavy ones stop
// after both + 1.5 s, their waits ended by their deadline, and the light
// ones 2.5 s later: both run together for about both. With weights, the
// Limiters share the bucket by them; without, the processes name no
// tenant.
func runTenants(t *testing.T, lim Limit, weights map[string]float64, both time.Duration) tenantRun {
	t.Helper()
	srv := redistest.Start(t)
	spec := func(tenant string, d time.Duration) workerSpec {
		s := workerSpec{Addr: srv.Addr(), Key: "tenants", Limit: lim, Goroutines: 15, Duration: d, Deadline: true, Weights: weights}
		if weights != nil {
			s.Tenant = tenant
		}
		return s
	}
	heavy := startWorkers(t, 2, spec("heavy", both+1500*time.Millisecond))
	light := startWorkers(t, 2, spec("light", both+4*time.Second))
	hreps, lreps := heavy.wait(t), light.wait(t)
	hs, ls := mergeStamps(hreps), mergeStamps(lreps)

	from := light.start.Add(time.Second) // both backlogged
	to := heavy.start.Add(heavy.spec.Duration)
	in := func(ss []stamp, from, to time.Time) int {
		n := 0
		for _, s := range ss {
			if !s.Woke.Before(from) && s.Woke.Before(to) {
				n++
			}
		}
		return n
	}
	h, l := in(hs, from, to), in(ls, from, to)
	run := tenantRun{both: h + l, window: to.Sub(from)}
	if h+l > 0 {
		run.share = float64(h) / float64(h+l)
	}
	all := mergeStamps(append(hreps, lreps...))
	run.busiest = maxInWindow(wakes(all), time.Second)
	after, end := to.Add(500*time.Millisecond), light.start.Add(light.spec.Duration)
	run.lightRate = float64(in(ls, after, end)) / end.Sub(after).Seconds()
	calls := 0
	for _, r := range append(hreps, lreps...) {
		for op, n := range r.Ops {
			if op == "acquire" || op == "take" {
				calls += n
			}
		}
	}
	run.calls = float64(calls) / float64(len(all))
	return run
}

// Two tenants weighted 3 and 1, both backlogged across four processes,
// share a 20/s bucket 75% and 25%; the busiest second stays within
// Burst + Rate; once the heavy tenant stops, the light one has the whole
// rate within a second.
func TestTenantsShareTheRate(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	lim := Limit{Rate: 20, Burst: 5}
	run := runTenants(t, lim, map[string]float64{"heavy": 3, "light": 1}, 10*time.Second)
	t.Logf("weights 3 and 1: the heavy tenant had %.3f of %d grants in %v; busiest 1s %d (bound %d); the light one alone %.1f/s from 0.5 s after the heavy one stopped; %.2f script calls a grant",
		run.share, run.both, run.window.Round(time.Millisecond), run.busiest, bound(lim, time.Second), run.lightRate, run.calls)
	if math.Abs(run.share-0.75) > 0.05 {
		t.Errorf("the heavy tenant had %.3f of the grants, want 0.75 ± 0.05", run.share)
	}
	// Counted as the callers woke: 2 more for wake-ups that a loaded
	// machine delays into the next second.
	if b := bound(lim, time.Second); run.busiest > b+2 {
		t.Errorf("%d grants in the busiest second, want at most %d (Burst + Rate, and 2 for late wake-ups)", run.busiest, b+2)
	}
	if want := 0.9 * lim.Rate * run.window.Seconds(); float64(run.both) < want {
		t.Errorf("%d grants in %v, want at least %.0f: the tenants use the whole rate", run.both, run.window, want)
	}
	if run.lightRate < 0.9*lim.Rate {
		t.Errorf("the light tenant alone ran at %.1f/s, want the whole rate (%v/s)", run.lightRate, lim.Rate)
	}
}

// The negative control: the same processes naming no tenant share the
// bucket as they arrive, half and half (measured over 5 s: a share is
// what it tells).
func TestTenantsShareTheRateCatchesOneQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	run := runTenants(t, Limit{Rate: 20, Burst: 5}, nil, 5*time.Second)
	t.Logf("no tenants: the heavy processes had %.3f of %d grants", run.share, run.both)
	if run.share > 0.65 {
		t.Errorf("without tenants the heavy processes had %.3f of the grants, want about half", run.share)
	}
}

// Tenants meet the other features: a pause holds every tenant; a take
// that may not wait is refused while it is another tenant's turn; a
// deadline ends a wait in line; the tenant is named on the wait span and,
// listed or "other", on the metrics; a bad weight panics.
func TestTenantsMeet(t *testing.T) {
	t.Run("a pause holds every tenant", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb, WithTenants(Tenants{Weights: map[string]float64{"a": 3}}))
		lim := Limit{Rate: 20, Burst: 1}
		ctx := context.Background()
		if err := l.Pause(ctx, "paused", 600*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		for _, tenant := range []string{"a", "b"} {
			if err := l.Wait(ContextWithTenant(ctx, tenant), "paused", lim); err != nil {
				t.Fatal(err)
			}
			if d := time.Since(start); d < 550*time.Millisecond {
				t.Errorf("tenant %s was granted %v into a 600ms pause", tenant, d)
			}
		}
	})
	t.Run("allow and deadlines", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb, WithTenants(Tenants{}))
		lim := Limit{Rate: 10, Burst: 1}
		ctx := context.Background()
		a, b := ContextWithTenant(ctx, "a"), ContextWithTenant(ctx, "b")
		// a fills the queue (250 ms at 10/s: 3 grants and the burst).
		for range 3 {
			if err := l.Wait(a, "allow", lim); err != nil {
				t.Fatal(err)
			}
		}
		if ok, err := l.Allow(b, "allow", lim); ok || err != nil {
			t.Errorf("Allow with the queue full: %v, %v; want false, nil", ok, err)
		}
		dctx, cancel := context.WithTimeout(b, 50*time.Millisecond)
		defer cancel()
		err := l.Wait(dctx, "allow", lim)
		if !errors.Is(err, ErrWouldExceedDeadline) && !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("a wait with 50 ms to go behind a full queue: %v", err)
		}
	})
	// Two tenants keep a queue in one process; their callers take turns.
	backlog := func(t *testing.T, l *Limiter, key string, lim Limit, d time.Duration, extra func(ctx context.Context)) map[string][]time.Time {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), d)
		defer cancel()
		got := map[string][]time.Time{}
		var mu sync.Mutex
		var wg sync.WaitGroup
		for _, tenant := range []string{"a", "b"} {
			for range 10 {
				wg.Go(func() {
					tctx := ContextWithTenant(ctx, tenant)
					for tctx.Err() == nil {
						if err := l.Wait(tctx, key, lim); err != nil {
							return
						}
						mu.Lock()
						got[tenant] = append(got[tenant], time.Now())
						mu.Unlock()
					}
				})
			}
		}
		if extra != nil {
			extra(ctx)
		}
		wg.Wait()
		return got
	}
	t.Run("a higher priority is not held", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb, WithTenants(Tenants{}))
		lim := Limit{Rate: 20, Burst: 1}
		var waited time.Duration
		backlog(t, l, "priority", lim, 1500*time.Millisecond, func(ctx context.Context) {
			time.Sleep(time.Second)
			start := time.Now()
			if err := l.Wait(ContextWithPriority(ContextWithTenant(ctx, "a"), 5), "priority", lim); err != nil {
				t.Error(err)
			}
			waited = time.Since(start)
		})
		t.Logf("a request of priority 5 waited %v behind two tenants' queue", waited)
		if waited > 250*time.Millisecond {
			t.Errorf("a request of priority 5 waited %v behind two tenants' queue, want at most 250ms (the commit horizon and its token)", waited)
		}
	})
	t.Run("a limit change", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb, WithTenants(Tenants{Weights: map[string]float64{"a": 1, "b": 1}}))
		lim := Limit{Rate: 40, Burst: 1}
		changed := time.Now().Add(time.Second)
		got := backlog(t, l, "change", lim, 2500*time.Millisecond, func(ctx context.Context) {
			time.Sleep(time.Until(changed))
			if err := l.SetLimit(ctx, "change", Limit{Rate: 10, Burst: 1}); err != nil {
				t.Error(err)
			}
		})
		after := map[string]int{}
		var all []time.Time
		for tenant, ts := range got {
			for _, at := range ts {
				if at.After(changed.Add(300 * time.Millisecond)) {
					after[tenant]++
					all = append(all, at)
				}
			}
		}
		slices.SortFunc(all, time.Time.Compare)
		t.Logf("from 300 ms after the change to 10/s: a %d, b %d; busiest second %d", after["a"], after["b"], maxInWindow(all, time.Second))
		// Burst + Rate is 11; the callers' wake-ups jitter by milliseconds.
		if n := maxInWindow(all, time.Second); n > 12 {
			t.Errorf("%d grants in a second after the change to 10/s, burst 1: want 11, 12 with jitter", n)
		}
		if after["a"] < 3 || after["b"] < 3 {
			t.Errorf("after the change, a had %d grants and b %d: both should go on", after["a"], after["b"])
		}
	})
	t.Run("the tenant on spans and metrics", func(t *testing.T) {
		_, rdb := limiterServer(t)
		tel := newTelemetry(t)
		l := NewLimiter(rdb, append(tel.options(), WithTenants(Tenants{Weights: map[string]float64{"listed": 2}}))...)
		ctx := context.Background()
		for _, tenant := range []string{"listed", "unlisted"} {
			if err := l.Wait(ContextWithTenant(ctx, tenant), "observed", Limit{Rate: 100, Burst: 10}); err != nil {
				t.Fatal(err)
			}
		}
		var onSpans []string
		for _, s := range tel.waitSpans() {
			onSpans = append(onSpans, attrs(s)[obs.AttrTenant].AsString())
		}
		if !slices.Equal(onSpans, []string{"listed", "unlisted"}) {
			t.Errorf("the wait spans name the tenants %v, want [listed unlisted]", onSpans)
		}
		var rm metricdata.ResourceMetrics
		tel.reader.Collect(ctx, &rm)
		listed := sumOf(rm, "quota.acquisitions", []attribute.KeyValue{obs.AttrTenant.String("listed")})
		other := sumOf(rm, "quota.acquisitions", []attribute.KeyValue{obs.AttrTenant.String("other")})
		if listed != 1 || other != 1 {
			t.Errorf("quota.acquisitions by tenant: listed %d, other %d; want 1 and 1", listed, other)
		}
	})
	t.Run("traffic does not grow the record", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb, WithTenants(Tenants{Weights: map[string]float64{"listed": 2}, Max: 8}))
		ctx := context.Background()
		lim := Limit{Rate: 1000, Burst: 1} // each take queues: the tenants stay in the books
		for i := range 300 {
			if err := l.Wait(ContextWithTenant(ctx, fmt.Sprint("t", i)), "flood", lim); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.Wait(ContextWithTenant(ctx, "listed"), "flood", lim); err != nil {
			t.Fatal(err)
		}
		key, _ := bucketKey(DefaultPrefix, "flood")
		fields, err := rdb.HKeys(ctx, key+":ctl").Result()
		if err != nil {
			t.Fatal(err)
		}
		n, listed := 0, false
		for _, f := range fields {
			if strings.HasPrefix(f, "f:") {
				n++
				listed = listed || f == "f:listed"
			}
		}
		t.Logf("300 tenants not listed and one listed: %d kept apart in the record", n)
		if n > 10 || !listed {
			t.Errorf("the record keeps %d tenants (the listed one: %v), want at most Max (8), the others and the listed one", n, listed)
		}
	})
	t.Run("a bad weight", func(t *testing.T) {
		for _, ts := range []Tenants{{Weights: map[string]float64{"a": 0}}, {Weights: map[string]float64{"a": math.Inf(1)}}, {Default: -1}, {Max: -1}} {
			func() {
				defer func() {
					if recover() == nil {
						t.Errorf("WithTenants(%+v) did not panic", ts)
					}
				}()
				WithTenants(ts)
			}()
		}
	})
}

// runSettledTenants has two tenants of weight 1 reserve 10 tokens a
// request for 3 s, 5 goroutines each, on a metered bucket of 100 tokens a
// second: a uses all 10, b 2, and each settles at once. It returns b's
// part of the tokens used.
func runSettledTenants(t *testing.T, charge bool) float64 {
	t.Helper()
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb, WithTenants(Tenants{}))
	if !charge {
		turnOff(l, charges)
	}
	meters := []Meter{{Name: "tokens", Limit: Limit{Rate: 100, Burst: 10}}}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	var mu sync.Mutex
	used := map[string]float64{}
	var wg sync.WaitGroup
	for tenant, n := range map[string]float64{"a": 10, "b": 2} {
		for range 5 {
			wg.Go(func() {
				tctx := ContextWithTenant(ctx, tenant)
				for {
					r, err := l.Reserve(tctx, "settled", meters, Usage{"tokens": 10})
					if err != nil {
						return
					}
					r.Settle(Usage{"tokens": n})
					mu.Lock()
					used[tenant] += n
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	share := used["b"] / (used["a"] + used["b"])
	t.Logf("settles charge the tenants: %v; a used %.0f tokens, b %.0f (b's part %.3f)", charge, used["a"], used["b"], share)
	return share
}

// Tenants share what they use: a settle that gives tokens back gives its
// tenant's share back too, so that a tenant that reserves 10 tokens and
// uses 2 gets half of what the tenants use, not a sixth.
func TestTenantsShareWhatTheyUse(t *testing.T) {
	t.Parallel()
	if share := runSettledTenants(t, true); math.Abs(share-0.5) > 0.12 {
		t.Errorf("b, which used 2 of each 10 it reserved, had %.3f of the tokens used, want half", share)
	}
}

// The negative control: settles that leave the shares as reserved give b
// a sixth of what is used (2 of 12).
func TestTenantsShareWhatTheyUseCatchesReservations(t *testing.T) {
	t.Parallel()
	if share := runSettledTenants(t, false); share > 0.3 {
		t.Errorf("with the shares as reserved, b had %.3f of the tokens used, want about 1/6", share)
	}
}

// A take of a tenant that is held is not passed again and again by the
// same tenant's takes from other Limiters: four Limiters of tenant a
// (three whose 5 callers each take 1 token, one whose single caller takes
// 2) and one of tenant b share a 40/s bucket, every caller backlogged for
// 4 s. The 2-token caller, once held, is the oldest take of a and is
// admitted as soon as a has its turn and room: it is answered within
// 500 ms each time (before the oldest held take went first, 800 to
// 950 ms, served 7 to 10 times; now about 300 ms, 16 times).
func TestHeldTakeIsNotPassed(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 40, Burst: 2}
	limiter := func() *Limiter {
		rdb := srv.Client(t, func(o *redis.Options) { *o = *limiterOptions(srv.Addr()) })
		return NewLimiter(rdb, WithTenants(Tenants{}))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	var mu sync.Mutex
	served := map[string]int{}
	loop := func(l *Limiter, tenant string, n float64, each func(time.Time)) {
		wg.Go(func() {
			tctx := ContextWithTenant(ctx, tenant)
			for ctx.Err() == nil {
				if err := l.WaitN(tctx, "held", n, lim); err != nil {
					if ctx.Err() == nil && !errors.Is(err, ErrWouldExceedDeadline) && !errors.Is(err, context.DeadlineExceeded) {
						t.Errorf("tenant %s, %v tokens: %v", tenant, n, err)
					}
					return
				}
				mu.Lock()
				served[tenant]++
				mu.Unlock()
				if each != nil {
					each(time.Now())
				}
			}
		})
	}
	start := time.Now()
	var stamps []time.Time
	for _, tenant := range []string{"a", "a", "a", "b"} {
		l := limiter()
		for range 5 {
			loop(l, tenant, 1, nil)
		}
	}
	loop(limiter(), "a", 2, func(at time.Time) { stamps = append(stamps, at) })
	wg.Wait()
	end := time.Now()
	longest, last := time.Duration(0), start
	for _, s := range append(stamps, end) {
		longest, last = max(longest, s.Sub(last)), s
	}
	t.Logf("the 2-token caller was served %d times, at most %v apart; tenant a %d times, b %d", len(stamps), longest.Round(time.Millisecond), served["a"], served["b"])
	if longest > 500*time.Millisecond {
		t.Errorf("the 2-token caller of tenant a went %v unanswered, want at most 500ms", longest.Round(time.Millisecond))
	}
}
