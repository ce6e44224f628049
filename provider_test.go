package quota

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		status int
		value  string
		want   time.Duration
		ok     bool
	}{
		{429, "2", 2 * time.Second, true},
		{503, "0.5", 500 * time.Millisecond, true},
		{429, now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{429, now.Add(-time.Second).Format(http.TimeFormat), 0, false},
		{429, "", 0, false},
		{429, "-3", 0, false},
		{429, "soon", 0, false},
		{429, "1e300", 0, false},
		{200, "2", 0, false},
		{500, "2", 0, false},
	} {
		resp := &http.Response{StatusCode: tc.status, Header: http.Header{}}
		if tc.value != "" {
			resp.Header.Set("Retry-After", tc.value)
		}
		got, ok := retryAfter(resp, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%d Retry-After %q = %v, %v; want %v, %v", tc.status, tc.value, got, ok, tc.want, tc.ok)
		}
	}
}

func TestRateLimitHeaders(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	for _, tc := range []struct {
		name      string
		header    http.Header
		remaining float64
		reset     time.Duration
		ok        bool
	}{
		{"structured", http.Header{"Ratelimit": {`"default";r=50;t=30`}}, 50, 30 * time.Second, true},
		{"structured, two policies", http.Header{"Ratelimit": {`"second";r=7;t=1, "day";r=2;t=3600`}}, 2, time.Hour, true},
		{"earlier draft", http.Header{"Ratelimit": {"limit=100, remaining=5, reset=10"}}, 5, 10 * time.Second, true},
		{"separate fields", http.Header{"Ratelimit-Remaining": {"3"}, "Ratelimit-Reset": {"4"}}, 3, 4 * time.Second, true},
		{"x- with seconds", http.Header{"X-Ratelimit-Remaining": {"9"}, "X-Ratelimit-Reset": {"20"}}, 9, 20 * time.Second, true},
		{"x- with a Unix time", http.Header{"X-Ratelimit-Remaining": {"0"}, "X-Ratelimit-Reset": {strconv.Itoa(1_800_000_060)}}, 0, time.Minute, true},
		{"the fewest wins", http.Header{"X-Ratelimit-Remaining": {"9"}, "Ratelimit-Remaining": {"4"}}, 4, 0, true},
		{"nothing", http.Header{"X-Other": {"1"}}, 0, 0, false},
		{"garbage", http.Header{"X-Ratelimit-Remaining": {"lots"}, "Ratelimit": {"r=;t=x"}}, 0, 0, false},
		{"negative", http.Header{"X-Ratelimit-Remaining": {"-1"}}, 0, 0, false},
	} {
		remaining, reset, ok := rateLimitHeaders(tc.header, now)
		if ok != tc.ok || (ok && (remaining != tc.remaining || reset != tc.reset)) {
			t.Errorf("%s: %v, %v, %v; want %v, %v, %v", tc.name, remaining, reset, ok, tc.remaining, tc.reset, tc.ok)
		}
	}
}

