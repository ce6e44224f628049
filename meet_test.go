package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// The tests of where the features meet: pauses, limit changes, settles,
// slots and outages together, on a real redis-server.

// setControlIdle makes Limiters stop listening after d unused, for the
// test.
func setControlIdle(t *testing.T, d time.Duration) {
	old := controlIdle
	controlIdle = d
	t.Cleanup(func() { controlIdle = old })
}

// recordOp runs a record operation of the bucket called name as an
// operator's Limiter would, announcing it on channel: "" loses the
// announcement.
func recordOp(t *testing.T, l *Limiter, name string, op store.RecordOp, channel string) {
	t.Helper()
	key, err := bucketKey(l.cfg.prefix, name)
	if err != nil {
		t.Fatal(err)
	}
	s := store.NewStore(l.store.Client(), store.Options{Channel: channel})
	if _, err := s.Record(context.Background(), []string{key}, op); err != nil {
		t.Fatalf("%s: %v", op.Op, err)
	}
}

// TestParkedCallersHearTheResume: callers parked on a pause with no end
// learn of its end within a second, however quiet the Limiter was meanwhile
// (it stops listening after controlIdle unused) and whether or not the
// resume's announcement reaches it.
func TestParkedCallersHearTheResume(t *testing.T) {
	redistest.Long(t)
	setControlIdle(t, 400*time.Millisecond)
	srv := redistest.Start(t)
	for _, lost := range []bool{false, true} {
		t.Run(fmt.Sprintf("announcement lost %v", lost), func(t *testing.T) {
			l := NewLimiter(srv.Client(t))
			operator := NewLimiter(srv.Client(t))
			name := fmt.Sprintf("parked-%v", lost)
			lim := Limit{Rate: 100, Burst: 100}
			ctx := context.Background()
			if err := l.Wait(ctx, name, lim); err != nil { // the Limiter knows the bucket
				t.Fatal(err)
			}
			if err := operator.Pause(ctx, name, Forever); err != nil {
				t.Fatal(err)
			}
			const workers = 8
			var returned atomic.Int64
			var wg sync.WaitGroup
			for range workers {
				wg.Go(func() {
					if err := l.Wait(ctx, name, lim); err != nil {
						t.Error(err)
					}
					returned.Add(1)
				})
			}
			// Quiet for eight times controlIdle: no new acquisition.
			time.Sleep(8 * controlIdle)
			if n := returned.Load(); n != 0 {
				t.Fatalf("%d of %d workers returned during the pause", n, workers)
			}
			channel := l.cfg.prefix + control.Channel
			if lost {
				channel = ""
			}
			recordOp(t, operator, name, store.RecordOp{Op: "resume"}, channel)
			resumed := time.Now()
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				t.Fatalf("%d of %d workers still parked 5s after the resume", workers-int(returned.Load()), workers)
			}
			took := time.Since(resumed)
			t.Logf("%d workers parked through %v of quiet returned %v after the resume", workers, 8*controlIdle, took.Round(time.Millisecond))
			if took > time.Second {
				t.Errorf("the workers returned %v after the resume, want within 1s", took)
			}
		})
	}
}

// TestLimitChangeDuringAPause: a change of the Limit during a pause
// rescales the queue the bucket owes, not the pause: the queue after the
// resume is what the debt takes at the new rate.
func TestLimitChangeDuringAPause(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 100}
	for _, tc := range []struct {
		to       Limit
		min, max time.Duration // the queue after the resume
	}{
		// 300 tokens taken of 100: 200 owed; at 10/s the bucket is full
		// again in 30s, and the last grant falls due 10s before that.
		{Limit{Rate: 10, Burst: 100}, 15 * time.Second, 25 * time.Second},
		// At 1000/s, 200 owed take 0.2s, the last due 0.1s before full.
		{Limit{Rate: 1000, Burst: 100}, 50 * time.Millisecond, 300 * time.Millisecond},
	} {
		name := fmt.Sprintf("rescaled-%v", tc.to.Rate)
		b, err := l.bucket(name, []Limit{lim})
		if err != nil {
			t.Fatal(err)
		}
		// A Wait records the callers' Limit for the change to rescale from.
		if err := l.WaitN(ctx, name, 100, lim); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := l.store.Take(ctx, b.Bucket, store.Tokens(100), time.Minute); err != nil {
				t.Fatal(err)
			}
		}
		if err := l.Pause(ctx, name, Forever); err != nil {
			t.Fatal(err)
		}
		time.Sleep(100 * time.Millisecond)
		if err := l.SetLimit(ctx, name, tc.to); err != nil {
			t.Fatal(err)
		}
		if err := l.Resume(ctx, name); err != nil {
			t.Fatal(err)
		}
		st, err := l.Status(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("100/s, 300 tokens taken, Pause(Forever), SetLimit(%v/s), Resume: queue %v, %.1f tokens", tc.to.Rate, st.Queue, st.Tokens)
		if st.Queue < tc.min || st.Queue > tc.max {
			t.Errorf("SetLimit(%v/s) during a pause: queue %v after the resume, want %v to %v", tc.to.Rate, st.Queue, tc.min, tc.max)
		}
	}
}

