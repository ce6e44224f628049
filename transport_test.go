package quota

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// newMini returns a client of a fresh miniredis and a counter of the
// commands sent through it.
// bodyRecorder is a request body that records whether it was closed.
type bodyRecorder struct {
	io.Reader
	closed atomic.Bool
}

func (b *bodyRecorder) Close() error { b.closed.Store(true); return nil }

// roundTripFunc adapts a function to http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func okResponse(req *http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: 200, Body: http.NoBody, Request: req}, nil
}

func TestHost(t *testing.T) {
	for _, tc := range []struct{ url, host, want string }{
		{"https://API.Example.com/v1", "", "api.example.com"},
		{"https://api.example.com:443/v1", "", "api.example.com"},
		{"http://api.example.com:80/v1", "", "api.example.com"},
		{"http://api.example.com:443/v1", "", "api.example.com:443"},
		{"https://api.example.com:8443/v1", "", "api.example.com:8443"},
		{"https://api.example.com./v1", "", "api.example.com"},
		{"https://[::1]:443/", "", "[::1]"},
		{"https://[::1]:8443/", "", "[::1]:8443"},
		{"https://10.0.0.1/", "Geo.Example.com", "geo.example.com"},
	} {
		req := httptest.NewRequest("GET", tc.url, nil)
		req.Host = tc.host
		if tc.host == "" {
			req.Host = ""
		}
		got, err := Host(req)
		if err != nil || got != tc.want {
			t.Errorf("Host(%s, Host=%q) = %q, %v; want %q", tc.url, tc.host, got, err, tc.want)
		}
	}
	if _, err := Host(&http.Request{URL: &url0}); err == nil {
		t.Error("Host of a request without a host: want an error")
	}
}

var url0 = *httptest.NewRequest("GET", "/relative", nil).URL

func TestKeyFuncs(t *testing.T) {
	req := httptest.NewRequest("GET", "https://geo.example.com/v1", nil)
	req.Header.Set("X-Region", "eu")
	for _, tc := range []struct {
		name string
		f    KeyFunc
		want string
	}{
		{"fixed", Fixed("geocoder"), "geocoder"},
		{"host region fixed", Join(Host, Fixed("us")), "geo.example.com/us"},
		{"host region header", Join(Host, Header("X-Region")), "geo.example.com/eu"},
		{"join", Join(Fixed("acct"), Host, Header("X-Region")), "acct/geo.example.com/eu"},
	} {
		got, err := tc.f(req)
		if err != nil || got != tc.want {
			t.Errorf("%s: got %q, %v; want %q", tc.name, got, err, tc.want)
		}
	}
	if _, err := Join(Host, Header("X-Missing"))(req); err == nil {
		t.Error("Join with a missing header: want an error")
	}
	empty := func(*http.Request) (string, error) { return "", nil }
	if _, err := Join(Host, empty)(req); err == nil {
		t.Error("Join with an empty part: want an error")
	}
	mustPanic(t, "Fixed(\"\")", func() { Fixed("") })
	mustPanic(t, "Join()", func() { Join() })
}

