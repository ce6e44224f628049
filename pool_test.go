package quota

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"

	"github.com/sharedquota/quota/internal/redistest"
)

// The pool's fleet tests run against poolProvider, a provider of several
// deployments, each refusing with 429 what passes its own token bucket.
// Their limits are 60,000, 30,000 and 10,000 tokens a minute, a second
// here, each request 500 tokens: 120, 60 and 20 requests a second.
var poolLimits = map[string]Limit{
	"a": {Rate: 60000, Burst: 6000},
	"b": {Rate: 30000, Burst: 3000},
	"c": {Rate: 10000, Burst: 1000},
}

// poolLayers are poolLimits as WithPool takes them: a deployment's layers.
var poolLayers = map[string][]Limit{"a": {poolLimits["a"]}, "b": {poolLimits["b"]}, "c": {poolLimits["c"]}}

const poolCost = 500 // tokens a request

// poolProvider serves the deployments named in the X-Deployment header,
// each with a bucket of its Limit and five times its burst, half a second
// of its rate (arrivals bunch up on their way, more so on a loaded
// machine, whose stalls hold requests granted apart until they go
// together), and records every answer.
type poolProvider struct {
	srv   *httptest.Server
	start time.Time

	mu      sync.Mutex
	buckets map[string]*rate.Limiter
	down    map[string]time.Time // a deployment refusing everything until then
	answers []poolAnswer
}

// poolAnswer is one answer of the provider: when, from which deployment,
// with which status.
type poolAnswer struct {
	at     time.Duration // since the provider started
	d      string
	status int
}

func newPoolProvider(t *testing.T) *poolProvider {
	p := &poolProvider{buckets: map[string]*rate.Limiter{}, down: map[string]time.Time{}, start: time.Now()}
	for d, lim := range poolLimits {
		p.buckets[d] = rate.NewLimiter(rate.Limit(lim.Rate), int(5*lim.Burst))
	}
	p.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d := r.Header.Get("X-Deployment")
		p.mu.Lock()
		now := time.Now()
		status := http.StatusOK
		if until, ok := p.down[d]; ok && now.Before(until) {
			status = http.StatusTooManyRequests
			w.Header().Set("Retry-After", strconv.FormatFloat(until.Sub(now).Seconds(), 'f', 3, 64))
		} else if b, ok := p.buckets[d]; !ok || !b.AllowN(now, poolCost) {
			status = http.StatusTooManyRequests
			w.Header().Set("Retry-After", "0.05")
		}
		p.answers = append(p.answers, poolAnswer{now.Sub(p.start), d, status})
		p.mu.Unlock()
		w.WriteHeader(status)
	}))
	t.Cleanup(p.srv.Close)
	return p
}

// refuse makes deployment d answer 429 for d, with a Retry-After until
// then, from now on.
func (p *poolProvider) refuse(d string, span time.Duration) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	p.down[d] = now.Add(span)
	return now.Sub(p.start)
}

// count returns the answers of deployments ds (all when none) with status
// (any when 0) between from and to.
func (p *poolProvider) count(from, to time.Duration, status int, ds ...string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, a := range p.answers {
		if a.at >= from && a.at < to && (status == 0 || a.status == status) && (len(ds) == 0 || strings.Contains(strings.Join(ds, ","), a.d)) {
			n++
		}
	}
	return n
}

// timeline tells the answers before to, by 100 ms, each deployment's
// count and the 429s.
func (p *poolProvider) timeline(to time.Duration) string {
	var b strings.Builder
	for from := time.Duration(0); from < to; from += 100 * time.Millisecond {
		fmt.Fprintf(&b, "[%v a%d b%d c%d 429:%d] ", from, p.count(from, from+100*time.Millisecond, 0, "a"), p.count(from, from+100*time.Millisecond, 0, "b"),
			p.count(from, from+100*time.Millisecond, 0, "c"), p.count(from, from+100*time.Millisecond, http.StatusTooManyRequests))
	}
	return b.String()
}

// poolRoute sends a request to its deployment: a header here, a URL and
// credentials for a real provider.
func poolRoute(req *http.Request, d string) *http.Request {
	r := req.Clone(req.Context())
	r.Header.Set("X-Deployment", d)
	return r
}

