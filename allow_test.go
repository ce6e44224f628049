package quota

import (
	"context"
	"errors"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// limiterServer starts a redis-server and returns it with a client that
// has a limiter's options (short timeouts, no retries).
func limiterServer(t *testing.T) (*redistest.Server, *redis.Client) {
	t.Helper()
	srv := redistest.Start(t)
	return srv, srv.Client(t, func(o *redis.Options) { *o = *limiterOptions(srv.Addr()) })
}

// allowAtOnce runs allow in goroutines goroutines released together, and
// returns how many were allowed and the longest a call took.
func allowAtOnce(t *testing.T, goroutines int, allow func() (bool, error)) (allowed int, slowest time.Duration) {
	t.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex
	start := make(chan struct{})
	for range goroutines {
		wg.Go(func() {
			<-start
			begun := time.Now()
			ok, err := allow()
			took := time.Since(begun)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("Allow: %v", err)
			}
			if ok {
				allowed++
			}
			slowest = max(slowest, took)
		})
	}
	close(start)
	wg.Wait()
	return allowed, slowest
}

// The script grants exactly the burst to Allow calls racing for it, and a
// call that is refused neither waits nor takes anything.
func TestAllowGrantsTheBurstAndNeverWaits(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb)
	ctx := context.Background()

	// A token every 20s: nothing refills while the test runs, and each
	// refused call would otherwise have waited seconds to minutes.
	lim := Limit{Rate: 0.05, Burst: 10}
	allowed, slowest := allowAtOnce(t, 200, func() (bool, error) { return l.Allow(ctx, "burst", lim) })
	t.Logf("%d of 200 concurrent Allow calls allowed, the slowest took %v", allowed, slowest)
	if allowed != 10 {
		t.Errorf("%d of 200 concurrent Allow calls allowed, want the burst, 10", allowed)
	}
	if slowest > 2*time.Second {
		t.Errorf("an Allow call took %v; it must never wait (the shortest wait was 20s)", slowest)
	}
	if ok, err := l.Allow(ctx, "burst", lim); ok || err != nil {
		t.Errorf("Allow on the empty bucket = %v, %v; want false, nil", ok, err)
	}

	// A token a second: refused calls take nothing, so the token is there
	// again once a second has passed since the last grant.
	lim = Limit{Rate: 1, Burst: 1}
	if ok, err := l.Allow(ctx, "refill", lim); !ok || err != nil {
		t.Fatalf("Allow on a full bucket = %v, %v", ok, err)
	}
	granted := time.Now()
	refused := 0
	for time.Since(granted) < 300*time.Millisecond {
		if ok, err := l.Allow(ctx, "refill", lim); ok || err != nil {
			t.Fatalf("Allow %v after the last grant = %v, %v; want false, nil until the refill", time.Since(granted), ok, err)
		}
		refused++
	}
	time.Sleep(time.Until(granted.Add(1200 * time.Millisecond)))
	if ok, err := l.Allow(ctx, "refill", lim); !ok || err != nil {
		t.Errorf("Allow 1.2s after the last grant, after %d refusals = %v, %v; want true: a refusal takes nothing", refused, ok, err)
	}
}

