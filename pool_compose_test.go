package quota

import (
	"context"
	"errors"
	"math"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redistest"
)

// sentIn counts the requests c saw in [from, to).
func sentIn(c *attemptCounter, from, to time.Time) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, at := range c.times {
		if !at.Before(from) && at.Before(to) {
			n++
		}
	}
	return n
}

// runPoolTenants runs two tenants on a pool of a, b and c at a fifth of
// poolLimits (40 requests a second in all): heavy, weight 1, in 24
// goroutines over two Transports, and light, weight 2, in 12 over two
// more, each Transport with a Redis client of its own, for 6 s. It
// returns heavy's share of the requests sent from 2 s to 6 s, their count,
// the 429s, and the pool takes a request sent. With tenants false, the
// Transports name none.
func runPoolTenants(t *testing.T, tenants bool) (share float64, sent, refused int, takes float64) {
	srv := redistest.Start(t)
	provider := newPoolProvider(t)
	lims := map[string][]Limit{}
	for d, lim := range poolLimits {
		lims[d] = []Limit{{Rate: lim.Rate / 5, Burst: 1000}}
	}
	// No deadline: a caller whose wait would pass one is refused at once,
	// and its goroutine would ask again at once.
	ctx, cancel := context.WithCancel(t.Context())
	defer time.AfterFunc(6*time.Second, cancel).Stop()
	start := time.Now()
	base := &http.Transport{MaxIdleConnsPerHost: 36}
	cmds := newCmdCounter()
	client := func() *redis.Client {
		rdb := srv.Client(t)
		rdb.AddHook(cmds)
		return rdb
	}
	run := func(tenant string, goroutines int) (*attemptCounter, *sync.WaitGroup) {
		s := &attemptCounter{next: base}
		opts := []TransportOption{WithPool(poolRoute, lims), WithBase(s)}
		if tenants {
			opts = append(opts, WithTenants(Tenants{Weights: map[string]float64{"heavy": 1, "light": 2}}),
				WithTenant(func(*http.Request) string { return tenant }))
		}
		return s, poolFleet(ctx, t, provider, []*redis.Client{client(), client()}, goroutines, 0, opts...)
	}
	heavy, hwg := run("heavy", 24)
	light, lwg := run("light", 12)
	hwg.Wait()
	lwg.Wait()
	from, to := start.Add(2*time.Second), start.Add(6*time.Second)
	h, l := sentIn(heavy, from, to), sentIn(light, from, to)
	if h+l > 0 {
		share = float64(h) / float64(h+l)
	}
	all := heavy.count() + light.count()
	return share, h + l, provider.count(0, time.Hour, http.StatusTooManyRequests), float64(cmds.byOp()["pool"]) / float64(all)
}

// Tenants share a pool by weight: heavy, weight 1, asking from twice as
// many goroutines as light, weight 2, has a third of what the pool grants
// while both wait, and the pool's deployments are used whole, with no
// 429.
func TestPoolTenants(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	share, sent, refused, takes := runPoolTenants(t, true)
	t.Logf("weights 1 and 2, 24 and 12 goroutines: the heavy tenant had %.3f of %d requests in 4 s, %d 429s, %.2f pool takes a request", share, sent, refused, takes)
	// Each deployment keeps its own books: measured 0.27 to 0.32, a little
	// to the light tenant's side; the control has 0.66 to 0.69.
	if math.Abs(share-1.0/3) > 0.1 {
		t.Errorf("the heavy tenant had %.3f of the requests, want 0.333 ± 0.1", share)
	}
	if want := 0.9 * 40 * 4; float64(sent) < want {
		t.Errorf("%d requests in 4 s, want at least %.0f: 0.9 of the pool's 40 a second", sent, want)
	}
	if refused > 0 {
		t.Errorf("%d 429s, want none", refused)
	}
	if takes > 4 {
		t.Errorf("%.2f pool takes a request, want at most 4: a held take asks again when its turn is due, not in a loop", takes)
	}
}

// The negative control: the same Transports naming no tenant share the
// pool as they ask, the heavy tenant's goroutines about two thirds.
func TestPoolTenantsCatchesOneQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	share, sent, _, takes := runPoolTenants(t, false)
	t.Logf("no tenants, 24 and 12 goroutines: the heavy ones had %.3f of %d requests in 4 s, %.2f pool takes a request", share, sent, takes)
	if share < 0.55 {
		t.Errorf("the heavy goroutines had %.3f of the requests with no tenants, want about 0.667: the control tells nothing", share)
	}
}

// door is a base RoundTripper that holds each request for hold before it
// sends it with next, and counts the requests in flight at it.
type door struct {
	next      http.RoundTripper
	hold      time.Duration
	now, most atomic.Int64
}

func (f *door) RoundTrip(req *http.Request) (*http.Response, error) {
	n := f.now.Add(1)
	defer f.now.Add(-1)
	for m := f.most.Load(); n > m && !f.most.CompareAndSwap(m, n); m = f.most.Load() {
	}
	time.Sleep(f.hold)
	return f.next.RoundTrip(req)
}