func TestRedisKey(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	if k, _ := bucketKey(l.cfg.prefix, "api.example.com"); k != "quota:{api.example.com}" {
		t.Errorf("redisKey = %q", k)
	}
	if k, _ := bucketKey(NewLimiter(rdb, WithPrefix("acme:rl:")).cfg.prefix, "a"); k != "acme:rl:{a}" {
		t.Errorf("redisKey with prefix = %q", k)
	}
	if _, err := bucketKey(l.cfg.prefix, ""); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("empty name: err = %v, want ErrInvalidKey", err)
	}
	long1, long2 := strings.Repeat("a", 10_000)+"1", strings.Repeat("a", 10_000)+"2"
	k1, _ := bucketKey(l.cfg.prefix, long1)
	k2, _ := bucketKey(l.cfg.prefix, long2)
	if k1 == k2 {
		t.Error("two long names share a key")
	}
	if want := len("quota:{}") + store.MaxNameLen + 1; len(k1) != want {
		t.Errorf("long name: key of %d bytes, want %d", len(k1), want)
	}
	if k, _ := bucketKey(l.cfg.prefix, long1); k != k1 {
		t.Error("a long name's key is not stable")
	}
	// A name of store.MaxNameLen bytes in the shortened form of a long name's
	// (its prefix, "~" and the digest) keeps a key of its own.
	sum := sha256.Sum256([]byte(long1))
	digest := hex.EncodeToString(sum[:8])
	for _, lookalike := range []string{
		long1[:store.MaxNameLen-len(digest)-1] + "~" + digest,
		long1[:store.MaxNameLen-len(digest)] + "~" + digest,
		strings.TrimSuffix(strings.TrimPrefix(k1, "quota:{"), "}"),
	} {
		if k, _ := bucketKey(l.cfg.prefix, lookalike); k == k1 {
			t.Errorf("the name %q shares the key of a long name", lookalike)
		}
	}
	// A name that begins with "}" keeps a hash tag, which every key of
	// its bucket shares; so does one that begins with "%", under another
	// key.
	seen := map[string]string{}
	for _, name := range []string{"}", "}a", "%}a", "%", "%%", "a}", "{", "}}"} {
		k, err := bucketKey(l.cfg.prefix, name)
		if err != nil {
			t.Fatal(err)
		}
		if tag := hashTag(k); tag == "" || hashTag(k+control.Suffix) != tag || hashTag(k+slots.QueueSuffix) != tag {
			t.Errorf("name %q: key %q, hash tag %q", name, k, tag)
		}
		if other, ok := seen[k]; ok {
			t.Errorf("names %q and %q share the key %q", other, name, k)
		}
		seen[k] = name
	}
}

// hashTag returns the part of key that Redis Cluster hashes to choose its
// slot when it has a hash tag: between the first "{" and the first "}"
// after it, "" when there is none or it is empty.
func hashTag(key string) string {
	_, rest, ok := strings.Cut(key, "{")
	if !ok {
		return ""
	}
	tag, _, ok := strings.Cut(rest, "}")
	if !ok {
		return ""
	}
	return tag
}

func TestLimitResolve(t *testing.T) {
	for _, tc := range []struct {
		lim  Limit
		want Limit
	}{
		{PerSecond(10), Limit{Rate: 10, Burst: 30}},
		{PerMinute(300), Limit{Rate: 5, Burst: 15}},
		{PerMinute(6), Limit{Rate: 0.1, Burst: 1}},
		{PerHour(3600), Limit{Rate: 1, Burst: 3}},
		{Limit{Rate: 2, Burst: 0.5}, Limit{Rate: 2, Burst: 0.5}},
	} {
		got, err := tc.lim.resolve()
		if err != nil || math.Abs(got.Rate-tc.want.Rate) > 1e-12 || got.Burst != tc.want.Burst {
			t.Errorf("%+v.resolve() = %+v, %v; want %+v", tc.lim, got, err, tc.want)
		}
	}
	if s := PerSecond(5).String(); s != "5/s burst 15" {
		t.Errorf("String() = %q", s)
	}
}

