package quota

import (
	"context"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"

	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of priorities (priority.go): WithPriority, ContextWithPriority and
// WithMinShare across a fleet: a higher priority jumps a batch queue, of
// tokens and of slots, sleepers pushed back by it go later, a minimum share
// holds under a flood, and priorities meet the other features.

// priorityRun is what a fleet with a batch queue and an interactive
// process did (see runPriority).
type priorityRun struct {
	waits       []time.Duration // the interactive requests', sorted
	busiest     int             // the most requests that returned in any 1 s
	total       int             // the requests granted in the batch's run
	batchAfter  float64         // the batch's rate from a second after the interactive process stopped to the end
	interactive int             // the interactive requests granted
}

// runPriority runs 3 batch processes of 30 goroutines each on a bucket of
// lim for d, whose queue holds about 90 / lim.Rate seconds, and from 1 s
// on a fourth process that sends one interactive request every half
// second, at priority, for 5 s.
func runPriority(t *testing.T, key string, lim Limit, priority int, d time.Duration) priorityRun {
	t.Helper()
	srv := redistest.Start(t)
	batch := startWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: key, Limit: lim, Goroutines: 30, Duration: d})
	time.Sleep(time.Until(batch.start.Add(time.Second)))
	interactive := startWorkers(t, 1, workerSpec{Addr: srv.Addr(), Key: key, Limit: lim, Goroutines: 1,
		Duration: 5 * time.Second, Rest: 350 * time.Millisecond, Priority: priority})
	ireps := interactive.wait(t)
	breps := batch.wait(t)

	var run priorityRun
	for _, s := range ireps[0].Stamps {
		run.waits = append(run.waits, s.Woke.Sub(s.Asked))
	}
	slices.Sort(run.waits)
	run.interactive = len(run.waits)
	all := mergeStamps(append(breps, ireps...))
	for _, s := range all {
		if s.Woke.Before(batch.start.Add(d)) {
			run.total++
		}
	}
	run.busiest = maxInWindow(dues(t, all), time.Second) // when granted: a busy machine wakes callers late, together
	iEnd := interactive.start.Add(interactive.spec.Duration + 500*time.Millisecond)
	from, to := iEnd.Add(time.Second), batch.start.Add(d)
	n := 0
	for _, s := range mergeStamps(breps) {
		if !s.Woke.Before(from) && s.Woke.Before(to) {
			n++
		}
	}
	run.batchAfter = float64(n) / to.Sub(from).Seconds()
	return run
}

// p99 returns the 99th percentile of sorted waits.
func p99(waits []time.Duration) time.Duration {
	if len(waits) == 0 {
		return 0
	}
	return waits[min(len(waits)-1, len(waits)*99/100)]
}

// Interactive requests at a higher priority jump a batch queue of 4.5 s
// held by 3 other processes: they wait at most 5 token intervals, the
// fleet stays within the bound and at the rate, and the batch gets the
// whole rate once they stop.
func TestPriorityJumpsTheQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	lim := Limit{Rate: 20, Burst: 5}
	const d = 10 * time.Second
	run := runPriority(t, "priority", lim, 5, d)
	t.Logf("interactive at priority 5: %d requests, waits p50 %v, p99 %v; busiest 1s %d (bound %d); %d granted in %v (%.1f/s); batch %.1f/s once they stopped",
		run.interactive, run.waits[len(run.waits)/2].Round(time.Millisecond), p99(run.waits).Round(time.Millisecond),
		run.busiest, bound(lim, time.Second), run.total, d, float64(run.total)/d.Seconds(), run.batchAfter)
	interval := time.Duration(float64(time.Second) / lim.Rate)
	if p := p99(run.waits); p > 5*interval {
		t.Errorf("the interactive requests' p99 wait is %v, want at most 5 token intervals (%v)", p, 5*interval)
	}
	if run.interactive < 8 {
		t.Errorf("%d interactive requests, want at least 8, one every half second", run.interactive)
	}
	if b := bound(lim, time.Second); run.busiest > b {
		t.Errorf("%d requests in the busiest second, want at most %d (Burst + Rate)", run.busiest, b)
	}
	if want := int(0.9 * (lim.Burst + lim.Rate*d.Seconds())); run.total < want {
		t.Errorf("%d requests in %v, want at least %d: the fleet stays at the rate", run.total, d, want)
	}
	if run.batchAfter < 0.9*lim.Rate {
		t.Errorf("the batch ran at %.1f/s once the interactive process stopped, want the whole rate (%v/s)", run.batchAfter, lim.Rate)
	}
}