// answering is a provider whose handler the test sets.
func answering(t *testing.T, h http.HandlerFunc) *httptest.Server {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// getVia sends a GET through tr and, when tr is a Transport, waits for the
// updates its response made to the bucket.
func getVia(t *testing.T, tr http.RoundTripper, ctx context.Context, url string, header http.Header) error {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := tr.RoundTrip(req)
	if err == nil {
		resp.Body.Close()
	}
	if qt, ok := tr.(*Transport); ok {
		_ = qt.limiter.updates.running.Wait(context.Background())
	}
	return err
}

// tokenAfter takes a token from the provider's bucket with l, which must
// use a client with dueHook, and returns what the hook saw of the take.
// A pause that began between begun and ended and lasts d must make the
// take fall due d after it: between begun+d and ended+d, to the
// microsecond (the caller's wake-up is the machine's, bounded apart),
// unless the take came after that and was granted at once.
func tokenAfter(t *testing.T, l *Limiter, name string, lim Limit, begun, ended time.Time, d time.Duration) *dueRecord {
	t.Helper()
	ctx, rec := withDueRecord(context.Background())
	if err := l.Wait(ctx, name, lim); err != nil {
		t.Fatal(err)
	}
	late := time.Since(rec.Due)
	switch {
	case !rec.Waited && rec.Sent.Before(begun.Add(d)):
		t.Errorf("a token granted at once %v after the pause began, want none for %v", rec.Sent.Sub(begun), d)
	case rec.Waited && (rec.Due.Before(begun.Add(d-time.Microsecond)) || rec.Due.After(ended.Add(d+time.Microsecond))):
		t.Errorf("the next token fell due %v after the pause began (within %v), want %v", rec.Due.Sub(begun), ended.Sub(begun), d)
	case late > maxJitter:
		t.Errorf("the caller woke %v after its token fell due", late)
	}
	return rec
}

func TestRetryAfterPausesTheFleet(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb, _ := newMini(t)
	rdb.AddHook(dueHook{})
	var status atomic.Int64
	status.Store(200)
	prov := answering(t, func(w http.ResponseWriter, r *http.Request) {
		if s := int(status.Load()); s != 200 {
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(s)
		}
	})
	name, _ := Host(httptest.NewRequest("GET", prov.URL, nil))
	lim := PerSecond(100)
	first := NewTransport(rdb, lim)
	other := NewLimiter(rdb) // another worker of the fleet

	status.Store(429)
	begun := time.Now()
	if err := getVia(t, first, context.Background(), prov.URL, nil); err != nil {
		t.Fatal(err)
	}
	// The other worker never saw the 429, and still waits out the pause.
	rec := tokenAfter(t, other, name, lim, begun, time.Now(), time.Second)
	t.Logf("the next token fell due %v after the request that got the 429 began", rec.Due.Sub(begun))

	// After the pause, one token and then the rate: the next is due one
	// interval after it, or at once if the caller came later still.
	status.Store(200)
	ctx, next := withDueRecord(context.Background())
	if err := other.Wait(ctx, name, lim); err != nil {
		t.Fatal(err)
	}
	if interval := 10 * time.Millisecond; next.Waited && (next.Due.Sub(rec.Due)-interval).Abs() > 2*time.Microsecond {
		t.Errorf("after the pause the next token fell due %v after the first, want %v", next.Due.Sub(rec.Due), interval)
	}
}

func TestMaxPause(t *testing.T) {
	for _, tc := range []struct {
		opt  TransportOption
		want time.Duration
	}{
		{WithMaxPause(200 * time.Millisecond), 200 * time.Millisecond},
		{WithMaxPause(0), 0},
	} {
		_, rdb, _ := newMini(t)
		rdb.AddHook(dueHook{})
		prov := answering(t, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Retry-After", "86400") // a day
			w.WriteHeader(503)
		})
		name, _ := Host(httptest.NewRequest("GET", prov.URL, nil))
		lim := PerSecond(100)
		begun := time.Now()
		if err := getVia(t, NewTransport(rdb, lim, tc.opt), context.Background(), prov.URL, nil); err != nil {
			t.Fatal(err)
		}
		rec := tokenAfter(t, NewLimiter(rdb), name, lim, begun, time.Now(), tc.want)
		if tc.want == 0 && rec.Waited {
			t.Errorf("max pause 0: the next token waited %v", rec.Wait)
		}
	}
	mustPanic(t, "WithMaxPause(-1)", func() { WithMaxPause(-1) })
}

// retryablehttp sleeps the Retry-After itself, and the bucket's pause ends
// at the same instant: the retry waits once, not twice.
func TestRetryAfterIsNotDoubledByRetryablehttp(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	r := retryAfter429(t, PerSecond(100))
	t.Logf("the retry came %v after the 429 with Retry-After: 1; its take waited %v", r.gap, r.retry.Wait)
	// The retry's take comes when retryablehttp has slept the Retry-After
	// since the response; the pause, begun as the response came, ends
	// then too, give or take the background update's start. Waiting
	// twice would make the take wait about 1s more.
	if r.gap < 950*time.Millisecond || r.retry.Wait > 500*time.Millisecond {
		t.Errorf("the retry came %v after the 429 and its take waited %v: want about 1s, and no second wait", r.gap, r.retry.Wait)
	}
	var _ retryablehttp.CheckRetry = CheckRetry(retryablehttp.DefaultRetryPolicy)
}

