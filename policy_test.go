package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of the outage policies and modes (policy.go): FailOpen, FailClosed
// and FallbackLocal's modes and logs, counted workers, the breaker and its
// probe, and fleets through a Redis that is killed or hangs.
// FallbackLocal's local shares and hand-over are tested in
// fallback_test.go.

func TestPolicies(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 10}
	for _, tc := range []struct {
		policy Policy
		mode   Mode
		level  slog.Level
		check  func(t *testing.T, l *Limiter)
	}{
		{FailClosed, ModeClosed, slog.LevelError, func(t *testing.T, l *Limiter) {
			start := time.Now()
			for range 100 {
				if err := l.Wait(ctx, "k", lim); !errors.Is(err, ErrUnavailable) {
					t.Fatalf("err = %v, want ErrUnavailable", err)
				}
			}
			if d := time.Since(start); d > 100*time.Millisecond {
				t.Errorf("100 refusals took %v: the breaker still pays Redis", d)
			}
		}},
		{Policy{}, ModeClosed, slog.LevelError, func(t *testing.T, l *Limiter) {
			if err := l.Wait(ctx, "k", lim); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("the zero Policy: err = %v, want ErrUnavailable", err)
			}
		}},
		{FailOpen, ModeOpen, slog.LevelError, func(t *testing.T, l *Limiter) {
			for range 1000 {
				if err := l.Wait(ctx, "k", lim); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{FallbackLocal(4), ModeLocal, slog.LevelWarn, func(t *testing.T, l *Limiter) {
			// A quarter of the limit, 25 a second, starting empty: 7
			// tokens take 280ms.
			start := time.Now()
			for range 7 {
				if err := l.Wait(ctx, "k", lim); err != nil {
					t.Fatal(err)
				}
			}
			if d := time.Since(start); d < 150*time.Millisecond || d > 500*time.Millisecond {
				t.Errorf("7 tokens from an empty local 25/s bucket took %v, want about 280ms", d)
			}
		}},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			mr, l, logs := degradedMini(t, tc.policy)
			if err := l.Wait(ctx, "k", lim); err != nil {
				t.Fatal(err)
			}
			mr.Close()
			// The request that finds Redis gone is served by the policy too.
			err := l.Wait(ctx, "k", lim)
			if tc.mode == ModeClosed != errors.Is(err, ErrUnavailable) {
				t.Fatalf("first request after the outage: err = %v", err)
			}
			if l.Mode() != tc.mode {
				t.Fatalf("Mode() = %v, want %v", l.Mode(), tc.mode)
			}
			tc.check(t, l)
			if err := mr.Restart(); err != nil {
				t.Fatal(err)
			}
			took := waitForMode(t, l, ModeShared, 3*time.Second)
			t.Logf("shared again %v after Redis came back", took)
			if n := logs.Count(tc.level, "Redis unavailable"); n != 1 {
				t.Errorf("%d records at %v of the outage, want 1:\n%s", n, tc.level, logs)
			}
			// The breaker closes, then the Limiter logs it: the record
			// follows the mode.
			eventually(t, 2*time.Second, "the recovery record", func() bool { return logs.Count(slog.LevelInfo, "available again") > 0 })
			if n := logs.Count(slog.LevelInfo, "available again"); n != 1 {
				t.Errorf("%d recovery records, want 1:\n%s", n, logs)
			}
			if err := l.Wait(ctx, "k", lim); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestOutageLogRecord(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	mr, l, logs := degradedMini(t, FallbackLocal(3))
	addr := mr.Addr()
	mr.Close()
	_ = l.Wait(context.Background(), "api.example.com", PerSecond(10))
	r, ok := logs.First("Redis unavailable")
	if !ok {
		t.Fatal("no record of the outage")
	}
	attrs := map[string]string{}
	r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	for k, want := range map[string]string{"redis": addr, "bucket": "api.example.com", "policy": "fallback local (3 workers)", "mode": "local"} {
		if attrs[k] != want {
			t.Errorf("record attribute %s = %q, want %q", k, attrs[k], want)
		}
	}
	if attrs["cause"] == "" {
		t.Error("the record does not say what failed")
	}
}

func TestCountingWorkers(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	mr := miniredis.RunT(t)
	policy := FallbackLocal(2).CountingWorkers()
	var ls []*Limiter
	for range 5 {
		rdb := redis.NewClient(limiterOptions(mr.Addr()))
		t.Cleanup(func() { rdb.Close() })
		ls = append(ls, NewLimiter(rdb, WithPolicy(policy), WithLogger(slog.New(&logRecorder{}))))
	}
	// A Limiter that never saw a count divides by the floor.
	if d := ls[0].workers.Divisor(policy.workers); d != 2 {
		t.Errorf("divisor before any count = %d, want the floor 2", d)
	}
	for i, l := range ls {
		if err := l.Wait(context.Background(), "k", PerSecond(100)); err != nil {
			t.Fatal(err)
		}
		// The announcements run in the background: let each land before the
		// next, so that the last Limiter counts all five.
		eventually(t, 2*time.Second, fmt.Sprintf("worker %d to announce itself", i+1), func() bool {
			m, _ := mr.ZMembers("quota:workers")
			return len(m) == i+1
		})
	}
	l := ls[len(ls)-1]
	eventually(t, 2*time.Second, "a divisor of 5 after 5 workers announced themselves", func() bool { return l.workers.Divisor(policy.workers) == 5 })
	if n, _ := mr.ZMembers("quota:workers"); len(n) != 5 {
		t.Errorf("%d announcements in Redis, want 5", len(n))
	}
	// The count never drops below the floor, and a smaller count does not
	// lower the peak while it is held.
	l.workers.Saw(1)
	if d := l.workers.Divisor(policy.workers); d != 5 {
		t.Errorf("divisor after a count of 1 = %d, want the held peak 5", d)
	}
	if d := l.workers.Divisor(8); d != 8 {
		t.Errorf("divisor with a floor of 8 = %d, want 8", d)
	}

	// In an outage, the last Limiter grants at a fifth of the rate.
	mr.Close()
	lim := Limit{Rate: 50, Burst: 5}
	start := time.Now()
	for range 6 { // from an empty local share at 10 a second
		if err := l.Wait(context.Background(), "k", lim); err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 400*time.Millisecond || d > 900*time.Millisecond {
		t.Errorf("6 tokens at a fifth of 50/s took %v, want about 600ms", d)
	}
	if l.Mode() != ModeLocal {
		t.Errorf("Mode() = %v, want local", l.Mode())
	}
}

func TestPolicyConstructionErrors(t *testing.T) {
	mustPanic(t, "FallbackLocal(0)", func() { FallbackLocal(0) })
	mustPanic(t, "FallbackLocal(-1)", func() { FallbackLocal(-1) })
	mustPanic(t, "FailOpen.CountingWorkers()", func() { FailOpen.CountingWorkers() })
	for p, want := range map[*Policy]string{&FailOpen: "fail open", &FailClosed: "fail closed"} {
		if p.String() != want {
			t.Errorf("String() = %q, want %q", p.String(), want)
		}
	}
	if s := FallbackLocal(3).CountingWorkers().String(); s != "fallback local (counted workers, at least 3)" {
		t.Errorf("String() = %q", s)
	}
	if s := Mode(9).String(); s != "Mode(9)" {
		t.Errorf("Mode(9).String() = %q", s)
	}
}

// A quiet outage does not outlive Redis: once the probe has stopped for
// want of requests, the Limiter no longer reports the outage, and the next
// request asks Redis itself.
func TestQuietOutageEndsWithRedis(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	logs := &logRecorder{}
	rdb := redis.NewClient(limiterOptions(srv.Addr()))
	defer rdb.Close()
	setProbeIdle(t, 300*time.Millisecond)
	l := NewLimiter(rdb, WithLogger(slog.New(logs))) // FailClosed
	ctx := context.Background()
	lim := PerSecond(10)
	if err := l.Wait(ctx, "quiet", lim); err != nil {
		t.Fatal(err)
	}

	srv.Kill()
	if err := l.Wait(ctx, "quiet", lim); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Wait with Redis killed = %v, want ErrUnavailable", err)
	}
	if l.Mode() != ModeClosed {
		t.Fatalf("mode %v with Redis killed, want closed", l.Mode())
	}
	// Nobody asks for a while: the probe stops, and the Limiter stops
	// claiming an outage it no longer checks.
	waitForMode(t, l, ModeShared, 10*time.Second)
	// The record of the change follows the change: on a busy machine, a
	// moment later.
	stopped := func() int { return logs.Count(slog.LevelWarn, "the next one asks Redis") }
	eventually(t, 2*time.Second, "the record of the probe stopping", func() bool { return stopped() > 0 })
	if n := stopped(); n != 1 {
		t.Errorf("%d records of the probe stopping, want 1:\n%s", n, logs)
	}

	srv.Restart()
	time.Sleep(100 * time.Millisecond)
	if err := l.Wait(ctx, "quiet", lim); err != nil {
		t.Fatalf("Wait after Redis came back during the quiet = %v, want a grant", err)
	}

	// And a request after a quiet outage that is still on finds it.
	srv.Kill()
	if err := l.Wait(ctx, "quiet", lim); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Wait with Redis killed again = %v, want ErrUnavailable", err)
	}
	waitForMode(t, l, ModeShared, 10*time.Second)
	if err := l.Wait(ctx, "quiet", lim); !errors.Is(err, ErrUnavailable) || l.Mode() != ModeClosed {
		t.Fatalf("the first request after a quiet outage that goes on: %v in mode %v, want ErrUnavailable in closed", err, l.Mode())
	}
}

// TestFaultHung: a Redis that stops answering costs each request at most
// one read timeout, and once the breaker has tripped, requests go to the
// policy without asking Redis: the only Redis calls while it hangs are the
// probe's.
func TestFaultHung(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	const readTimeout = time.Second
	for _, tc := range []struct {
		name      string
		hang, end func()
		addr      string
	}{
		{name: "SIGSTOP"},
		{name: "blackhole"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.Start(t)
			addr := srv.Addr()
			hang, resume := srv.Pause, srv.Resume
			if tc.name == "blackhole" {
				proxy := faultproxy.New(t, srv.Addr())
				addr = proxy.Addr()
				hang, resume = func() { proxy.Blackhole(true) }, func() { proxy.Blackhole(false) }
			}
			prov := newProvider(t)
			// A bucket that never makes anyone wait: every millisecond a
			// request takes beyond the provider's is the limiter's.
			lim := Limit{Rate: 10_000, Burst: 10_000}
			cmds := newCmdCounter()
			ws := newWorkersOn(t, 2, lim, FallbackLocal(2), func() redis.Scripter {
				o := faultOptions(addr)
				o.ReadTimeout, o.WriteTimeout = readTimeout, readTimeout
				rdb := redis.NewClient(o)
				rdb.AddHook(cmds)
				t.Cleanup(func() { rdb.Close() })
				return rdb
			})

			stop := make(chan struct{})
			done := make(chan []result)
			go func() { done <- drive(ws, 5, prov.URL, stop) }()
			time.Sleep(500 * time.Millisecond)
			hang()
			hung := time.Now()
			time.Sleep(2 * readTimeout) // every call in flight has timed out
			before := cmds.total()
			time.Sleep(1500 * time.Millisecond)
			during := cmds.total() - before
			resume()
			resumed := time.Now()
			// Shared again about a second later (a probe, then the resume
			// instant), later on a loaded machine: the test waits for it.
			eventually(t, 10*time.Second, "both workers shared again", func() bool {
				for _, w := range ws {
					if _, ok := w.logs.First("available again"); !ok {
						return false
					}
				}
				return true
			})
			time.Sleep(500 * time.Millisecond)
			close(stop)
			res := <-done

			var worst time.Duration
			var degraded []time.Duration
			for _, r := range res {
				if r.err != nil {
					t.Errorf("a request failed: %v", r.err)
					break
				}
				worst = max(worst, r.took)
				if r.start.After(hung.Add(2*readTimeout)) && r.start.Before(resumed) {
					degraded = append(degraded, r.took)
				}
			}
			slices.Sort(degraded)
			n := len(degraded)
			if n == 0 {
				t.Fatal("no request while degraded")
			}
			median, p99 := degraded[n/2], degraded[n*99/100]
			for i, w := range ws {
				t.Logf("worker %d: outage detected %v after the hang, shared again %v after Redis answered",
					i, logTime(t, w.logs, "Redis unavailable").Sub(hung), logTime(t, w.logs, "available again").Sub(resumed))
			}
			t.Logf("slowest request %v (Redis read timeout %v); %d requests while degraded, median %v, p99 %v, the slowest %v, with %d Redis calls (the probes')",
				worst, readTimeout, n, median, p99, degraded[n-1], during)
			// A request pays at most one read timeout: two would take twice.
			if worst >= 2*readTimeout {
				t.Errorf("a request took %v, want less than two read timeouts (%v)", worst, 2*readTimeout)
			}
			// Latency while degraded is the machine's: a request that paid a
			// Redis timeout would take the whole of it, and they all would
			// (the tail is the loaded machine's: a busy CI run's p99 was
			// 590 ms).
			if median >= readTimeout/2 {
				t.Errorf("median %v while degraded, want no Redis timeout paid", median)
			}
			// Each worker's probe backs off to 500 ms: a handful of calls
			// in 1.5 s, against the requests served meanwhile, thousands
			// on a quiet machine and 82 in a CI run whose test process a
			// flood of goroutines beside this test slowed.
			if n < 40 || during > 10 || during*4 > n {
				t.Errorf("%d requests while degraded made %d Redis calls, want only the probes' (at most 10)", n, during)
			}
			checkTransitions(t, ws, slog.LevelWarn)
		})
	}
}

func TestFaultFailClosed(t *testing.T) {
	srv := redistest.Start(t)
	prov := newProvider(t)
	ws := newWorkers(t, 1, srv.Addr(), Limit{Rate: 10_000, Burst: 10_000}, FailClosed, nil)
	client := &http.Client{Transport: ws[0].tr}
	post := func() (time.Duration, *bodyRecorder, error) {
		body := &bodyRecorder{Reader: strings.NewReader("x")}
		req, _ := http.NewRequest("POST", prov.URL, body)
		start := time.Now()
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		return time.Since(start), body, err
	}
	if _, _, err := post(); err != nil {
		t.Fatal(err)
	}
	cmds := newCmdCounter()
	ws[0].tr.Limiter().store.Client().(*redis.Client).AddHook(cmds)
	srv.Kill()
	down := time.Now()
	var slowest time.Duration
	for i := range 200 {
		took, body, err := post()
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("request %d during the outage: err = %v, want ErrUnavailable", i, err)
		}
		if !body.closed.Load() {
			t.Fatalf("request %d: body not closed", i)
		}
		if i > 0 {
			slowest = max(slowest, took)
		}
	}
	if n := len(prov.between(down, time.Now())); n != 0 {
		t.Errorf("%d requests reached the provider while failing closed", n)
	}
	// The first refusal found the outage; the other 199 ask no Redis at
	// all (the probe's calls aside), so no timing of a busy machine can
	// make them slow.
	calls := cmds.total()
	t.Logf("slowest refusal after the first: %v; %d Redis calls for 200 refusals", slowest, calls)
	if calls > 5 {
		t.Errorf("200 refusals made %d Redis calls, want the first and the probe's", calls)
	}
	if slowest > 100*time.Millisecond {
		t.Errorf("a refusal took %v, want it fast", slowest)
	}
	srv.Restart()
	waitForMode(t, ws[0].tr.Limiter(), ModeShared, 3*time.Second)
	if _, _, err := post(); err != nil {
		t.Fatal(err)
	}
	checkTransitions(t, ws, slog.LevelError)
}

func TestFaultFailOpen(t *testing.T) {
	srv := redistest.Start(t)
	prov := newProvider(t)
	ws := newWorkers(t, 1, srv.Addr(), Limit{Rate: 1, Burst: 1}, FailOpen, nil)
	client := &http.Client{Transport: ws[0].tr}
	srv.Kill()
	for i := range 20 {
		resp, err := client.Get(prov.URL)
		if err != nil {
			t.Fatalf("request %d while failing open: %v", i, err)
		}
		resp.Body.Close()
	}
	if n := len(prov.between(time.Time{}, time.Now())); n != 20 {
		t.Errorf("%d requests reached the provider, want all 20", n)
	}
	if n := ws[0].logs.Count(slog.LevelError, "UNLIMITED"); n != 1 {
		t.Errorf("%d records that requests pass unlimited, want 1:\n%s", n, ws[0].logs)
	}
}

// setProbeIdle makes the Limiters made until the test ends stop their
// breaker's probe after d without a request.
func setProbeIdle(t *testing.T, d time.Duration) {
	old := probeIdle
	probeIdle = d
	t.Cleanup(func() { probeIdle = old })
}