// The negative control: the same fleet with the interactive requests at
// the batch's priority, 0: they wait out the batch queue, which the batch
// holds for as long as they run.
func TestPriorityJumpsTheQueueCatchesOneQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	lim := Limit{Rate: 20, Burst: 5}
	run := runPriority(t, "one-queue", lim, 0, 7*time.Second)
	t.Logf("interactive at priority 0: %d requests, waits p50 %v, p99 %v", run.interactive,
		run.waits[len(run.waits)/2].Round(time.Millisecond), p99(run.waits).Round(time.Millisecond))
	if p := run.waits[len(run.waits)/2]; p < time.Second {
		t.Errorf("the interactive requests' median wait is %v at priority 0, want over 1s: they queue behind the batch", p)
	}
}

// Priority meets the other features on one server: a pause holds every
// priority; a priority outside 0 to MaxPriority fails before anything is
// taken or sent; under dry run each priority's would-be wait is
// measured, and named on the wait span and the metrics.
func TestPriorityMeets(t *testing.T) {
	t.Run("a pause holds every priority", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb)
		lim := Limit{Rate: 20, Burst: 1}
		ctx := context.Background()
		if err := l.Pause(ctx, "paused", 600*time.Millisecond); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if err := l.Wait(ContextWithPriority(ctx, MaxPriority), "paused", lim); err != nil {
			t.Fatal(err)
		}
		if waited := time.Since(start); waited < 550*time.Millisecond {
			t.Errorf("a request at priority %d went %v into a pause of 600ms, want after it", MaxPriority, waited)
		}
		if err := l.Pause(ctx, "paused", time.Second); err != nil {
			t.Fatal(err)
		}
		if ok, err := l.Allow(ContextWithPriority(ctx, 3), "paused", lim); ok || err != nil {
			t.Errorf("Allow at priority 3 in a pause: %v, %v; want refused", ok, err)
		}
	})
	t.Run("invalid minimum shares", func(t *testing.T) {
		mustPanic(t, "WithMinShare(MaxPriority, 0.1)", func() { WithMinShare(MaxPriority, 0.1) })
		mustPanic(t, "WithMinShare(-1, 0.1)", func() { WithMinShare(-1, 0.1) })
		mustPanic(t, "WithMinShare(0, 0)", func() { WithMinShare(0, 0) })
		mustPanic(t, "WithMinShare(0, 1)", func() { WithMinShare(0, 1) })
		mustPanic(t, "WithMinShare(0, NaN)", func() { WithMinShare(0, math.NaN()) })
		c := newConfig([]TransportOption{WithMinShare(0, 0.1), WithMinShare(2, 0.2)})
		if want := []float64{0.1, 0, 0.2, 0, 0, 0, 0}; !slices.Equal(c.minShares, want) {
			t.Errorf("two minimum shares give %v, want %v", c.minShares, want)
		}
	})
	t.Run("invalid", func(t *testing.T) {
		_, rdb := limiterServer(t)
		l := NewLimiter(rdb)
		for _, p := range []int{-1, MaxPriority + 1} {
			err := l.Wait(ContextWithPriority(context.Background(), p), "bad", Limit{Rate: 1, Burst: 1})
			if !errors.Is(err, ErrInvalidPriority) {
				t.Errorf("priority %d: %v, want ErrInvalidPriority", p, err)
			}
		}
		prov, reached := countingServer(t)
		client := &http.Client{Transport: NewTransport(rdb, Limit{Rate: 1, Burst: 1}, WithPriority(func(*http.Request) int { return 9 }))}
		if _, err := client.Get(prov.URL); !errors.Is(err, ErrInvalidPriority) {
			t.Errorf("a Transport WithPriority of 9: %v, want ErrInvalidPriority", err)
		}
		if n, _ := rdb.DBSize(context.Background()).Result(); n != 0 || reached.Load() != 0 {
			t.Errorf("%d keys and %d requests after the refusals, want none: nothing taken or sent", n, reached.Load())
		}
	})
	t.Run("dry run", func(t *testing.T) {
		tel := newTelemetry(t)
		_, rdb := limiterServer(t)
		prov, _ := countingServer(t)
		client := &http.Client{Transport: NewTransport(rdb, Limit{Rate: 5, Burst: 5}, tel.transportOptions(WithDryRun(),
			WithPriority(func(r *http.Request) int {
				if r.Header.Get("X-Interactive") != "" {
					return 2
				}
				return 0
			}))...)}
		send := func(interactive bool) {
			req, _ := http.NewRequest("GET", prov.URL, nil)
			if interactive {
				req.Header.Set("X-Interactive", "1")
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
		}
		for range 30 {
			send(false) // a would-be queue of 5 s
		}
		send(true)
		send(false)
		spans := tel.waitSpans()
		hi, lo := attrs(spans[len(spans)-2]), attrs(spans[len(spans)-1])
		if p := hi["quota.priority"].AsInt64(); p != 2 {
			t.Errorf("the interactive request's span has quota.priority %d, want 2", p)
		}
		if _, ok := lo["quota.priority"]; ok {
			t.Errorf("a request at priority 0 has quota.priority on its span, want none")
		}
		hw, lw := hi["quota.wait.seconds"].AsFloat64(), lo["quota.wait.seconds"].AsFloat64()
		t.Logf("would-be waits: %.3fs at priority 2, %.3fs at 0", hw, lw)
		if hw > 0.5 || lw < 4 {
			t.Errorf("would-be waits %.3fs at priority 2 and %.3fs at 0 behind 30 requests on 5/s, want under 0.5s and over 4s", hw, lw)
		}
		if n := sumOf(tel.collect(t), "quota.acquisitions", []attribute.KeyValue{dryRunAttr, attribute.Int("quota.priority", 2)}); n != 1 {
			t.Errorf("quota.acquisitions{quota.priority=2} = %d, want 1", n)
		}
	})
}

