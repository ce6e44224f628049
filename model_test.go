package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// The model-based test: each seed draws a sequence of events on one bucket
// shared by three workers (a Limiter and a Transport each, under
// FallbackLocal(3), with a Redis client of their own, one of them metered:
// it reserves 2 tokens and settles at 1): a provider's 429 with
// Retry-After, operator pauses, pauses forever and their Resume, changes
// of the Limit, a worker that stops, and Redis killed and restarted
// empty, which forgets the bucket's record (an override with it). Each
// seed also draws what the workers' requests do besides: hold one of the
// bucket's two slots (WithConcurrency, or AcquireSlot around the request;
// fewer slots than workers, so that a worker's callers may all wait for
// one), name one of two tenants (WithTenants), and in each worker one
// caller of priority 1, which pauses a second between its requests
// (priority 0's minimum share is a half). The run records when each
// request reached the provider, how many were there, when each caller
// asked and was answered, and what the promises say of each instant, and
// checkModel checks them:
//
//  1. inside a pause, nothing beyond what the rate allows in its first
//     50 ms, and at most one from then to 50 ms before its end;
//  2. a second that lies a second or more after every pause's end, every
//     change of the Limit and every outage's hand-over holds at most the
//     burst and the rate of the Limit in force, and a margin of 3 or 20%;
//     a second around an outage, the local shares' bursts and a tenth of
//     the rate more (docs/outages.md);
//  3. outside pauses and outages the fleet is served: no gap between
//     arrivals, or from the end of a pause or of an outage's hand-over to
//     the first arrival after it, is above 1.5 s;
//  4. each worker sends Redis fewer than 10 commands a second per caller,
//     besides 4 for each request answered (its slot, its release, its
//     take, its settle);
//  5. each caller is served at the rate: a wait for an answer, less the
//     time pauses and outages held it, is at most what serving every
//     caller once takes at the lowest rate in force meanwhile, and 1.5 s,
//     and nobody of its priority or below was served more than twice
//     meanwhile (and 4 more), or as much more as its tenant has fewer
//     callers;
//  6. with slots, the provider never has more requests in flight than
//     the bucket's slots; during an outage, until the fleet is back on
//     the shared slots, the local shares' slots more (see checkInFlight).
//
// An outage lasts, for the promises, from the kill to modelRejoin after
// Redis answers again: the probes find it within half a second, and the
// fleet resumes the shared bucket 750 ms after the first does.
//
// QUOTA_SOAK_SEEDS=N runs N seeds from QUOTA_SOAK_FIRST (1 by default) in
// place of the fixed ones: make soak SEEDS=50.

var modelBase = Limit{Rate: 20, Burst: 2}

const (
	modelWorkers    = 3
	modelGoroutines = 4
	modelLast       = 5500 * time.Millisecond // every pause has ended by then
	modelRun        = 8 * time.Second
	modelStall      = 1500 * time.Millisecond
	modelCallsPerS  = 10
	// modelCallsPerRequest is what serving a request may cost: its slot,
	// its release, its take, its settle.
	modelCallsPerRequest = 4
	modelRejoin          = 1250 * time.Millisecond
	modelSlots           = 2
	// modelLatency is how long the provider takes over a request it does
	// not reject: with slots, as long as the slots keep the rate.
	modelLatency     = 20 * time.Millisecond
	modelSlotLatency = modelSlots * time.Second / 20
	// modelLease is the slots' lease: a waiter that hears nothing renews a
	// quarter of it later.
	modelLease    = 20 * time.Second
	modelDeadline = 20 * time.Second // each request's: callers keep their place in a long queue
	modelMinShare = 0.5
)

// modelFeatures are what a seed's requests do besides taking a token.
type modelFeatures struct {
	slots    string // "transport" (WithConcurrency), "acquire" (AcquireSlot), or none
	tenants  bool
	priority bool
	// daily adds a daily layer of a count the run cannot spend, which
	// resets during the run: the promises stand beside it.
	daily bool
}

func (f modelFeatures) String() string {
	var s []string
	if f.slots != "" {
		s = append(s, "slots by "+f.slots)
	}
	if f.tenants {
		s = append(s, "tenants")
	}
	if f.priority {
		s = append(s, "priorities")
	}
	if f.daily {
		s = append(s, "a daily layer")
	}
	if len(s) == 0 {
		return "tokens alone"
	}
	return strings.Join(s, ", ")
}