func TestInvalidInputMakesNoRedisCall(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		key  string
		lim  Limit
		n    float64
		want error
	}{
		{"zero rate", "k", Limit{}, 1, ErrInvalidLimit},
		{"negative rate", "k", Limit{Rate: -1}, 1, ErrInvalidLimit},
		{"NaN rate", "k", Limit{Rate: math.NaN()}, 1, ErrInvalidLimit},
		{"infinite rate", "k", Limit{Rate: math.Inf(1)}, 1, ErrInvalidLimit},
		{"huge rate", "k", Limit{Rate: math.MaxFloat64}, 1, ErrInvalidLimit},
		{"negative burst", "k", Limit{Rate: 1, Burst: -1}, 1, ErrInvalidLimit},
		{"NaN burst", "k", Limit{Rate: 1, Burst: math.NaN()}, 1, ErrInvalidLimit},
		{"infinite burst", "k", Limit{Rate: 1, Burst: math.Inf(1)}, 1, ErrInvalidLimit},
		{"zero tokens", "k", PerSecond(1), 0, ErrInvalidTokens},
		{"negative tokens", "k", PerSecond(1), -1, ErrInvalidTokens},
		{"NaN tokens", "k", PerSecond(1), math.NaN(), ErrInvalidTokens},
		{"more than burst", "k", Limit{Rate: 1, Burst: 2}, 3, ErrExceedsBurst},
		{"empty key", "", PerSecond(1), 1, ErrInvalidKey},
	} {
		done := make(chan error, 1)
		go func() { done <- l.WaitN(ctx, tc.key, tc.n, tc.lim) }()
		select {
		case err := <-done:
			if !errors.Is(err, tc.want) {
				t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: WaitN did not return", tc.name)
		}
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid input sent %d Redis commands, want 0", n)
	}
}

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
		{"invalid limit", NewTransport(rdb, Limit{Rate: -1}, WithBase(base)), context.Background(), ErrInvalidLimit},
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

func TestTransportPerKeyLimits(t *testing.T) {
	_, rdb, _ := newMini(t)
	tr := NewTransport(rdb, Limit{Rate: 1, Burst: 1},
		WithBase(roundTripFunc(okResponse)),
		WithLimits(map[string]Limit{"fast.example.com": {Rate: 1, Burst: 10}}))
	// Each request may wait half a second; the next token of a host is a
	// second away once its burst is spent.
	get := func(host string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", "https://"+host+"/", nil)
		_, err := tr.RoundTrip(req)
		return err
	}
	for i := 0; i < 10; i++ {
		if err := get("fast.example.com"); err != nil {
			t.Fatalf("request %d to the burst-10 host: %v", i+1, err)
		}
	}
	if err := get("slow.example.com"); err != nil {
		t.Fatal(err)
	}
	if err := get("slow.example.com"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("second request to the burst-1 host: err = %v, want a deadline error", err)
	}
}

func TestWaitPastDeadlineTakesNothing(t *testing.T) {
	mr, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	lim := Limit{Rate: 1, Burst: 1}
	if err := l.Wait(context.Background(), "k", lim); err != nil {
		t.Fatal(err)
	}
	before, _ := mr.Get("quota:{k}")
	// The next token is a second away, past the deadline: refused at
	// once, not when the deadline comes (the bound of half the deadline
	// is the machine's).
	ctx, cancel := context.WithTimeout(context.Background(), 800*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := l.Wait(ctx, "k", lim)
	if !errors.Is(err, ErrWouldExceedDeadline) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("err = %v, want ErrWouldExceedDeadline matching context.DeadlineExceeded", err)
	}
	if d := time.Since(start); d > 400*time.Millisecond {
		t.Errorf("returned after %v, want at once, long before the deadline", d)
	}
	if after, _ := mr.Get("quota:{k}"); after != before {
		t.Errorf("bucket changed from %s to %s: a refused wait took tokens", before, after)
	}
}

func TestCancelDuringWaitRefunds(t *testing.T) {
	mr, rdb, _ := newMini(t)
	rdb.AddHook(dueHook{})
	l := NewLimiter(rdb)
	lim := Limit{Rate: 0.25, Burst: 1} // the next token is 4s away, within MaxWait
	if err := l.Wait(context.Background(), "k", lim); err != nil {
		t.Fatal(err)
	}
	before, _ := mr.Get("quota:{k}")

	// Cancelled once its take is granted, while it sleeps.
	ctx, rec := withDueRecord(context.Background())
	ctx, cancel := context.WithCancel(ctx)
	var cancelled time.Time
	go func() {
		<-rec.granted
		cancelled = time.Now()
		cancel()
	}()
	err := l.Wait(ctx, "k", lim)
	returned := time.Now()
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context.Canceled", err)
	}
	if !rec.Waited || rec.Wait < 3*time.Second {
		t.Fatalf("the take was granted with a wait of %v, want about 4s", rec.Wait)
	}
	// Returning is the machine's business: a bound of its own, far below
	// the wait that a caller deaf to its context would sleep out.
	t.Logf("returned %v after the cancel, %v before its token would have accrued", returned.Sub(cancelled), rec.Due.Sub(returned))
	if returned.Sub(cancelled) > time.Second {
		t.Errorf("returned %v after the cancel, want promptly, not after the wait of %v", returned.Sub(cancelled), rec.Wait)
	}
	// The refund runs in the background; the bucket goes back to where it was.
	eventually(t, 10*time.Second, "the refund", func() bool {
		after, _ := mr.Get("quota:{k}")
		return after == before
	})
}