// tokensAtOnce returns a function that counts, taking them, the tokens
// the bucket called name holds now, as a worker with l sees it.
func tokensAtOnce(t *testing.T, l *Limiter, name string, lim Limit) func(n float64) int {
	return func(n float64) int {
		t.Helper()
		b, err := l.bucket(name, []Limit{lim})
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; ; i++ {
			g, err := l.store.Take(context.Background(), b.Bucket, store.Tokens(n), 0)
			if err != nil {
				t.Fatal(err)
			}
			if !g.Granted() {
				return i
			}
		}
	}
}

func TestProviderHeadersLowerTheBucket(t *testing.T) {
	_, rdb, _ := newMini(t)
	var remaining atomic.Int64
	prov := answering(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-RateLimit-Remaining", strconv.FormatInt(remaining.Load(), 10))
	})
	name, _ := Host(httptest.NewRequest("GET", prov.URL, nil))
	lim := Limit{Rate: 1, Burst: 10}
	clock := newStoppedClock() // nothing accrues unless the test says so
	tr := NewTransport(rdb, lim, WithProviderHeaders(), WithClock(clock.Now))
	tokensLeft := tokensAtOnce(t, NewLimiter(rdb, WithClock(clock.Now)), name, lim)

	// The provider counts 3 left where the bucket holds 9: lowered to 3.
	remaining.Store(3)
	if err := getVia(t, tr, context.Background(), prov.URL, nil); err != nil {
		t.Fatal(err)
	}
	if n := tokensLeft(1); n != 3 {
		t.Errorf("%d tokens after the provider said 3 remain, want 3", n)
	}
	// The provider counts more than the bucket holds: never raised.
	remaining.Store(100)
	clock.advance(1100 * time.Millisecond) // one token accrues
	if err := getVia(t, tr, context.Background(), prov.URL, nil); err != nil {
		t.Fatal(err)
	}
	if n := tokensLeft(0.1); n != 1 {
		t.Errorf("%d tenths of a token after the provider said 100 remain, want the bucket's 1", n)
	}
}

func TestCostAndSettle(t *testing.T) {
	_, rdb, cmds := newMini(t)
	prov := answering(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Usage", r.Header.Get("X-Real"))
	})
	name, _ := Host(httptest.NewRequest("GET", prov.URL, nil))
	lim := Limit{Rate: 1, Burst: 10}
	cost := func(r *http.Request) float64 { f, _ := strconv.ParseFloat(r.Header.Get("X-Estimate"), 64); return f }
	settle := func(resp *http.Response) (float64, bool) {
		f, err := strconv.ParseFloat(resp.Header.Get("X-Usage"), 64)
		return f, err == nil
	}
	clock := newStoppedClock() // nothing accrues unless the test says so
	tr := NewTransport(rdb, lim, WithCost(cost), WithSettle(settle), WithClock(clock.Now))
	tokens := tokensAtOnce(t, NewLimiter(rdb, WithClock(clock.Now)), name, lim)
	send := func(estimate, real string) error {
		return getVia(t, tr, context.Background(), prov.URL, http.Header{"X-Estimate": {estimate}, "X-Real": {real}})
	}

	// Estimated 5, really 2: 3 come back, 8 remain.
	if err := send("5", "2"); err != nil {
		t.Fatal(err)
	}
	if n := tokens(0.5); n != 16 {
		t.Errorf("after an estimate of 5 settled at 2, %d half tokens left, want 16", n)
	}
	// The bucket is empty; wait for 6, then estimate 2, really 6.
	clock.advance(6 * time.Second)
	if err := send("2", "6"); err != nil {
		t.Fatal(err)
	}
	if n := tokens(0.1); n != 0 {
		t.Errorf("after an estimate of 2 settled at 6, %d tenths of a token left, want none", n)
	}

	cmds.reset()
	for _, c := range []struct {
		estimate string
		want     error
	}{{"11", ErrExceedsBurst}, {"0", ErrInvalidTokens}, {"-1", ErrInvalidTokens}, {"NaN", ErrInvalidTokens}} {
		if err := send(c.estimate, "1"); !errors.Is(err, c.want) {
			t.Errorf("cost %s: err = %v, want %v", c.estimate, err, c.want)
		}
	}
	if cmds.total() != 0 {
		t.Errorf("invalid costs sent %d Redis commands", cmds.total())
	}
	mustPanic(t, "WithCost(nil)", func() { WithCost(nil) })
	mustPanic(t, "WithSettle(nil)", func() { WithSettle(nil) })
}

var _ redis.Scripter = (*redis.Client)(nil)