// modelStep is one event of a plan, at an offset from the run's start.
type modelStep struct {
	at     time.Duration
	kind   string // 429, pause, forever, resume, set, clear, stop, restart
	what   string
	d      time.Duration
	lim    Limit
	worker int
}

func (s modelStep) String() string { return s.at.Round(time.Millisecond).String() + " " + s.what }

// modelPlan draws the features and the events of a seed. It plans a 429
// only when no pause is planned to be in force, as a paused fleet sends
// nothing to answer. In 7 seeds of 10 Redis is killed and restarted
// empty, away from every other event: an operator needs Redis, a pause
// would be forgotten, and the promises of a second after a change and of
// one around an outage are each checked on their own.
func modelPlan(seed uint64) (modelFeatures, []modelStep) {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	f := modelFeatures{
		slots:    []string{"", "", "transport", "acquire"}[rng.IntN(4)],
		tenants:  rng.IntN(2) == 0,
		priority: rng.IntN(2) == 0,
		daily:    rand.New(rand.NewPCG(seed, 1)).IntN(2) == 0, // a stream of its own: the plans drawn before stay
	}
	var steps []modelStep
	away := func(from, to time.Duration) bool { return true }
	if rng.IntN(10) < 7 {
		s := modelStep{at: time.Duration(1500+rng.IntN(2500)) * time.Millisecond, kind: "restart",
			d: time.Duration(300+rng.IntN(700)) * time.Millisecond}
		s.what = "Redis killed, restarted " + s.d.String() + " later"
		steps = append(steps, s)
		// The zone starts a second early for the changes of the Limit:
		// the second before the kill is checked under the Limit then.
		zone := [2]time.Duration{s.at - time.Second, s.at + s.d + modelRejoin + 300*time.Millisecond}
		away = func(from, to time.Duration) bool { return to < zone[0] || from > zone[1] }
	}
	var pausedUntil, resumeAt time.Duration
	stopped := false
	at := time.Second
	for {
		at += time.Duration(300+rng.IntN(700)) * time.Millisecond
		if resumeAt > 0 && at >= resumeAt {
			steps = append(steps, modelStep{at: resumeAt, kind: "resume", what: "Resume"})
			pausedUntil, resumeAt = resumeAt, 0
		}
		if at >= modelLast {
			slices.SortStableFunc(steps, func(a, b modelStep) int { return int(a.at - b.at) })
			return f, steps
		}
		s := modelStep{at: at}
		switch k := rng.IntN(10); {
		case k < 2:
			s.kind, s.d = "429", time.Duration(1+rng.IntN(2))*time.Second
			s.what = "429 Retry-After " + s.d.String()
			if resumeAt > 0 || at < pausedUntil+200*time.Millisecond || at+s.d+200*time.Millisecond > modelLast ||
				!away(at, at+s.d+time.Second) {
				continue
			}
			pausedUntil = at + s.d + 200*time.Millisecond // the 429 comes with the next arrival
		case k < 4:
			s.kind, s.d = "pause", time.Duration(500+rng.IntN(1500))*time.Millisecond
			s.what = "Pause(" + s.d.String() + ")"
			if resumeAt == 0 && at+s.d > modelLast || !away(at, at+s.d) {
				continue
			}
			pausedUntil = max(pausedUntil, at+s.d)
		case k < 5:
			r := at + time.Duration(500+rng.IntN(1500))*time.Millisecond
			if resumeAt > 0 || r > modelLast || !away(at, r) {
				continue
			}
			s.kind, s.what, resumeAt = "forever", "Pause(Forever)", r
		case k < 8:
			s.kind = "set"
			if rng.IntN(2) == 0 {
				s.lim = Limit{Rate: float64(5 + rng.IntN(6)), Burst: float64(2 + rng.IntN(2))}
			} else {
				s.lim = Limit{Rate: float64(30 + rng.IntN(11)), Burst: float64(3 + rng.IntN(2))}
			}
			s.what = "SetLimit(" + s.lim.String() + ")"
			if !away(at, at) {
				continue
			}
		case k < 9:
			s.kind, s.what = "clear", "ClearLimit"
			if !away(at, at) {
				continue
			}
		default:
			if stopped || !away(at, at) {
				continue
			}
			s.kind, s.worker, stopped = "stop", rng.IntN(modelWorkers), true
			s.what = "stop worker " + strconv.Itoa(s.worker)
		}
		steps = append(steps, s)
	}
}