// runPoolSlots runs three Transports on a pool of a, b and c, with
// WithConcurrency(slots) when slots > 0, 24 goroutines sending requests
// that take 50 ms, for 2 s. It returns the most requests in flight, the
// answers of each deployment, the 429s and the script calls by op.
func runPoolSlots(t *testing.T, slots int) (most int, served map[string]int, refused int, ops map[string]int) {
	srv := redistest.Start(t)
	provider := newPoolProvider(t)
	ctx, cancel := context.WithCancel(t.Context())
	defer time.AfterFunc(2*time.Second, cancel).Stop()
	f := &door{next: &http.Transport{MaxIdleConnsPerHost: 24}, hold: 50 * time.Millisecond}
	opts := []TransportOption{WithPool(poolRoute, poolLayers), WithBase(f)}
	if slots > 0 {
		opts = append(opts, WithConcurrency(slots))
	}
	cmds := newCmdCounter()
	var clients []*redis.Client
	for range 3 {
		rdb := srv.Client(t)
		rdb.AddHook(cmds)
		clients = append(clients, rdb)
	}
	poolFleet(ctx, t, provider, clients, 24, 0, opts...).Wait()
	served = map[string]int{}
	for _, d := range []string{"a", "b", "c"} {
		served[d] = provider.count(0, time.Hour, http.StatusOK, d)
	}
	return int(f.most.Load()), served, provider.count(0, time.Hour, http.StatusTooManyRequests), cmds.byOp()
}

// WithConcurrency under a pool bounds the requests in flight to any of
// its deployments: 4 slots, 24 goroutines over three Transports, never
// more than 4 in flight, every deployment used, no 429, the slots kept
// busy, and a request's tokens taken in its slot's call. The negative
// control, no slots, has more in flight.
func TestPoolSlots(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	most, served, refused, ops := runPoolSlots(t, 4)
	all := served["a"] + served["b"] + served["c"]
	t.Logf("4 slots: at most %d in flight, %d requests in 2 s (%v), %d 429s; script calls %v", most, all, served, refused, ops)
	if most > 4 {
		t.Errorf("%d requests in flight, want at most the pool's 4 slots", most)
	}
	if served["a"] == 0 || served["b"] == 0 || served["c"] == 0 || refused > 0 {
		t.Errorf("deployments served %v with %d 429s, want every one used and none refused", served, refused)
	}
	// Each request's slot call takes its tokens from the pool, and a
	// hand-off takes a waiter's.
	if calls := float64(ops["acquire"]+ops["pool"]) / float64(all); ops["pool"] > all/10 || calls > 1.5 {
		t.Errorf("%d requests made script calls %v, want their pool takes made with their slots", all, ops)
	}
	// 4 slots of 50 ms requests: 160 in 2 s at most; half of it, for a
	// loaded machine's slower calls and hand-offs.
	if all < 80 {
		t.Errorf("%d requests in 2 s, want at least 80: the slots kept busy", all)
	}
	most, _, _, _ = runPoolSlots(t, 0)
	t.Logf("the control, no slots: at most %d in flight", most)
	if most <= 4 {
		t.Errorf("%d requests in flight with no slots, want more than 4: the control tells nothing", most)
	}
}

// A further layer under a pool is each deployment's own: a daily layer of
// 2 over deployments a and b grants 2 a day on each, and a request that
// finds both days spent is refused WithNoWait, reaching no deployment.
// Priced in tokens of 1, each deployment's Limit never binds.
func TestPoolDailyLayer(t *testing.T) {
	srv := redistest.Start(t)
	provider := newPoolProvider(t)
	reset := time.Duration((time.Now().UTC().Hour()+12)%24) * time.Hour // half a day away
	tr := NewTransport(srv.Client(t), PerSecond(100), WithKey(Fixed("llm")), WithNoWait(),
		WithLayers(Daily(2, reset, time.UTC)),
		WithPool(poolRoute, map[string][]Limit{"a": {PerSecond(100)}, "b": {PerSecond(100)}}))
	client := &http.Client{Transport: tr}
	var errs []error
	for range 5 {
		resp, err := client.Post(provider.srv.URL, "application/json", strings.NewReader("{}"))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		resp.Body.Close()
	}
	a, b := provider.count(0, time.Hour, 0, "a"), provider.count(0, time.Hour, 0, "b")
	if a != 2 || b != 2 || len(errs) != 1 || !errors.Is(errs[0], ErrWouldWait) {
		t.Errorf("5 requests on days of 2: a received %d, b %d, errors %v; want 2, 2 and the 5th refused with ErrWouldWait", a, b, errs)
	}
	for _, d := range []string{"a", "b"} {
		st, err := tr.Limiter().Status(t.Context(), "llm}{"+d)
		if err != nil || len(st.Layers) != 2 || st.Layers[1].Daily == nil || st.Layers[1].Daily.Used != 2 {
			t.Errorf("deployment %s's status: %v, %+v; want its day's layer, 2 used", d, err, st.Layers)
		}
	}
}