// A caller asleep on a grant that a higher priority pushed goes that much
// later: told by the announcement, or, when it is lost, by the Limiter's
// read of the record while the caller sleeps. The control ignores pushes
// (pushes off), as a Limiter without priorities would, and goes when first
// due, on a token the higher priority was granted.
func TestPushReachesSleepers(t *testing.T) {
	lim := Limit{Rate: 10, Burst: 5} // 100 ms a token, 500 ms full
	cases := []struct {
		name      string
		announced bool
		ignore    bool
		later     bool
	}{
		{"announced", true, false, true},
		{"announcement lost", false, false, true},
		{"control: pushes ignored", true, true, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, rdb := limiterServer(t)
			l := NewLimiter(rdb)
			if c.ignore {
				turnOff(l, pushes)
			}
			ctx := context.Background()
			channel := ""
			if c.announced {
				channel = DefaultPrefix + "control"
			}
			other := store.NewStore(rdb, store.Options{Channel: channel}) // another process, its announcement lost or not
			b := store.New(DefaultPrefix, "pushed", []store.Limit{{Rate: lim.Rate, Burst: lim.Burst}})
			for range 4 { // a queue of 1.5 s
				if _, err := other.Take(ctx, b, store.Tokens(5), time.Hour); err != nil {
					t.Fatal(err)
				}
			}
			woke := make(chan time.Duration, 1)
			start := time.Now()
			go func() {
				if err := l.Wait(ctx, "pushed", lim); err != nil {
					t.Error(err)
				}
				woke <- time.Since(start)
			}()
			time.Sleep(200 * time.Millisecond)
			// Priority 2 takes 5 tokens: the sleeper, due 1.6 s in, goes 0.5 s later.
			g, err := other.Take(ctx, b, store.Cost{N: 5, Class: 2}, time.Hour)
			if err != nil || !g.Granted() {
				t.Fatalf("the push: %+v, %v", g, err)
			}
			waited := <-woke
			t.Logf("the sleeper went %v in", waited.Round(time.Millisecond))
			if pushed := waited >= 2*time.Second; pushed != c.later {
				t.Errorf("the sleeper went %v in; want after 2s: %v (due 1.6s, pushed 0.5s)", waited, c.later)
			}
		})
	}
}