func TestRefundKeepsLaterCallersPlaces(t *testing.T) {
	mr, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	lim := Limit{Rate: 10, Burst: 1}
	ctx := context.Background()
	b := oneLayer("quota:{k}", lim)
	take := func(maxWait time.Duration) store.Grant {
		g, err := l.store.Take(ctx, b, store.Tokens(1), maxWait)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	refund := func(g store.Grant) {
		if err := l.store.Refund(ctx, b, store.Tokens(1), g.Tats); err != nil {
			t.Fatal(err)
		}
	}
	take(0)                     // the one token
	first := take(time.Second)  // queued 100ms out
	second := take(time.Second) // queued 200ms out, behind the first
	before, _ := mr.Get("quota:{k}")
	refund(first) // the first gives up: the second's place stays promised
	if after, _ := mr.Get("quota:{k}"); after != before {
		t.Errorf("refund of a take with a later one queued behind it changed the bucket from %s to %s", before, after)
	}
	refund(second) // the second gives up: the tail is handed back
	if after, _ := mr.Get("quota:{k}"); after == before {
		t.Error("refund of the last take changed nothing")
	}
}

func TestMaxWaitAsksAgain(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb, cmds := newMini(t)
	rdb.AddHook(dueHook{})
	l := NewLimiter(rdb, WithMaxWait(100*time.Millisecond))
	lim := Limit{Rate: 2, Burst: 1}
	first, emptied := withDueRecord(context.Background())
	// The script's clock is read before the call is sent, and on a busy
	// machine well before the hook sees it go: the bound starts here.
	asked := time.Now()
	if err := l.WaitN(first, "k", 1, lim); err != nil {
		t.Fatal(err)
	}
	cmds.reset()
	// The next token accrues 500ms after the first was taken, past
	// MaxWait: the limiter sleeps 100ms and asks again, at most four
	// times (its fifth call finds 100ms at most), and is granted then.
	ctx, rec := withDueRecord(context.Background())
	if err := l.WaitN(ctx, "k", 1, lim); err != nil {
		t.Fatal(err)
	}
	woke := time.Now()
	if rec.Due.Before(asked.Add(500*time.Millisecond-time.Microsecond)) || rec.Due.After(emptied.Replied.Add(500*time.Millisecond+time.Microsecond)) {
		t.Errorf("the token fell due %v after the first was asked for (taken within %v), want 500ms", rec.Due.Sub(asked), emptied.Replied.Sub(asked))
	}
	if late := woke.Sub(rec.Due); late < 0 || late > maxJitter {
		t.Errorf("the caller woke %v after its token fell due", late)
	}
	t.Logf("%d Redis calls", cmds.total())
	if n := cmds.total(); n < 2 || n > 5 {
		t.Errorf("%d Redis calls, want 2 to 5: one refused at least, and none after 400ms of asking again", n)
	}
}

func TestScriptErrorIsNotUnavailable(t *testing.T) {
	mr, rdb, _ := newMini(t)
	mr.HSet("quota:{k}", "tokens", "1") // a key of the wrong type under the prefix
	err := NewLimiter(rdb).Wait(context.Background(), "k", PerSecond(1))
	if !errors.Is(err, ErrScript) || errors.Is(err, ErrUnavailable) {
		t.Errorf("err = %v, want ErrScript and not ErrUnavailable", err)
	}
}

func TestNoScriptFallsBackToEval(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	if err := l.Wait(ctx, "k", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	// Once it listens, the Limiter reads the record again in the
	// background: let that read land before the script goes, so that the
	// waits below are the first to find it gone.
	<-l.events.Ready()
	listening := l.events.Since()
	e := l.controls.Lookup("quota:{k}")
	eventually(t, 5*time.Second, "the read after listening", func() bool {
		return !e.Reading() && e.Load().ReadAt().After(listening)
	})
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	cmds.reset()
	for i := 0; i < 3; i++ {
		if err := l.Wait(ctx, "k", PerSecond(100)); err != nil {
			t.Fatal(err)
		}
	}
	if n := cmds.total(); n != 4 { // EVALSHA, EVAL, then EVALSHA twice
		t.Errorf("%d commands for 3 waits after the script was lost, want 4", n)
	}
}

func TestConstructorsPanicOnNil(t *testing.T) {
	mustPanic(t, "NewLimiter(nil)", func() { NewLimiter(nil) })
	mustPanic(t, "NewTransport(nil)", func() { NewTransport(nil, PerSecond(1)) })
	mustPanic(t, "WithKey(nil)", func() { WithKey(nil) })
	mustPanic(t, "WithLogger(nil)", func() { WithLogger(nil) })
	mustPanic(t, "WithClock(nil)", func() { WithClock(nil) })
	mustPanic(t, "WithMaxWait(0)", func() { WithMaxWait(0) })
}

func mustPanic(t *testing.T, name string, f func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Errorf("%s did not panic", name)
		}
	}()
	f()
}

