package quota

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
)

// The fault tests run workers, each a Transport with a Limiter and a Redis
// client of its own, against a provider that records when requests arrive,
// and break the real redis-server under them.

// provider is an HTTP server that records arrival times.
type provider struct {
	*httptest.Server
	mu       sync.Mutex
	arrivals []time.Time
}

func newProvider(t *testing.T) *provider {
	p := &provider{}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		p.mu.Lock()
		p.arrivals = append(p.arrivals, time.Now())
		p.mu.Unlock()
	}))
	t.Cleanup(p.Close)
	return p
}

// between returns the arrivals in [from, to), sorted.
func (p *provider) between(from, to time.Time) []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Time
	for _, a := range p.arrivals {
		if !a.Before(from) && a.Before(to) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out
}

// faultOptions are a limiter's Redis client options for the tests that
// break Redis under a running fleet: those of the README, with timeouts
// long enough that two busy cores do not pass for an outage.
func faultOptions(addr string) *redis.Options {
	o := limiterOptions(addr)
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
	return o
}

// worker is one member of the fleet.
type worker struct {
	tr   *Transport
	logs *logRecorder
}

func newWorkers(t *testing.T, n int, addr string, lim Limit, p Policy, opts func(*redis.Options)) []worker {
	return newWorkersOn(t, n, lim, p, func() redis.Scripter {
		o := faultOptions(addr)
		if opts != nil {
			opts(o)
		}
		rdb := redis.NewClient(o)
		t.Cleanup(func() { rdb.Close() })
		return rdb
	})
}

// newWorkersOn returns n workers, each with a Redis client of its own from
// client.
func newWorkersOn(t *testing.T, n int, lim Limit, p Policy, client func() redis.Scripter) []worker {
	var ws []worker
	for range n {
		logs := &logRecorder{}
		ws = append(ws, worker{NewTransport(client(), lim, WithPolicy(p), WithLogger(slog.New(logs))), logs})
	}
	return ws
}

// result is what one request through a worker came to.
type result struct {
	start time.Time
	took  time.Duration
	err   error
}