// runMinShare runs 3 batch processes of 30 goroutines each on a 20/s
// bucket for d + 2 s, and from 1 s on a fourth process whose 30
// goroutines flood it at priority 5 for d, every Limiter with share as
// priority 0's minimum share (none when 0). It returns the batch's part
// of the grants from 3 s to d, the flood's steady state, and the most
// requests granted in any 1 s.
func runMinShare(t *testing.T, key string, share float64, d time.Duration) (part float64, busiest int) {
	t.Helper()
	lim := Limit{Rate: 20, Burst: 5}
	srv := redistest.Start(t)
	batch := startWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: key, Limit: lim, Goroutines: 30,
		Duration: d + 2*time.Second, MinShare: share})
	time.Sleep(time.Until(batch.start.Add(time.Second)))
	flood := startWorkers(t, 1, workerSpec{Addr: srv.Addr(), Key: key, Limit: lim, Goroutines: 30,
		Duration: d, Priority: 5, MinShare: share})
	freps := flood.wait(t)
	breps := batch.wait(t)
	calls := scriptCalls(t, srv.Client(t))
	from, to := batch.start.Add(3*time.Second), batch.start.Add(d)
	count := func(reps []workerReport) int {
		n := 0
		for _, s := range mergeStamps(reps) {
			if !s.Woke.Before(from) && s.Woke.Before(to) {
				n++
			}
		}
		return n
	}
	b, f := count(breps), count(freps)
	busiest = maxInWindow(dues(t, mergeStamps(append(breps, freps...))), time.Second) // when granted, not woken
	t.Logf("minimum share %v: from 3 s to %v the batch was granted %d, the flood at priority 5 %d (batch %.1f%%); busiest 1s %d (bound %d); %.1f script calls a grant",
		share, d, b, f, 100*float64(b)/float64(b+f), busiest, bound(lim, time.Second), float64(calls)/float64(len(mergeStamps(append(breps, freps...)))))
	if perGrant := float64(calls) / float64(len(mergeStamps(append(breps, freps...)))); perGrant > 10 {
		t.Errorf("%.1f script calls a grant, want at most 10: a take the share refuses sleeps until it has room", perGrant)
	}
	if b+f == 0 {
		t.Fatalf("nothing was granted from 3 s to %v", d)
	}
	if bd := bound(lim, time.Second); busiest > bd {
		t.Errorf("%d requests in the busiest second, want at most %d (Burst + Rate)", busiest, bd)
	}
	if want := int(0.9 * lim.Rate * to.Sub(from).Seconds()); b+f < want {
		t.Errorf("%d requests from 3 s to %v, want at least %d: the fleet stays at the rate", b+f, d, want)
	}
	return float64(b) / float64(b+f), busiest
}

// Under a flood of priority 5, five times the rate in goroutines, a
// batch at priority 0 given a minimum share of 10% gets it.
func TestMinShareHoldsUnderAFlood(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	if part, _ := runMinShare(t, "min-share", 0.1, 10*time.Second); part < 0.08 || part > 0.2 {
		t.Errorf("the batch got %.1f%% of the grants under the flood, want its minimum share, 10%% (8%% to 20%%)", 100*part)
	}
}