// modelProvider is the provider of a run: it records when each request
// arrived and how many were in flight, and answers the next arrival with
// a 429 and Retry-After when armed.
type modelProvider struct {
	*httptest.Server
	arrived  timeline
	rejected chan time.Time // each 429, as it is answered
	flying   atomic.Int32

	mu    sync.Mutex
	armed int // the Retry-After of the next arrival's 429, if above zero
	loads []modelLoad
}

func newModelProvider(t *testing.T, latency time.Duration) *modelProvider {
	p := &modelProvider{rejected: make(chan time.Time, 16)}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		n := p.flying.Add(1)
		defer p.flying.Add(-1)
		p.arrived.add(now)
		p.mu.Lock()
		p.loads = append(p.loads, modelLoad{now, int(n)})
		s := p.armed
		p.armed = 0
		p.mu.Unlock()
		if s > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(s))
			w.WriteHeader(http.StatusTooManyRequests)
			p.rejected <- now
			return
		}
		// A request whose caller gave up (a worker that stopped) is no
		// longer in flight for it: its slot went back when it gave up.
		select {
		case <-time.After(latency):
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(p.Close)
	return p
}

func (p *modelProvider) arm(s int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.armed = s
}

// runModel runs the plan on srv against a provider of its own and returns
// the record, and the errors of the operator's calls and of the workers'
// requests; opts go to each worker's Transport.
func runModel(t *testing.T, srv *redistest.Server, f modelFeatures, plan []modelStep, opts ...TransportOption) (*modelRecord, []error) {
	latency := modelLatency
	if f.slots != "" {
		latency = modelSlotLatency
	}
	p := newModelProvider(t, latency)
	name, ctx := strings.TrimPrefix(p.URL, "http://"), context.Background()
	operator := NewLimiter(srv.Client(t))
	r := &modelRecord{base: modelBase, callers: make([]modelCaller, modelWorkers*modelGoroutines)}
	if f.slots != "" {
		r.slots = modelSlots
	}
	if f.priority {
		r.minShare = modelMinShare
	}
	var mu sync.Mutex // guards errs and r.callers while the workers run
	var errs []error
	fail := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		errs = append(errs, err)
	}
	var stops []func()
	defer func() {
		for _, stop := range stops {
			stop() // stopping twice only waits again
		}
	}()
	var cmds []*cmdTimes
	reset := time.Now().UTC().Add(modelRun / 2) // the daily layer's, during the run
	dailyAt := reset.Sub(reset.Truncate(24 * time.Hour))
	for w := range modelWorkers {
		rdb := redis.NewClient(faultOptions(srv.Addr()))
		t.Cleanup(func() { rdb.Close() })
		c := &cmdTimes{}
		rdb.AddHook(c)
		cmds = append(cmds, c)
		o := append([]TransportOption{WithPolicy(FallbackLocal(modelWorkers)), WithSlotLease(modelLease), WithLogger(discardLogger())}, opts...)
		if w == 0 { // metered: reserves 2 tokens, gives 1 back
			o = append(o, WithCost(func(*http.Request) float64 { return 2 }),
				WithSettle(func(*http.Response) (float64, bool) { return 1, true }))
		}
		if f.slots == "transport" {
			// A stopped worker's requests in flight keep their slots as
			// long as the provider may work on them. By default that is
			// the lease until 16 response times are known, which a worker
			// stopped early has not: its slots then outlast the run and
			// hold the others back, past the promises' bounds. The model
			// lets them linger twice the provider's time.
			o = append(o, WithConcurrency(modelSlots), WithSlotLinger(2*modelSlotLatency))
		}
		if f.tenants {
			o = append(o, WithTenants(Tenants{}), WithTenant(func(r *http.Request) string { return r.Header.Get("Tenant") }))
		}
		if f.priority {
			o = append(o, WithMinShare(0, modelMinShare))
		}
		if f.daily {
			o = append(o, WithLayers(Daily(1e6, dailyAt, time.UTC)))
		}
		tr := NewTransport(rdb, modelBase, o...)
		l := tr.Limiter()
		client := &http.Client{Transport: tr}
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for g := range modelGoroutines {
			i := w*modelGoroutines + g
			prio := 0
			if f.priority && g == 0 {
				prio = 1
			}
			tenant := ""
			if f.tenants {
				tenant = "t" + strconv.Itoa(g%2)
			}
			r.callers[i] = modelCaller{worker: w, prio: prio, tenant: tenant}
			wg.Go(func() {
				for ctx.Err() == nil {
					if prio > 0 && sleep(ctx, time.Second) != nil {
						return
					}
					asked := time.Now()
					mu.Lock()
					r.callers[i].waits = append(r.callers[i].waits, modelWait{asked: asked})
					mu.Unlock()
					err := modelRequest(ctx, l, client, p.URL, name, f, prio, tenant, func() {
						mu.Lock()
						r.callers[i].waits[len(r.callers[i].waits)-1].slotted = time.Now()
						mu.Unlock()
					})
					answered := time.Now()
					if ctx.Err() != nil {
						return
					}
					mu.Lock()
					r.callers[i].waits[len(r.callers[i].waits)-1].answered = answered
					mu.Unlock()
					if err != nil {
						// A take larger than the local share's burst (the
						// metered worker's) is refused while the policy
						// serves.
						if errors.Is(err, ErrUnavailable) && (l.Mode() != ModeShared || modelOutageAt(r, &mu, answered)) {
							_ = sleep(ctx, 50*time.Millisecond)
							continue
						}
						fail(fmt.Errorf("worker %d: %w", w, err))
						return
					}
				}
			})
		}
		stops = append(stops, func() { cancel(); wg.Wait() })
	}
	r.start = time.Now()
	for _, s := range plan {
		sleepUntil(r.start.Add(s.at))
		called := time.Now()
		var err error
		switch s.kind {
		case "429":
			p.arm(int(s.d / time.Second))
			select {
			case sent := <-p.rejected:
				r.pauses = append(r.pauses, modelPause{what: s.what, from: sent, to: sent.Add(s.d)})
			case <-time.After(time.Second):
				p.arm(0)
				t.Logf("%v: no arrival within 1s to answer the 429", s)
			}
		case "pause":
			err = operator.Pause(ctx, name, s.d)
			r.pauses = append(r.pauses, modelPause{what: s.what, from: time.Now(), to: called.Add(s.d)})
		case "forever":
			err = operator.Pause(ctx, name, Forever)
			r.pauses = append(r.pauses, modelPause{what: s.what, from: time.Now(), to: r.start.Add(time.Hour)})
		case "resume":
			err = operator.Resume(ctx, name)
			r.pauses = append(r.pauses, modelPause{what: s.what, from: time.Now(), resume: true})
		case "set":
			err = operator.SetLimit(ctx, name, s.lim)
			r.changes = append(r.changes, modelChange{called, s.lim})
		case "clear":
			err = operator.ClearLimit(ctx, name)
			r.changes = append(r.changes, modelChange{called, modelBase})
		case "stop":
			mu.Lock()
			for i := range r.callers {
				if r.callers[i].worker == s.worker {
					r.callers[i].stopped = called
				}
			}
			mu.Unlock()
			stops[s.worker]()
		case "restart":
			srv.Kill()
			killed := time.Now()
			mu.Lock()
			r.outages = append(r.outages, modelOutage{kill: killed, back: killed.Add(time.Hour)})
			mu.Unlock()
			time.Sleep(s.d)
			srv.Restart()
			back := time.Now()
			mu.Lock()
			r.outages[len(r.outages)-1].back = back
			mu.Unlock()
			// Redis forgot the bucket's record with the rest: an
			// override is gone, and the callers' Limit is in force.
			r.changes = append(r.changes, modelChange{back, modelBase})
		}
		if err != nil {
			fail(fmt.Errorf("%v: %w", s, err))
		}
	}
	sleepUntil(r.start.Add(modelRun))
	r.end = time.Now()
	r.record = modelDump(srv)
	for _, stop := range stops {
		stop()
	}
	r.arrivals = within(p.arrived.sorted(), r.start, r.end)
	for _, c := range cmds {
		r.cmds = append(r.cmds, within(c.sorted(), r.start, r.end))
	}
	p.mu.Lock()
	for _, l := range p.loads {
		if !l.at.Before(r.start) && l.at.Before(r.end) {
			r.loads = append(r.loads, l)
		}
	}
	p.mu.Unlock()
	return r, errs
}