// TestNothingSpins counts the script calls of callers on a bucket blocked
// for years, by a Limit or by a pause: every one sleeps between calls.
func TestNothingSpins(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	for _, tc := range []struct {
		name  string
		block func(t *testing.T, l *Limiter, name string) Limit
	}{
		{"a queue of years", func(t *testing.T, l *Limiter, name string) Limit {
			lim := Limit{Rate: 1 / (300 * 86400.0), Burst: 1} // a token every 300 days
			if err := l.Wait(context.Background(), name, lim); err != nil {
				t.Fatal(err)
			}
			b, _ := l.bucket(name, []Limit{lim})
			for range 4 { // four more: four years
				if _, err := l.store.Take(context.Background(), b.Bucket, store.Tokens(1), 5*365*24*time.Hour); err != nil {
					t.Fatal(err)
				}
			}
			return lim
		}},
		{"a pause with no end", func(t *testing.T, l *Limiter, name string) Limit {
			if err := l.Pause(context.Background(), name, Forever); err != nil {
				t.Fatal(err)
			}
			return Limit{Rate: 100, Burst: 100}
		}},
		{"a pause rescaled by a limit change", func(t *testing.T, l *Limiter, name string) Limit {
			ctx := context.Background()
			lim := Limit{Rate: 100, Burst: 1}
			if err := l.Wait(ctx, name, lim); err != nil {
				t.Fatal(err)
			}
			if err := l.Pause(ctx, name, Forever); err != nil {
				t.Fatal(err)
			}
			if err := l.SetLimit(ctx, name, Limit{Rate: 1 / (300 * 86400.0), Burst: 1}); err != nil {
				t.Fatal(err)
			}
			if err := l.Resume(ctx, name); err != nil {
				t.Fatal(err)
			}
			return lim
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb := srv.Client(t)
			cmds := newCmdCounter()
			rdb.AddHook(cmds)
			l := NewLimiter(rdb, WithMaxWait(200*time.Millisecond))
			name := strings.ReplaceAll(tc.name, " ", "-")
			lim := tc.block(t, l, name)
			cmds.reset()
			const callers, run = 4, 3 * time.Second
			// No deadline: each caller is bounded by MaxWait and asks again.
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			for range callers {
				wg.Go(func() {
					if err := l.Wait(ctx, name, lim); !errors.Is(err, context.Canceled) {
						t.Errorf("Wait returned %v on a blocked bucket", err)
					}
				})
			}
			// With a deadline a year away: refused at once, or parked.
			year, cancelYear := context.WithTimeout(ctx, 365*24*time.Hour)
			defer cancelYear()
			wg.Go(func() {
				if err := l.Wait(year, name, lim); err == nil {
					t.Error("a Wait with a deadline a year away was granted")
				}
			})
			time.Sleep(run)
			calls := cmds.get("evalsha") + cmds.get("eval") + cmds.get("control")
			cancel()
			wg.Wait()
			perCaller := float64(calls) / (callers + 1) / run.Seconds()
			t.Logf("%d callers for %v: %v (%.1f script calls a second each)", callers+1, run, cmds, perCaller)
			// A caller without a deadline asks every MaxWait (5 a second),
			// and the Limiter reads the record of a bucket callers wait on
			// every control.WaitRefresh (2 a second, for all of them).
			if perCaller > 8 {
				t.Errorf("%.1f script calls a second per caller, want at most 8", perCaller)
			}
		})
	}
	// The negative control: the counter sees a caller that does not sleep.
	rdb := srv.Client(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	l := NewLimiter(rdb, WithNoBatching())
	b, _ := l.bucket("spun", []Limit{{Rate: 1 / (300 * 86400.0), Burst: 1}})
	began := time.Now()
	for time.Since(began) < 200*time.Millisecond {
		_, _ = l.store.Take(context.Background(), b.Bucket, store.Tokens(1), 0)
	}
	if n := cmds.get("evalsha") + cmds.get("eval"); float64(n)/time.Since(began).Seconds() < 100 {
		t.Errorf("a loop without a sleep counted %d calls in 200ms: the counter misses them", n)
	}
}

// TestSlotWaitersKeepTheRate: callers that wait for a concurrency slot
// take their tokens once they hold it, so that what reaches the provider
// keeps to the rate, and nothing reaches it inside a pause.
func TestSlotWaitersKeepTheRate(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	p := &inFlight{latency: 2 * time.Second} // the provider holds each request 2s
	provider := httptest.NewServer(p)
	defer provider.Close()
	lim := Limit{Rate: 10, Burst: 1}
	var clients []*http.Client
	for range 2 {
		clients = append(clients, &http.Client{Transport: NewTransport(srv.Client(t), lim, WithConcurrency(5))})
	}
	start := time.Now()
	stop := start.Add(6 * time.Second)
	var wg sync.WaitGroup
	var pausedAt atomic.Int64
	for i := range 30 {
		c := clients[i%2]
		wg.Go(func() {
			for time.Now().Before(stop) {
				ctx, cancel := context.WithDeadline(context.Background(), stop.Add(3*time.Second))
				req, _ := http.NewRequestWithContext(ctx, "GET", provider.URL, nil)
				resp, err := c.Do(req)
				cancel()
				if err != nil {
					if pausedAt.Load() == 0 && !errors.Is(err, context.DeadlineExceeded) {
						t.Error(err)
					}
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	// The kill switch, 4s in.
	time.Sleep(time.Until(start.Add(4 * time.Second)))
	operator := NewLimiter(srv.Client(t))
	if err := operator.Pause(context.Background(), provider.Listener.Addr().String(), Forever); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	pausedAt.Store(paused.UnixNano())
	wg.Wait()
	p.mu.Lock()
	arrived := slices.Clone(p.arrivals)
	p.mu.Unlock()
	before := arrived[:0:0]
	for _, a := range arrived {
		if a.Before(paused) {
			before = append(before, a)
		}
	}
	busiest := maxInWindow(before, time.Second)
	after := between(arrived, paused.Add(100*time.Millisecond), paused.Add(3*time.Second))
	t.Logf("30 callers, 10/s burst 1, 5 slots, 2s a request: %d arrivals before the pause, at most %d in a second (bound %d); %d from 100ms after Pause(Forever) returned to 3s after",
		len(before), busiest, bound(lim, time.Second), after)
	if busiest > bound(lim, time.Second)+1 {
		t.Errorf("%d arrivals in a second, bound %d", busiest, bound(lim, time.Second))
	}
	if after != 0 {
		t.Errorf("%d requests reached the provider during the pause", after)
	}
	if len(before) < 10 {
		t.Errorf("%d arrivals before the pause: the slots let too few through", len(before))
	}
}

// TestGiveBackKeepsTheRetryAfter: a settle that gives tokens back, reported
// by the same response as a Retry-After, leaves the pause whole; and a
// give-back sent twice counts once.
func TestGiveBackKeepsTheRetryAfter(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	var n atomic.Int64
	var mu sync.Mutex
	var arrived []time.Time
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		arrived = append(arrived, time.Now())
		mu.Unlock()
		if n.Add(1) == 1 {
			w.Header().Set("Retry-After", "3")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer provider.Close()
	tr := NewTransport(srv.Client(t), Limit{Rate: 10, Burst: 10},
		WithCost(func(*http.Request) float64 { return 5 }),
		WithSettle(func(*http.Response) (float64, bool) { return 0, true }))
	client := &http.Client{Transport: tr}
	resp, err := client.Get(provider.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	answered := time.Now()
	_ = tr.Limiter().updates.running.Wait(context.Background())
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for time.Since(answered) < 3500*time.Millisecond {
				ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
				req, _ := http.NewRequestWithContext(ctx, "GET", provider.URL, nil)
				if resp, err := client.Do(req); err == nil {
					resp.Body.Close()
				}
				cancel()
			}
		})
	}
	wg.Wait()
	mu.Lock()
	during := between(arrived, answered.Add(50*time.Millisecond), answered.Add(3*time.Second-50*time.Millisecond))
	mu.Unlock()
	t.Logf("a cost of 5, then a 429 with Retry-After 3 that settles at 0: %d requests reached the provider inside the pause", during)
	if during != 0 {
		t.Errorf("%d requests inside the Retry-After pause", during)
	}

	// A give-back sent twice, as a client's retry after a lost reply
	// sends it, counts once.
	l := NewLimiter(srv.Client(t))
	ctx := context.Background()
	lim := Limit{Rate: 1, Burst: 10}
	b, _ := l.bucket("given-back", []Limit{lim})
	if err := l.WaitN(ctx, "given-back", 10, lim); err != nil { // as a request's take
		t.Fatal(err)
	}
	for range 2 {
		if err := l.store.Adjust(ctx, b.Bucket, store.Tokens(-4), "settle-1"); err != nil {
			t.Fatal(err)
		}
	}
	st, err := l.Status(ctx, "given-back")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("10 tokens taken of 10, then 4 given back twice under one id: %.2f tokens", st.Tokens)
	if st.Tokens < 3.9 || st.Tokens > 5.5 {
		t.Errorf("%.2f tokens after a give-back of 4 sent twice, want about 4", st.Tokens)
	}
}

// TestUpdatesUseTheLimitInForce: a settle and the provider's remaining
// count compute with the operator's override, not with the Limit the
// callers pass.
func TestUpdatesUseTheLimitInForce(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name             string
		passed, override Limit
		opts             []TransportOption
		header           string
		want             float64 // tokens left
	}{
		// A settle of 9 for a request that took 1, under 1/s burst 10.
		{"settle", Limit{Rate: 100, Burst: 100}, Limit{Rate: 1, Burst: 10},
			[]TransportOption{WithSettle(func(*http.Response) (float64, bool) { return 9, true })}, "", 1},
		// The provider says 5 remain, under 10/s burst 100.
		{"lower", Limit{Rate: 10, Burst: 30}, Limit{Rate: 10, Burst: 100},
			[]TransportOption{WithProviderHeaders()}, "5", 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tc.header != "" {
					w.Header().Set("X-RateLimit-Remaining", tc.header)
				}
			}))
			defer provider.Close()
			name := provider.Listener.Addr().String()
			tr := NewTransport(srv.Client(t), tc.passed, tc.opts...)
			if err := tr.Limiter().SetLimit(ctx, name, tc.override); err != nil {
				t.Fatal(err)
			}
			resp, err := (&http.Client{Transport: tr}).Get(provider.URL)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			_ = tr.Limiter().updates.running.Wait(context.Background())
			st, err := tr.Limiter().Status(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("passed %v, override %v: %.2f tokens left, want about %v", tc.passed, tc.override, st.Tokens, tc.want)
			if math.Abs(st.Tokens-tc.want) > 0.5 {
				t.Errorf("%.2f tokens left, want about %v", st.Tokens, tc.want)
			}
		})
	}
}

// TestSettleIsBounded: a response that reports an absurd usage puts no
// more debt on the bucket than the longest pause, and the rest is counted.
func TestSettleIsBounded(t *testing.T) {
	srv := redistest.Start(t)
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	provider := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer provider.Close()
	lim := Limit{Rate: 10, Burst: 10}
	tr := NewTransport(srv.Client(t), lim, WithMaxPause(10*time.Second), WithMeterProvider(mp),
		WithSettle(func(*http.Response) (float64, bool) { return 1e12, true }))
	resp, err := (&http.Client{Transport: tr}).Get(provider.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	_ = tr.Limiter().updates.running.Wait(context.Background())
	st, err := tr.Limiter().Status(context.Background(), provider.Listener.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	var cut float64
	if m := find(rm, "quota.settle.cut"); m != nil {
		for _, dp := range m.Data.(metricdata.Sum[float64]).DataPoints {
			cut += dp.Value
		}
	}
	t.Logf("a settle of 1e12 at 10/s, WithMaxPause(10s): queue %v, %.0f tokens cut", st.Queue, cut)
	if st.Queue > 11*time.Second || st.Queue < 9*time.Second {
		t.Errorf("queue %v after an absurd settle, want about the longest pause, 10s", st.Queue)
	}
	if want := 1e12 - 1 - 100; math.Abs(cut-want) > 1 {
		t.Errorf("quota.settle.cut = %v, want %v", cut, want)
	}
}

// TestMissedAnnouncementBound: a Limiter that misses the announcement of
// a pause grants nothing new (every take finds the pause in the script),
// and its callers already sleeping on grants learn of it within
// control.WaitRefresh: at most rate x control.WaitRefresh of their grants go.
func TestMissedAnnouncementBound(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	ls := fleetOf(t, srv, 2)
	operator := NewLimiter(srv.Client(t))
	lim := Limit{Rate: 100, Burst: 1}
	const name = "deaf"
	start := time.Now()
	stop := start.Add(3 * time.Second)
	done := arrivals(t, ls, 20, name, lim, stop)
	time.Sleep(time.Second)
	recordOp(t, operator, name, store.RecordOp{Op: "hold", Hold: 1500 * time.Millisecond}, "") // announced to no one
	paused := time.Now()
	woke := done()
	late := between(woke, paused.Add(20*time.Millisecond), paused.Add(1500*time.Millisecond))
	allowed := int(lim.Rate*control.WaitRefresh.Seconds()) + 2
	settled := between(woke, paused.Add(control.WaitRefresh+100*time.Millisecond), paused.Add(1500*time.Millisecond))
	t.Logf("a pause of 1.5s announced to no one: %d grants after it (bound %d), %d after %v", late, allowed, settled, control.WaitRefresh+100*time.Millisecond)
	if late > allowed {
		t.Errorf("%d grants inside a pause the Limiters missed, bound %d", late, allowed)
	}
	if settled != 0 {
		t.Errorf("%d grants once the Limiters read the pause", settled)
	}
}

// TestOneSubscriptionPerLimiter: however many buckets a Limiter uses, with
// sleepers, slot waiters and pauses, it holds one pub/sub connection; and
// Transports that share it through WithLimiter add none.
func TestOneSubscriptionPerLimiter(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := NewLimiter(rdb)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	provider := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer provider.Close()
	var trs []*Transport
	for range 3 {
		trs = append(trs, NewTransport(nil, PerSecond(100), WithLimiter(l), WithConcurrency(1)))
	}
	var wg sync.WaitGroup
	for i := range 40 {
		name := fmt.Sprintf("bucket-%d", i%20)
		wg.Go(func() {
			_ = l.Wait(ctx, name, Limit{Rate: 5, Burst: 1}) // sleepers
			slot, err := l.AcquireSlot(ctx, name, 1)        // slot waiters
			if err == nil {
				time.Sleep(50 * time.Millisecond)
				slot.Release()
			}
		})
	}
	for _, tr := range trs {
		wg.Go(func() {
			if resp, err := (&http.Client{Transport: tr}).Get(provider.URL); err == nil {
				resp.Body.Close()
			}
		})
	}
	if err := l.Pause(ctx, "bucket-3", 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	admin := srv.Client(t)
	subs, err := admin.PubSubNumSub(ctx, l.cfg.prefix+control.Channel).Result()
	if err != nil {
		t.Fatal(err)
	}
	channels, err := admin.PubSubChannels(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	t.Logf("20 buckets, sleepers, slot waiters, a pause and 3 Transports on one Limiter: %d subscribers of %s; channels %v",
		subs[l.cfg.prefix+control.Channel], l.cfg.prefix+control.Channel, channels)
	if n := subs[l.cfg.prefix+control.Channel]; n != 1 {
		t.Errorf("%d subscriptions, want 1", n)
	}
	if len(channels) != 1 {
		t.Errorf("channels subscribed: %v, want the control channel alone", channels)
	}
}

// TestEveryScriptHonoursWithClock: under WithClock, the slots, the pause
// and the fleet's roll call are reckoned on the callers' clock.
func TestEveryScriptHonoursWithClock(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ahead := 1000 * time.Hour
	clock := func() time.Time { return time.Now().Add(ahead) }
	l := NewLimiter(rdb, WithClock(clock), WithPolicy(FallbackLocal(2).CountingWorkers()))
	ctx := context.Background()
	near := func(what string, got, want time.Time) {
		t.Helper()
		t.Logf("%s: %v ahead of this machine's clock", what, time.Until(got).Round(time.Minute))
		if d := got.Sub(want); d < -time.Minute || d > time.Minute {
			t.Errorf("%s at %v, want %v (the callers' clock)", what, got, want)
		}
	}
	slot, err := l.AcquireSlot(ctx, "clocked", 2)
	if err != nil {
		t.Fatal(err)
	}
	defer slot.Release()
	key, _ := bucketKey(l.cfg.prefix, "clocked")
	held, err := rdb.ZRangeWithScores(ctx, key+slots.HeldSuffix, 0, -1).Result()
	if err != nil || len(held) != 1 {
		t.Fatalf("slots held: %v, %v", held, err)
	}
	near("the slot's lease ends", time.UnixMicro(int64(held[0].Score)), clock().Add(l.cfg.slotLease))
	if err := l.Pause(ctx, "clocked", time.Minute); err != nil {
		t.Fatal(err)
	}
	st, err := l.Status(ctx, "clocked")
	if err != nil {
		t.Fatal(err)
	}
	near("the pause began", st.PausedSince, clock())
	if err := l.Wait(ctx, "roll-call", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	var beat []redis.Z
	eventually(t, 5*time.Second, "the roll call", func() bool {
		beat, _ = rdb.ZRangeWithScores(ctx, l.cfg.prefix+"workers", 0, -1).Result()
		return len(beat) == 1
	})
	near("the roll call lapses", time.UnixMilli(int64(beat[0].Score)), clock().Add(local.BeatTTL))
	if d := l.resumeIn(ctx); d <= 0 {
		t.Errorf("resumeIn = %v, want the delay ahead", d)
	}
	at, err := rdb.Get(ctx, l.cfg.prefix+"resume").Int64()
	if err != nil {
		t.Fatal(err)
	}
	near("the fleet resumes", time.UnixMicro(at), clock().Add(resumeDelay))
}

// TestLocalQueuesKeyedByTheBoundedKey: what FallbackLocal remembers of
// each bucket's queue is keyed by the bucket's key, which is bounded, not
// by its name, which is not.
func TestLocalQueuesKeyedByTheBoundedKey(t *testing.T) {
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t), WithPolicy(FallbackLocal(2)))
	ctx := context.Background()
	lim := Limit{Rate: 1000, Burst: 1}
	for i := range 20 {
		name := fmt.Sprintf("%d-%s", i, strings.Repeat("n", 100_000))
		for range 3 { // a queue: the second and third wait
			if err := l.Wait(ctx, name, lim); err != nil {
				t.Fatal(err)
			}
		}
	}
	longest, n := 0, 0
	for _, k := range l.locals.QueueKeys() {
		longest, n = max(longest, len(k)), n+1
	}
	t.Logf("20 names of 100 kB with a queue: %d queues remembered, the longest key %d bytes", n, longest)
	if n == 0 {
		t.Fatal("no queue remembered: the test shows nothing")
	}
	if bound := len(l.cfg.prefix) + len("{}") + store.MaxNameLen + 2; longest > bound {
		t.Errorf("a queue kept under %d bytes, bound %d", longest, bound)
	}
}

// TestListenerResubscribes: when its connection is killed, the Limiter's
// one subscription comes back, and announcements reach it again.
func TestListenerResubscribes(t *testing.T) {
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	admin := srv.Client(t)
	ctx := context.Background()
	channel := l.cfg.prefix + control.Channel
	// subscriber returns the id of the one client subscribed, or "".
	subscriber := func() string {
		n, _ := admin.PubSubNumSub(ctx, channel).Result()
		list, _ := admin.ClientList(ctx).Result()
		for line := range strings.SplitSeq(list, "\n") {
			if strings.Contains(line, " sub=1 ") && n[channel] == 1 {
				id, _, _ := strings.Cut(line, " ")
				return id
			}
		}
		return ""
	}
	if err := l.Wait(ctx, "resubscribed", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	var first string
	eventually(t, 5*time.Second, "the subscription", func() bool { first = subscriber(); return first != "" })
	if err := admin.ClientKillByFilter(ctx, "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	took := eventually(t, 10*time.Second, "the subscription again", func() bool {
		id := subscriber()
		return id != "" && id != first
	})
	// An announcement reaches it: a pause that another Limiter sets is
	// known here well before a refresh would read it.
	if err := NewLimiter(srv.Client(t)).Pause(ctx, "resubscribed", time.Minute); err != nil {
		t.Fatal(err)
	}
	e := l.controls.Lookup(mustKey(t, l, "resubscribed"))
	heard := eventually(t, 5*time.Second, "the pause", func() bool {
		_, _, paused := e.Load().PausedAt(time.Now())
		return paused
	})
	t.Logf("subscribed again %v after CLIENT KILL TYPE pubsub; a pause known %v after it was set", took.Round(time.Millisecond), heard.Round(time.Millisecond))
	if heard > 500*time.Millisecond {
		t.Errorf("the pause was known after %v: not by its announcement", heard)
	}
}

func mustKey(t *testing.T, l *Limiter, name string) string {
	t.Helper()
	key, err := bucketKey(l.cfg.prefix, name)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// TestShortSleeperHearsTheResume: a caller sleeping on a grant due within
// moments, which a pause with no end then holds, learns of the resume
// within a second although its announcement is lost.
func TestShortSleeperHearsTheResume(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	const name = "short-sleeper"
	lim := Limit{Rate: 5, Burst: 1}
	if err := l.Wait(ctx, name, lim); err != nil { // the one token
		t.Fatal(err)
	}
	returned := make(chan time.Time, 1)
	go func() {
		if err := l.Wait(ctx, name, lim); err != nil { // due in 200 ms
			t.Error(err)
		}
		returned <- time.Now()
	}()
	time.Sleep(20 * time.Millisecond)
	if err := operator.Pause(ctx, name, Forever); err != nil {
		t.Fatal(err)
	}
	select {
	case at := <-returned:
		t.Fatalf("the sleeper returned during the pause, %v after the call", time.Since(at))
	case <-time.After(time.Second):
	}
	recordOp(t, operator, name, store.RecordOp{Op: "resume"}, "") // announced to no one
	resumed := time.Now()
	select {
	case at := <-returned:
		t.Logf("a sleeper held by a pause with no end returned %v after its resume, announced to no one", at.Sub(resumed).Round(time.Millisecond))
		if d := at.Sub(resumed); d > time.Second {
			t.Errorf("the sleeper returned %v after the resume, want within 1s", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the sleeper still sleeps 5s after the resume")
	}
}

// TestAllowAfterAnUnheardResume: a Limiter that read a pause with no end
// grants Allow as soon as another resumes the bucket, announcement heard
// or not: the script decides with the record as it is, not the Limiter
// with what it read.
func TestAllowAfterAnUnheardResume(t *testing.T) {
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	lim := PerSecond(10)
	if err := operator.Pause(ctx, "unheard", Forever); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.Allow(ctx, "unheard", lim); ok || err != nil {
		t.Fatalf("Allow during the pause = %v, %v; want false", ok, err)
	}
	e := l.controls.Lookup("quota:{unheard}")
	if _, _, paused := e.Load().PausedAt(time.Now()); !paused {
		t.Fatal("the Limiter did not read the pause: the test shows nothing")
	}
	recordOp(t, operator, "unheard", store.RecordOp{Op: "resume"}, "") // announced to no one
	if ok, err := l.Allow(ctx, "unheard", lim); !ok || err != nil {
		t.Errorf("Allow just after the resume = %v, %v; want true", ok, err)
	}
}