func TestAllowPausedBucket(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 10}
	b, err := l.bucket("paused", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.store.Pause(ctx, b.Bucket, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	for i := range 5 {
		begun := time.Since(paused)
		ok, err := l.Allow(ctx, "paused", lim)
		if err != nil || ok && begun < 1500*time.Millisecond {
			t.Fatalf("Allow %d, called %v into a pause of 2s = %v, %v after %v; want false, nil at once", i, begun, ok, err, time.Since(paused)-begun)
		}
	}
	time.Sleep(time.Until(paused.Add(2200 * time.Millisecond)))
	if ok, err := l.Allow(ctx, "paused", lim); !ok || err != nil {
		t.Errorf("Allow after the pause = %v, %v; want true", ok, err)
	}
}

func TestAllowNLayers(t *testing.T) {
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	// The second layer binds: 3 tokens of the first layer's 5 go to
	// AllowN, and the refusals take nothing from the first layer.
	first, second := Limit{Rate: 0.05, Burst: 5}, Limit{Rate: 0.05, Burst: 3}
	allowed, _ := allowAtOnce(t, 50, func() (bool, error) { return l.AllowN(ctx, "layers", 1, first, second) })
	if allowed != 3 {
		t.Errorf("%d of 50 concurrent AllowN calls allowed, want 3, the second layer's burst", allowed)
	}
	alone, _ := allowAtOnce(t, 50, func() (bool, error) { return l.Allow(ctx, "layers", first) })
	if alone != 2 {
		t.Errorf("then %d Allow calls on the first layer alone allowed, want the 2 it has left", alone)
	}
	if ok, err := l.AllowN(ctx, "layers", 1, first, second); ok || err != nil {
		t.Errorf("AllowN on empty layers = %v, %v; want false, nil", ok, err)
	}
}

func TestAllowInvalidInput(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	lim := Limit{Rate: 1, Burst: 2}
	for _, tc := range []struct {
		name  string
		allow func() (bool, error)
		want  error
	}{
		{"zero rate", func() (bool, error) { return l.Allow(ctx, "k", Limit{}) }, ErrInvalidLimit},
		{"NaN rate", func() (bool, error) { return l.Allow(ctx, "k", Limit{Rate: math.NaN()}) }, ErrInvalidLimit},
		{"negative burst", func() (bool, error) { return l.Allow(ctx, "k", Limit{Rate: 1, Burst: -1}) }, ErrInvalidLimit},
		{"zero tokens", func() (bool, error) { return l.AllowN(ctx, "k", 0, lim) }, ErrInvalidTokens},
		{"infinite tokens", func() (bool, error) { return l.AllowN(ctx, "k", math.Inf(1), lim) }, ErrInvalidTokens},
		{"beyond the burst", func() (bool, error) { return l.AllowN(ctx, "k", 3, lim) }, ErrExceedsBurst},
		{"a layer's burst", func() (bool, error) { return l.AllowN(ctx, "k", 2, lim, Limit{Rate: 1, Burst: 1}) }, ErrExceedsBurst},
		{"empty name", func() (bool, error) { return l.Allow(ctx, "", lim) }, ErrInvalidKey},
		{"context ended", func() (bool, error) { return l.Allow(cancelled, "k", lim) }, context.Canceled},
	} {
		ok, err := tc.allow()
		if ok || !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, %v; want false and %v", tc.name, ok, err, tc.want)
		}
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid input sent %d Redis commands (%v), want none", n, cmds)
	}
}

func TestAllowPolicies(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	ctx := context.Background()
	lim := Limit{Rate: 20, Burst: 10}
	for _, tc := range []struct {
		policy Policy
		check  func(t *testing.T, l *Limiter)
	}{
		{FailOpen, func(t *testing.T, l *Limiter) {
			if allowed, _ := allowAtOnce(t, 50, func() (bool, error) { return l.Allow(ctx, "k", lim) }); allowed != 50 {
				t.Errorf("%d of 50 allowed, want all", allowed)
			}
		}},
		{FailClosed, func(t *testing.T, l *Limiter) {
			for range 10 {
				if ok, err := l.Allow(ctx, "k", lim); ok || !errors.Is(err, ErrUnavailable) {
					t.Fatalf("Allow = %v, %v; want false and ErrUnavailable", ok, err)
				}
			}
		}},
		{FallbackLocal(2), func(t *testing.T, l *Limiter) {
			// The share, 10/s and a burst of 5, starts empty and fills in
			// half a second.
			time.Sleep(time.Second)
			allowed, slowest := allowAtOnce(t, 50, func() (bool, error) { return l.Allow(ctx, "k", lim) })
			t.Logf("%d of 50 allowed from the local share, the slowest call took %v", allowed, slowest)
			if allowed < 5 || allowed > 7 { // 5, and what accrues at 10/s meanwhile
				t.Errorf("%d of 50 allowed from the local share, want its burst, 5", allowed)
			}
			if slowest > time.Second {
				t.Errorf("an Allow call took %v; it must never wait", slowest)
			}
		}},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			srv, rdb := limiterServer(t)
			l := NewLimiter(rdb, WithPolicy(tc.policy), WithLogger(discardLogger()))
			if ok, err := l.Allow(ctx, "k", lim); !ok || err != nil {
				t.Fatalf("Allow with Redis up = %v, %v", ok, err)
			}
			srv.Kill()
			l.Allow(ctx, "k", lim) // finds Redis gone
			if l.Mode() != tc.policy.mode() {
				t.Fatalf("mode %v after Redis was killed, want %v", l.Mode(), tc.policy.mode())
			}
			tc.check(t, l)
		})
	}
}