// modelOutageAt reports whether t lies in an outage of r, as far as its
// hand-over (mu guards r.outages while the run goes on).
func modelOutageAt(r *modelRecord, mu *sync.Mutex, t time.Time) bool {
	mu.Lock()
	defer mu.Unlock()
	for _, o := range r.outages {
		if !t.Before(o.kill) && t.Before(o.back.Add(modelRejoin)) {
			return true
		}
	}
	return false
}

// modelRequest sends one request of a caller of priority prio for tenant
// through client, holding one of the bucket's slots from l first when
// the seed's slots are acquired with AcquireSlot.
func modelRequest(ctx context.Context, l *Limiter, client *http.Client, url, name string, f modelFeatures, prio int, tenant string, slotted func()) error {
	ctx, cancel := context.WithTimeout(ctx, modelDeadline)
	defer cancel()
	if prio > 0 {
		ctx = ContextWithPriority(ctx, prio)
	}
	if f.slots == "acquire" {
		slot, err := l.AcquireSlot(ctx, name, modelSlots)
		if err != nil {
			return err
		}
		defer slot.Release()
		slotted()
	}
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	req.Header.Set("Tenant", tenant)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.Body.Close()
}

// modelSeeds are the seeds TestModelSequences runs: fixed ones, or
// QUOTA_SOAK_SEEDS from QUOTA_SOAK_FIRST. The fixed ones hold slots, one
// by AcquireSlot through two pauses, one by WithConcurrency under
// priorities through a restart, and one by AcquireSlot through a restart
// (on which a worker whose callers all waited for slots used to stall).
func modelSeeds(t *testing.T) []uint64 {
	n, err := strconv.Atoi(os.Getenv("QUOTA_SOAK_SEEDS"))
	if err != nil || n <= 0 {
		return []uint64{1, 3, 4}
	}
	first := uint64(1)
	if f := os.Getenv("QUOTA_SOAK_FIRST"); f != "" {
		if first, err = strconv.ParseUint(f, 10, 64); err != nil {
			t.Fatalf("QUOTA_SOAK_FIRST=%q: %v", f, err)
		}
	}
	var seeds []uint64
	for i := range uint64(n) {
		seeds = append(seeds, first+i)
	}
	return seeds
}