// drive sends requests through every worker from goroutines each, until
// stop is closed, and returns what each request came to.
func drive(ws []worker, goroutines int, url string, stop <-chan struct{}) []result {
	var (
		mu  sync.Mutex
		res []result
		wg  sync.WaitGroup
	)
	for _, w := range ws {
		client := &http.Client{Transport: w.tr}
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					start := time.Now()
					resp, err := client.Post(url, "text/plain", strings.NewReader("x"))
					if err == nil {
						resp.Body.Close()
					} else {
						time.Sleep(time.Millisecond) // a refusing worker does not spin
					}
					mu.Lock()
					res = append(res, result{start, time.Since(start), err})
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	return res
}

// logTime returns when the first record containing msg was written.
func logTime(t *testing.T, logs *logRecorder, msg string) time.Time {
	t.Helper()
	r, ok := logs.First(msg)
	if !ok {
		t.Fatalf("no record %q:\n%s", msg, logs)
	}
	return r.Time
}

func checkTransitions(t *testing.T, ws []worker, level slog.Level) {
	t.Helper()
	for i, w := range ws {
		down, up := w.logs.Count(level, "Redis unavailable"), w.logs.Count(slog.LevelInfo, "available again")
		if down != 1 || up != 1 {
			t.Errorf("worker %d: %d outage and %d recovery records, want one each:\n%s", i, down, up, w.logs)
		}
	}
}

func TestFaultKilledAndRestarted(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	prov := newProvider(t)
	lim := Limit{Rate: 20, Burst: 10}
	const workers = 2
	ws := newWorkers(t, workers, srv.Addr(), lim, FallbackLocal(workers), nil)

	stop := make(chan struct{})
	done := make(chan []result)
	start := time.Now()
	go func() { done <- drive(ws, 5, prov.URL, stop) }()

	time.Sleep(1500 * time.Millisecond)
	srv.Kill()
	killed := time.Now()
	time.Sleep(2 * time.Second)
	srv.Restart()
	restarted := time.Now()
	time.Sleep(2 * time.Second)
	close(stop)
	<-done
	end := time.Now()

	for i, w := range ws {
		if m := w.tr.Limiter().Mode(); m != ModeShared {
			t.Errorf("worker %d: mode %v after the restart, want shared", i, m)
		}
		t.Logf("worker %d: outage detected %v after the kill, shared again %v after the restart",
			i, logTime(t, w.logs, "Redis unavailable").Sub(killed), logTime(t, w.logs, "available again").Sub(restarted))
	}
	checkTransitions(t, ws, slog.LevelWarn)

	// The local shares start empty and the fleet hands them back to the
	// shared bucket at one instant, lowered to what they hold: the outage
	// adds nothing to Burst + Rate but the wake-ups' jitter.
	all := prov.between(start, end)
	jitter := int(lim.Rate/10) + 1
	got, limit := maxInWindow(all, time.Second), bound(lim, time.Second)+jitter
	t.Logf("provider: %d requests; at most %d in any 1s window (bound Burst+Rate = %d, and %d for jitter)", len(all), got, bound(lim, time.Second), jitter)
	if got > limit {
		t.Errorf("%d requests in a 1s window, bound %d; per 100ms: %v", got, limit, histogram(all, start, 100*time.Millisecond))
	}
	outage := prov.between(killed.Add(200*time.Millisecond), restarted)
	t.Logf("during the outage: %d requests in %v, at most %d in any 1s window", len(outage), restarted.Sub(killed), maxInWindow(outage, time.Second))
	if want := int(0.5 * lim.Rate * restarted.Sub(killed).Seconds()); len(outage) < want {
		t.Errorf("%d requests during the outage, want at least %d: the fallback stalled", len(outage), want)
	}
	if after := prov.between(restarted.Add(time.Second), end); len(after) < int(0.5*lim.Rate) {
		t.Errorf("%d requests in the last second, want the shared bucket's rate", len(after))
	}
}

// TestFaultHung: a Redis that stops answering costs each request at most
// one read timeout, and once the breaker has tripped, requests go to the
// policy without asking Redis: the only Redis calls while it hangs are the
// probe's.
func TestFaultHung(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	const readTimeout = 500 * time.Millisecond
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
			time.Sleep(1500 * time.Millisecond)
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
			p99 := degraded[n*99/100]
			for i, w := range ws {
				t.Logf("worker %d: outage detected %v after the hang, shared again %v after Redis answered",
					i, logTime(t, w.logs, "Redis unavailable").Sub(hung), logTime(t, w.logs, "available again").Sub(resumed))
			}
			t.Logf("slowest request %v (Redis read timeout %v); %d requests while degraded, p99 %v, the slowest %v, with %d Redis calls (the probes')",
				worst, readTimeout, n, p99, degraded[n-1], during)
			// A request pays at most one read timeout: two would take twice.
			if worst >= 2*readTimeout {
				t.Errorf("a request took %v, want less than two read timeouts (%v)", worst, 2*readTimeout)
			}
			// Latency while degraded is the machine's: a request that paid a
			// Redis timeout would take the whole of it, and they all would.
			if p99 >= readTimeout/2 {
				t.Errorf("p99 %v while degraded, want no Redis timeout paid", p99)
			}
			// Each worker's probe backs off to 500 ms: a handful of calls
			// in 1.5 s, against the hundreds of requests served meanwhile.
			if n < 100 || during > 10 {
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

// A reply lost after the script ran (a read timeout) leaves its tokens
// taken: the bucket under-issues, never over-issues. go-redis retries a
// timed-out read MaxRetries times, and each retry can take them again.
func TestFaultLostReply(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		retries int
		taken   int // tokens the lost reply costs
		fails   bool
	}{
		{retries: -1, taken: 1, fails: true},
		{retries: 3, taken: 2, fails: false}, // the retry's reply arrives
	} {
		srv := redistest.Start(t)
		admin := srv.Client(t)
		proxy := faultproxy.New(t, srv.Addr())
		ws := newWorkers(t, 1, proxy.Addr(), Limit{Rate: 1, Burst: 10}, FailClosed, func(o *redis.Options) {
			o.MaxRetries = tc.retries
			o.ReadTimeout = 200 * time.Millisecond
		})
		l, ctx := ws[0].tr.Limiter(), context.Background()
		lim := Limit{Rate: 1, Burst: 10}
		if err := l.Wait(ctx, "lost", lim); err != nil {
			t.Fatal(err)
		}
		// Once it listens, the Limiter reads the record again, in the
		// background, for what it may have missed: let that read land, so
		// that the reply dropped is the take's.
		<-l.events.Ready()
		listening := l.events.Since()
		e := l.controls.Lookup("quota:{lost}")
		eventually(t, 5*time.Second, "the read after listening", func() bool {
			return !e.Reading() && e.Load().ReadAt().After(listening)
		})
		before, _ := admin.Get(ctx, "quota:{lost}").Float64()
		proxy.DropNextReplies(1)
		err := l.Wait(ctx, "lost", lim)
		after, _ := admin.Get(ctx, "quota:{lost}").Float64()
		taken := (after - before) / 1e6 // one token is a second of refill
		t.Logf("MaxRetries %d: Wait returned %v; the bucket lost %.3f tokens", tc.retries, err, taken)
		if tc.fails != (err != nil) {
			t.Errorf("MaxRetries %d: err = %v", tc.retries, err)
		}
		if taken < float64(tc.taken)-0.001 || taken > float64(tc.taken)+0.001 {
			t.Errorf("MaxRetries %d: a lost reply took %.3f tokens, want %d", tc.retries, taken, tc.taken)
		}
	}
}

func TestFaultRestartedEmptyStartsFull(t *testing.T) {
	srv := redistest.Start(t)
	ws := newWorkers(t, 1, srv.Addr(), Limit{Rate: 1, Burst: 5}, FailClosed, nil)
	l, ctx := ws[0].tr.Limiter(), context.Background()
	lim := Limit{Rate: 1, Burst: 5}
	if err := l.WaitN(ctx, "empty", 5, lim); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	srv.Restart()
	// The bucket was empty before the restart; Redis forgot it, and it
	// releases a whole burst at once. (The first call may find a connection
	// of the old server and trip the breaker: then ask again once the
	// shared bucket is back.)
	for {
		short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		start := time.Now()
		err := l.WaitN(short, "empty", 5, lim)
		cancel()
		if errors.Is(err, ErrUnavailable) {
			waitForMode(t, l, ModeShared, 3*time.Second)
			continue
		}
		if err != nil {
			t.Fatalf("a burst of 5 after the restart: %v", err)
		}
		t.Logf("a full burst of 5 granted in %v after the restart", time.Since(start))
		break
	}
}