func TestAllow(t *testing.T) {
	_, rdb, cmds := newMini(t)
	var sent atomic.Int64
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) { sent.Add(1); return okResponse(r) })
	tr := NewTransport(rdb, PerSecond(10), WithBase(base), WithKey(AllowNames(Host, "api.example.com", "geo.example.com")))
	for _, tc := range []struct {
		url string
		ok  bool
	}{
		{"https://API.example.com/v1", true},
		{"https://geo.example.com:443/", true},
		{"https://evil.example.net/", false},
		{"https://api.example.com.evil.net/", false},
	} {
		req := httptest.NewRequest("GET", tc.url, nil)
		req.RequestURI = ""
		_, err := tr.RoundTrip(req)
		if tc.ok != (err == nil) || (!tc.ok && !errors.Is(err, ErrInvalidKey)) {
			t.Errorf("%s: err = %v", tc.url, err)
		}
	}
	if sent.Load() != 2 || cmds.total() != 2 {
		t.Errorf("%d requests sent with %d Redis commands, want 2 and 2", sent.Load(), cmds.total())
	}
}

// oneLayer is the bucket of a single Limit under the Redis key rkey.
func oneLayer(rkey string, lim Limit) store.Bucket {
	return store.Bucket{Name: rkey, Keys: []string{rkey}, Lims: []store.Limit{store.Limit(lim)}, Call: []string{rkey, rkey + control.Suffix}}
}

// TestWithLimiterRefusesLimiterOptions: an option of the Limiter's own
// beside WithLimiter would have no effect, so NewTransport refuses it.
func TestWithLimiterRefusesLimiterOptions(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	NewTransport(nil, PerSecond(1), WithLimiter(l), WithConcurrency(2)) // a Transport's own: accepted
	defer func() {
		if recover() == nil {
			t.Error("NewTransport with WithLimiter and WithPrefix did not panic")
		}
	}()
	NewTransport(nil, PerSecond(1), WithLimiter(l), WithPrefix("other:"))
}

// TestExceedsBurstSaysWhatToDo: the error of a cost above the burst names
// the bucket, the burst and the fix.
func TestExceedsBurstSaysWhatToDo(t *testing.T) {
	_, rdb, _ := newMini(t)
	err := NewLimiter(rdb).WaitN(context.Background(), "daily", 5, PerDay(10000))
	if !errors.Is(err, ErrExceedsBurst) {
		t.Fatalf("got %v, want ErrExceedsBurst", err)
	}
	for _, want := range []string{`"daily"`, "holds 1 at most", "a zero Burst is three seconds of Rate", "set the Limit's Burst to 5 or more"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}
}