func TestAllowSpans(t *testing.T) {
	tel := newTelemetry(t)
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb, tel.options()...)
	ctx := context.Background()
	lim := Limit{Rate: 0.05, Burst: 1}
	l.Allow(ctx, "k", lim)
	l.Allow(ctx, "k", lim)
	spans := tel.waitSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2", len(spans))
	}
	for i, want := range []struct{ outcome, errType string }{{"granted", ""}, {"refused", "would_wait"}} {
		a := attrs(spans[i])
		if a["quota.outcome"].AsString() != want.outcome || a["error.type"].AsString() != want.errType {
			t.Errorf("span %d: outcome %q error.type %q, want %+v", i, a["quota.outcome"].AsString(), a["error.type"].AsString(), want)
		}
		if _, ok := a["quota.dry_run"]; ok {
			t.Errorf("span %d carries quota.dry_run without WithDryRun", i)
		}
	}
}

// countingServer is a provider that counts the requests that reach it.
func countingServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { n.Add(1) }))
	t.Cleanup(srv.Close)
	return srv, &n
}

func TestTransportNoWait(t *testing.T) {
	_, rdb := limiterServer(t)
	prov, reached := countingServer(t)
	tr := NewTransport(rdb, Limit{Rate: 0.05, Burst: 5}, WithNoWait())

	var mu sync.Mutex
	var refusals []error
	var slowest time.Duration
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 30 {
		wg.Go(func() {
			body := &bodyRecorder{Reader: strings.NewReader("payload")}
			req, _ := http.NewRequest("POST", prov.URL, body)
			<-start
			begun := time.Now()
			resp, err := tr.RoundTrip(req)
			took := time.Since(begun)
			mu.Lock()
			defer mu.Unlock()
			slowest = max(slowest, took)
			if err == nil {
				resp.Body.Close()
				return
			}
			refusals = append(refusals, err)
			if !body.closed.Load() {
				t.Error("a refused request's body was not closed")
			}
		})
	}
	close(start)
	wg.Wait()

	t.Logf("%d requests reached the provider, %d refused, the slowest RoundTrip took %v", reached.Load(), len(refusals), slowest)
	if reached.Load() != 5 || len(refusals) != 25 {
		t.Errorf("%d requests reached the provider and %d were refused, want the burst, 5, and 25", reached.Load(), len(refusals))
	}
	if slowest > 2*time.Second {
		t.Errorf("a RoundTrip took %v; WithNoWait must never wait (the shortest wait was 20s)", slowest)
	}
	for _, err := range refusals {
		if !errors.Is(err, ErrWouldWait) || Permanent(err) || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("refusal %v: want ErrWouldWait, not permanent, not a deadline", err)
		}
		if msg := err.Error(); !strings.Contains(msg, `"127.0.0.1:`) || !strings.Contains(msg, "needs") {
			t.Errorf("refusal %q: want the bucket's name and the wait", msg)
		}
	}
}

// A refusal WithNoWait is retried by retryablehttp after its backoff, by
// which time the token has accrued.
func TestNoWaitRetriedByRetryablehttp(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb := limiterServer(t)
	prov, reached := countingServer(t)
	tried := &attemptCounter{next: NewTransport(rdb, Limit{Rate: 5, Burst: 1}, WithNoWait())}
	client := retryingClient(tried)
	client.RetryWaitMin, client.RetryWaitMax, client.RetryMax = 50*time.Millisecond, time.Second, 6 // 3s of backoff in all

	for i := range 2 {
		resp, err := client.Get(prov.URL)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
	}
	t.Logf("2 requests: %d attempts, %d reached the provider", tried.count(), reached.Load())
	if reached.Load() != 2 || tried.count() < 3 {
		t.Errorf("%d attempts, %d reached the provider; want the second request refused at first, then retried and sent", tried.count(), reached.Load())
	}
	retry, err := CheckRetry(retryablehttp.DefaultRetryPolicy)(context.Background(), nil, ErrWouldWait)
	if !retry || err != nil {
		t.Errorf("CheckRetry(ErrWouldWait) = %v, %v; want a retry", retry, err)
	}
}