func TestModelSequences(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, seed := range modelSeeds(t) {
		t.Run("seed="+strconv.FormatUint(seed, 10), func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t) // a server of its own: it may be restarted
			f, plan := modelPlan(seed)
			r, errs := runModel(t, srv, f, plan)
			for _, err := range errs {
				t.Errorf("seed %d: %v", seed, err)
			}
			violations, summary := checkModel(r)
			t.Logf("seed %d, %v, plan %v:%s", seed, f, plan, summary)
			for _, v := range violations {
				t.Errorf("seed %d: %s", seed, v)
			}
			if len(violations) > 0 {
				t.Logf("seed %d: unanswered at the end:%s\n    Redis at the end:%s", seed, r.unanswered(), r.record)
			}
		})
	}
}

// modelDump returns the keys srv holds and what they hold, for a failure's
// report.
func modelDump(srv *redistest.Server) string {
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1})
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	keys, err := rdb.Keys(ctx, "*").Result()
	if err != nil {
		return err.Error()
	}
	slices.Sort(keys)
	var b strings.Builder
	for _, k := range keys {
		typ, _ := rdb.Type(ctx, k).Result()
		var v any
		switch typ {
		case "string":
			v, _ = rdb.Get(ctx, k).Result()
		case "hash":
			v, _ = rdb.HGetAll(ctx, k).Result()
		case "zset":
			v, _ = rdb.ZRangeWithScores(ctx, k, 0, -1).Result()
		case "list":
			v, _ = rdb.LRange(ctx, k, 0, -1).Result()
		default:
			v = typ
		}
		ttl, _ := rdb.PTTL(ctx, k).Result()
		fmt.Fprintf(&b, "\n      %s (%v): %v", k, ttl, v)
	}
	return b.String()
}
