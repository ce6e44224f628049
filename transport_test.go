package quota

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of the Transport (transport.go): one token a request, the request
// untouched, its body closed on error, WithNoWait; and what the provider
// answers flowing back into the bucket: a Retry-After pauses the fleet
// (within WithMaxPause), the provider's headers lower the bucket, and a
// cost is settled.

func TestTransportTakesOneTokenPerRequest(t *testing.T) {
	_, rdb, cmds := newMini(t)
	var sent atomic.Int64
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) { sent.Add(1); return okResponse(r) })
	tr := NewTransport(rdb, Limit{Rate: 1, Burst: 5}, WithBase(base))
	client := &http.Client{Transport: tr}
	for i := 0; i < 5; i++ {
		resp, err := client.Get("https://api.example.com/v1")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if sent.Load() != 5 {
		t.Errorf("base saw %d requests, want 5", sent.Load())
	}
	// Five tokens taken from a bucket of five: the next one is a second away.
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	if err := tr.Limiter().Wait(ctx, "api.example.com", Limit{Rate: 1, Burst: 5}); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Errorf("sixth token: err = %v, want ErrWouldExceedDeadline", err)
	}
	if got := cmds.total(); got != 6 { // one EVAL that sends the script, then EVALSHA
		t.Errorf("%d Redis commands for 6 acquisitions, want 6", got)
	}
}

func TestTransportDoesNotModifyRequest(t *testing.T) {
	_, rdb, _ := newMini(t)
	var seen *http.Request
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) { seen = r; return okResponse(r) })
	tr := NewTransport(rdb, PerSecond(10), WithBase(base))
	req := httptest.NewRequest("POST", "https://api.example.com/v1?q=1", strings.NewReader("body"))
	req.RequestURI = ""
	req.Header.Set("X-A", "1")
	before := req.Clone(context.Background())
	resp, err := tr.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if seen != req {
		t.Error("base did not receive the caller's request")
	}
	if req.URL.String() != before.URL.String() || len(req.Header) != 1 || req.Header.Get("X-A") != "1" || req.Host != before.Host || req.Method != "POST" {
		t.Errorf("request modified: %v %v %v", req.Method, req.URL, req.Header)
	}
}

func TestTransportClosesBodyOnError(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb, _ := newMini(t)
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		t.Error("a refused request reached the base RoundTripper")
		return okResponse(r)
	})
	failKey := func(*http.Request) (string, error) { return "", errors.New("no tenant") }
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()

	for _, tc := range []struct {
		name string
		tr   *Transport
		ctx  context.Context
		want error
	}{
		{"key error", NewTransport(rdb, PerSecond(1), WithBase(base), WithKey(failKey)), context.Background(), ErrInvalidKey},
		{"invalid cost", NewTransport(rdb, PerSecond(1), WithBase(base), WithCost(func(*http.Request) float64 { return -1 })), context.Background(), ErrInvalidTokens},
		{"cancelled", NewTransport(rdb, PerSecond(1), WithBase(base)), cancelled, context.Canceled},
		{"redis down", NewTransport(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1}), PerSecond(1), WithBase(base)), context.Background(), ErrUnavailable},
	} {
		body := &bodyRecorder{Reader: strings.NewReader("x")}
		req := httptest.NewRequestWithContext(tc.ctx, "POST", "https://api.example.com/", body)
		req.RequestURI = ""
		_, err := tc.tr.RoundTrip(req)
		if !errors.Is(err, tc.want) {
			t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
		}
		if !body.closed.Load() {
			t.Errorf("%s: request body not closed", tc.name)
		}
	}
	if errors.Is(func() error {
		_, err := NewTransport(rdb, PerSecond(1), WithKey(failKey)).RoundTrip(httptest.NewRequest("GET", "/", nil))
		return err
	}(), ErrUnavailable) {
		t.Error("a key error was reported as unavailable")
	}
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
	_ = tr.Limiter().updates.Wait(context.Background())
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

// A provider that counts none remaining, while the bucket is full: with
// its headers read, three processes stop bursting after their first
// requests; without them they spend the bucket's burst.
func TestProviderHeadersAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	const burst = 30
	run := func(headers bool) int {
		srv := redistest.Start(t)
		var mu sync.Mutex
		arrivals := 0
		prov := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			arrivals++
			mu.Unlock()
			w.Header().Set("X-RateLimit-Remaining", "0")
		}))
		defer prov.Close()
		runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(prov.URL, "http://"), URL: prov.URL, Headers: headers,
			Limit: Limit{Rate: 1, Burst: burst}, Goroutines: 1, Duration: 2 * time.Second})
		mu.Lock()
		defer mu.Unlock()
		return arrivals
	}
	plain, following := run(false), run(true)
	t.Logf("3 processes, a provider counting none remaining, a bucket of %d at 1/s for 2s: %d requests without the headers, %d following them", burst, plain, following)
	// Without the headers the burst goes out at once. Following them, the
	// first three requests, then the refill of one a second, and the
	// callers still waiting when the run ends: 7. The bucket is lowered in
	// the background, so a process's next take may reach Redis before the
	// lowering does and spend a token of the burst: a few more on a loaded
	// machine, never the burst.
	if plain < burst || following > plain/2 {
		t.Errorf("%d requests following the provider's count, %d without: want the burst of %d without, and at most half that following", following, plain, burst)
	}
}

var _ http.RoundTripper = (*Transport)(nil)