// poolFleet runs transports Transports, each with a Limiter and a Redis
// client of its own, and goroutines goroutines each sending one request
// after another through one of them until ctx ends, or, when every is set,
// one every every across the fleet.
func poolFleet(ctx context.Context, t *testing.T, provider *poolProvider, clients []*redis.Client, goroutines int, every time.Duration, opts ...TransportOption) *sync.WaitGroup {
	base := &http.Transport{MaxIdleConnsPerHost: goroutines}
	opts = append([]TransportOption{WithBase(base), WithKey(Fixed("llm")), WithCost(func(*http.Request) float64 { return poolCost })}, opts...)
	trs := make([]*Transport, len(clients))
	for i, rdb := range clients {
		trs[i] = NewTransport(rdb, PerSecond(100000), opts...)
	}
	var wg sync.WaitGroup
	start := time.Now()
	for g := range goroutines {
		client := &http.Client{Transport: trs[g%len(trs)]}
		wg.Go(func() {
			for r := 0; ctx.Err() == nil; r++ {
				if every > 0 {
					next := start.Add(time.Duration(r*goroutines+g) * every)
					if time.Sleep(time.Until(next)); ctx.Err() != nil {
						return
					}
				}
				req, _ := http.NewRequestWithContext(ctx, "POST", provider.srv.URL, strings.NewReader("{}"))
				resp, err := client.Do(req)
				if err != nil {
					continue // the context ended
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	return &wg
}

// TestPools runs the pool's fleets side by side, alone, not beside the
// suite's parallel tests: each sends at its deployments' limits, and a
// grant that reaches a fake late on a loaded machine meets a 429 there.
// The metered pool's runs alone (TestPoolMetered): beside these three,
// with a core kept busy, it met a 429.
func TestPools(t *testing.T) {
	redistest.Long(t)
	for _, tc := range []struct {
		name string
		f    func(*testing.T)
	}{
		{"fleet", testPoolFleet},
		{"last resort", testPoolLastResort},
		{"fallback local", testPoolFallbackLocal},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			tc.f(t)
		})
	}
}

// A fleet of three Transports with a pool of deployments a, b and c sends
// as fast as its pool allows: it uses at least 0.9 of their sum with no
// 429, in one script call a request. When a starts answering 429 for 5 s,
// b and c carry the fleet's traffic at once, and none of its requests
// reaches a during its pause; a serves again after. The negative control:
// one bucket of the pool's sum, each request sent to a deployment in
// turn whatever its room, draws 429s.
func testPoolFleet(t *testing.T) {
	srv := redistest.Start(t)
	provider := newPoolProvider(t)
	clients := []*redis.Client{srv.Client(t), srv.Client(t), srv.Client(t)}
	cmds := newCmdCounter()
	for _, rdb := range clients {
		rdb.AddHook(cmds)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Since(provider.start)
	wg := poolFleet(ctx, t, provider, clients, 36, 0, WithPool(poolRoute, poolLayers))

	time.Sleep(2*time.Second - time.Since(provider.start))
	ops := cmds.byOp()
	served := provider.count(0, time.Hour, 0)
	down := provider.refuse("a", 5*time.Second)
	time.Sleep(down + time.Second - time.Since(provider.start))
	// Each deployment is a bucket of its own, which Status names: a's
	// paused by its provider.
	lim := NewLimiter(srv.Client(t))
	for _, d := range []string{"a", "b", "c"} {
		st, err := lim.Status(context.Background(), "llm}{"+d)
		if err != nil || st.Name != "llm}{"+d || st.Paused != (d == "a") || st.Limit != poolLimits[d] {
			t.Errorf("Status of deployment %s: %+v, %v", d, st, err)
		}
	}
	time.Sleep(down + 5800*time.Millisecond - time.Since(provider.start))
	cancel()
	wg.Wait()

	ok := func(from, to time.Duration, ds ...string) float64 {
		return float64(provider.count(from, to, http.StatusOK, ds...)*poolCost) / (to - from).Seconds()
	}
	// From the fleet's start, bursts and all: a stall of the loaded
	// machine moves arrivals, not how many the phase holds.
	full := ok(start, down)
	t.Logf("before the outage: %.0f tokens/s of 100000 (a %.0f, b %.0f, c %.0f); script calls %v for %d requests",
		full, ok(start, down, "a"), ok(start, down, "b"), ok(start, down, "c"), ops, served)
	if full < 90000 {
		t.Errorf("the fleet used %.0f tokens a second of its pool's 100000, want at least 0.9 of it", full)
	}
	if n := provider.count(0, down, http.StatusTooManyRequests); n > 0 {
		t.Errorf("the provider refused %d requests before the outage, want none; %s", n, provider.timeline(down))
	}
	// One take a request: those that went, and those in flight.
	if ops["pool"] < served || ops["pool"] > served+36 || ops["take"] > 0 {
		t.Errorf("%d requests made script calls %v, want one pool take each", served, ops)
	}
	// Requests sent before the pause landed may still reach a, and
	// requests granted on a before it wait for its end.
	into := down + 300*time.Millisecond
	others := ok(into, down+5*time.Second, "b", "c")
	t.Logf("during a's outage: b and c %.0f tokens/s of their 40000; a answered %d times, %d of them 429",
		others, provider.count(into, down+5*time.Second, 0, "a"), provider.count(down, down+5*time.Second, http.StatusTooManyRequests))
	if others < 36000 {
		t.Errorf("b and c served %.0f tokens a second during a's outage, want at least 0.9 of their 40000", others)
	}
	if n := provider.count(into, down+5*time.Second, 0, "a"); n > 0 {
		t.Errorf("%d requests reached a during its pause", n)
	}
	if n := provider.count(down, down+5*time.Second, http.StatusTooManyRequests); n > 36 {
		t.Errorf("a refused %d requests as its outage began, more than were in flight", n)
	}
	if n := provider.count(0, time.Hour, http.StatusTooManyRequests, "b", "c"); n > 0 {
		t.Errorf("b and c refused %d requests, want none", n)
	}
	if after := provider.count(down+5300*time.Millisecond, down+5800*time.Millisecond, http.StatusOK, "a"); after < 10 {
		t.Errorf("a served %d requests in the half second from 0.3 s after its pause, want at least 10 of its 60", after)
	}

	// The negative control: the pool's sum in one bucket, the deployments
	// taken in turn.
	provider = newPoolProvider(t)
	var turn atomic.Int64
	inTurn := func(req *http.Request) (string, error) { return "all", nil }
	ctx, cancel = context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	wg = poolFleet(ctx, t, provider, clients, 36, 0, WithKey(inTurn), WithBase(roundTripFunc(func(req *http.Request) (*http.Response, error) {
		return http.DefaultTransport.RoundTrip(poolRoute(req, []string{"a", "b", "c"}[turn.Add(1)%3]))
	})))
	wg.Wait()
	refused := provider.count(0, time.Hour, http.StatusTooManyRequests)
	t.Logf("in turn: %d refused of %d", refused, provider.count(0, time.Hour, 0))
	if refused < 10 {
		t.Errorf("requests sent in turn drew %d 429s, want many: the control cannot fail", refused)
	}
}

// A last resort receives nothing while the others have room: a fleet
// asking for 0.6 of a's and b's sum sends nothing to c; one asking for
// more than the pool's sum uses c too.
func testPoolLastResort(t *testing.T) {
	srv := redistest.Start(t)
	clients := []*redis.Client{srv.Client(t), srv.Client(t)}
	for _, tc := range []struct {
		every time.Duration
		c     bool // c receives requests
	}{
		{time.Second / 108, false}, // 54000 tokens a second
		{0, true},
	} {
		provider := newPoolProvider(t)
		ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
		wg := poolFleet(ctx, t, provider, clients, 24, tc.every, WithPool(poolRoute, poolLayers, "c"))
		wg.Wait()
		cancel()
		c, all := provider.count(0, time.Hour, 0, "c"), provider.count(0, time.Hour, 0)
		t.Logf("every %v: c received %d of %d, %d refused", tc.every, c, all, provider.count(0, time.Hour, http.StatusTooManyRequests))
		if (c > 0) != tc.c {
			t.Errorf("every %v: the last resort received %d of %d requests", tc.every, c, all)
		}
		if n := provider.count(0, time.Hour, http.StatusTooManyRequests); n > 0 {
			t.Errorf("every %v: the provider refused %d requests", tc.every, n)
		}
	}
}

// WithPool panics on a pool it cannot serve, naming the conflict.
func TestPoolPanics(t *testing.T) {
	route := poolRoute
	for _, tc := range []struct {
		name string
		f    func()
		want string
	}{
		{"no deployments", func() { WithPool(route, nil) }, "no deployments"},
		{"nil route", func() { WithPool(nil, poolLayers) }, "no route"},
		{"a brace", func() { WithPool(route, map[string][]Limit{"a}": {PerSecond(1)}}) }, "braces"},
		{"an invalid Limit", func() { WithPool(route, map[string][]Limit{"a": {PerSecond(0)}}) }, `deployment "a"`},
		{"no Limit", func() { WithPool(route, map[string][]Limit{"a": nil}) }, `deployment "a": quota: invalid limit: no Limit given`},
		{"a Limit too many", func() {
			NewTransport(nil, PerSecond(1), WithLimiter(&Limiter{}), WithPool(route, map[string][]Limit{"a": {PerSecond(1), PerSecond(2)}}))
		}, `deployment "a" has 2 Limits, more than the 1 layers`},
		{"a last resort unknown", func() { WithPool(route, poolLayers, "x") }, `"x" is not one`},
		{"a last resort twice", func() { WithPool(route, poolLayers, "c", "c") }, "twice"},
		{"all last resorts", func() { WithPool(route, poolLayers, "a", "b", "c") }, "every deployment"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if r := fmt.Sprint(recover()); !strings.Contains(r, tc.want) {
					t.Errorf("panicked with %q, want it to say %q", r, tc.want)
				}
			}()
			tc.f()
		})
	}
}

// While Redis is unavailable, FallbackLocal shares each deployment's
// limits: a fleet of two Transports, each with half of each deployment,
// draws no 429 and uses every deployment, the larger more.
func testPoolFallbackLocal(t *testing.T) {
	srv := redistest.Start(t)
	fast := func(o *redis.Options) { o.MaxRetries = -1; o.DialTimeout = 200 * time.Millisecond }
	clients := []*redis.Client{srv.Client(t, fast), srv.Client(t, fast)}
	srv.Kill()
	provider := newPoolProvider(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	wg := poolFleet(ctx, t, provider, clients, 24, 0, WithPool(poolRoute, poolLayers), WithPolicy(FallbackLocal(2)))
	wg.Wait()
	from := 500 * time.Millisecond
	a, b, c := provider.count(from, time.Hour, http.StatusOK, "a"), provider.count(from, time.Hour, http.StatusOK, "b"), provider.count(from, time.Hour, http.StatusOK, "c")
	refused := provider.count(0, time.Hour, http.StatusTooManyRequests)
	t.Logf("local shares, from 0.5 s to 2 s: a %d, b %d, c %d requests, refused %d", a, b, c, refused)
	if refused > 0 || a <= b || b <= c || c == 0 {
		t.Errorf("under FallbackLocal the deployments served a %d, b %d, c %d and refused %d, want a > b > c > 0 and none refused", a, b, c, refused)
	}
}

// On a Redis Cluster a pool's deployments share their pool's slot: the
// pool's take runs there, one script call a request, with no CROSSSLOT.
func TestPoolOnACluster(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 0)
	cc := cluster.Client(t)
	cmds := newCmdCounter()
	cc.AddHook(cmds)
	var mu sync.Mutex
	served := map[string]int{}
	tr := NewTransport(cc, PerSecond(1), WithKey(Fixed("gpt-4o")), WithPool(poolRoute, poolLayers),
		WithCost(func(*http.Request) float64 { return poolCost }),
		WithBase(roundTripFunc(func(req *http.Request) (*http.Response, error) {
			mu.Lock()
			served[req.Header.Get("X-Deployment")]++
			mu.Unlock()
			return &http.Response{StatusCode: http.StatusOK, Body: http.NoBody, Request: req}, nil
		})))
	client := &http.Client{Transport: tr}
	for range 30 {
		resp, err := client.Get("https://gpt-4o.example/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	if ops := cmds.byOp(); ops["pool"] != 30 || served["a"]+served["b"]+served["c"] != 30 || served["c"] == 0 {
		t.Errorf("30 requests on a cluster went %v, with script calls %v", served, ops)
	}
}