// The negative control: without the share, the flood starves the batch
// (measured from 3 s to 6 s: starving is at once).
func TestMinShareHoldsUnderAFloodCatchesStarvation(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	if part, _ := runMinShare(t, "no-min-share", 0, 6*time.Second); part > 0.03 {
		t.Errorf("the batch got %.1f%% of the grants under the flood without a minimum share, want none", 100*part)
	}
}

// scriptCalls returns how many times the server ran a script, by EVALSHA
// or EVAL.
func scriptCalls(t *testing.T, rdb *redis.Client) int {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for line := range strings.Lines(info) {
		if rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:calls="); ok {
			c, _, _ := strings.Cut(rest, ",")
			v, _ := strconv.Atoi(c)
			n += v
		}
		if rest, ok := strings.CutPrefix(line, "cmdstat_eval:calls="); ok {
			c, _, _ := strings.Cut(rest, ",")
			v, _ := strconv.Atoi(c)
			n += v
		}
	}
	return n
}

// runSlotPriority runs 3 batch processes of 5 goroutines each for 7 s
// through Transports WithConcurrency(1) to a provider that takes 100 ms a
// request, a queue of 1.5 s for the one slot, and from 1 s on a fourth
// process that sends one request about every half second, at priority,
// for 5 s. It returns those requests' times, from ask to response, sorted.
func runSlotPriority(t *testing.T, priority int) []time.Duration {
	t.Helper()
	srv := redistest.Start(t)
	p := &inFlight{latency: 100 * time.Millisecond}
	provider := httptest.NewServer(p)
	defer provider.Close()
	spec := workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(provider.URL, "http://"), Limit: fastLimit,
		Goroutines: 5, Duration: 7 * time.Second, URL: provider.URL, Concurrency: 1}
	batch := startWorkers(t, 3, spec)
	time.Sleep(time.Until(batch.start.Add(time.Second)))
	spec.Goroutines, spec.Duration, spec.Rest, spec.Priority = 1, 5*time.Second, 350*time.Millisecond, priority
	interactive := startWorkers(t, 1, spec)
	ireps := interactive.wait(t)
	batch.wait(t)
	var times []time.Duration
	for _, s := range ireps[0].Stamps {
		times = append(times, s.Woke.Sub(s.Asked))
	}
	slices.Sort(times)
	if len(times) < 2 {
		t.Fatalf("%d requests at priority %d, want at least 2", len(times), priority)
	}
	t.Logf("priority %d behind a slot queue of 1.5 s: %d requests, ask to response p50 %v, p99 %v; peak %d in flight (limit 1)",
		priority, len(times), times[len(times)/2].Round(time.Millisecond), p99(times).Round(time.Millisecond), p.peak.Load())
	if peak := p.peak.Load(); peak > 1 {
		t.Errorf("the provider saw %d requests in flight, want at most 1", peak)
	}
	return times
}

// The waiters for a concurrency slot are served by priority too: a
// request of priority 5 behind 15 batch waiters waits for the request in
// flight and its own, not for the queue.
func TestSlotsServePriorityFirst(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	times := runSlotPriority(t, 5)
	// The request in flight and its own take 200 ms; the rest is the
	// hand-off's and the machine's (a fresh-clone run's slowest, 403 ms).
	if p := p99(times); p > 500*time.Millisecond {
		t.Errorf("at priority 5, p99 %v from ask to response, want at most 500ms: the request in flight, its own and the hand-off", p)
	}
	if len(times) < 8 {
		t.Errorf("%d requests at priority 5, want at least 8, one about every half second", len(times))
	}
}

// The negative control: at the batch's priority, the request waits its
// turn in the queue.
func TestSlotsServePriorityFirstCatchesOneQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	if times := runSlotPriority(t, 0); times[len(times)/2] < 800*time.Millisecond {
		t.Errorf("at priority 0, median %v from ask to response, want over 800ms: it queues behind the batch", times[len(times)/2])
	}
}
