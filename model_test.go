package quota

import (
	"context"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// The model-based test: each seed draws a sequence of events on one bucket
// shared by three workers (a Limiter and a Transport each, with a Redis
// client of their own, one of them metered: it reserves 2 tokens and
// settles at 1): a provider's 429 with Retry-After, operator pauses,
// pauses forever and their Resume, changes of the Limit, a worker that
// stops. The run records when each request reached the provider and what
// the promises say of each instant, and checkModel checks them:
//
//  1. inside a pause, nothing beyond what the rate allows in its first
//     50 ms, and at most one from then to 50 ms before its end;
//  2. a second that lies a second or more after every pause's end and
//     every change of the Limit holds at most the burst and the rate of
//     the Limit in force, and a margin of 3 or 20%;
//  3. outside pauses the callers are served: no gap between arrivals, or
//     from a pause's end to the first arrival after it, is above 1.5 s;
//  4. the workers send Redis fewer than 10 commands a second per caller.
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
)

// modelStep is one event of a plan, at an offset from the run's start.
type modelStep struct {
	at     time.Duration
	kind   string // 429, pause, forever, resume, set, clear, stop
	what   string
	d      time.Duration
	lim    Limit
	worker int
}

func (s modelStep) String() string { return s.at.Round(time.Millisecond).String() + " " + s.what }

// modelPlan draws the events of a seed. It plans a 429 only when no pause
// is planned to be in force, as a paused fleet sends nothing to answer.
func modelPlan(seed uint64) []modelStep {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	var steps []modelStep
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
			return steps
		}
		s := modelStep{at: at}
		switch k := rng.IntN(10); {
		case k < 2:
			s.kind, s.d = "429", time.Duration(1+rng.IntN(2))*time.Second
			s.what = "429 Retry-After " + s.d.String()
			if resumeAt > 0 || at < pausedUntil+200*time.Millisecond || at+s.d+200*time.Millisecond > modelLast {
				continue
			}
			pausedUntil = at + s.d + 200*time.Millisecond // the 429 comes with the next arrival
		case k < 4:
			s.kind, s.d = "pause", time.Duration(500+rng.IntN(1500))*time.Millisecond
			s.what = "Pause(" + s.d.String() + ")"
			if resumeAt == 0 && at+s.d > modelLast {
				continue
			}
			pausedUntil = max(pausedUntil, at+s.d)
		case k < 5:
			r := at + time.Duration(500+rng.IntN(1500))*time.Millisecond
			if resumeAt > 0 || r > modelLast {
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
		case k < 9:
			s.kind, s.what = "clear", "ClearLimit"
		default:
			if stopped {
				continue
			}
			s.kind, s.worker, stopped = "stop", rng.IntN(modelWorkers), true
			s.what = "stop worker " + strconv.Itoa(s.worker)
		}
		steps = append(steps, s)
	}
}

// modelPause is a pause as the promise sees it, or a Resume (resume set),
// which ends every pause in force at from.
type modelPause struct {
	what     string
	from, to time.Time
	resume   bool
}

// modelChange is a change of the Limit in force, from at.
type modelChange struct {
	at  time.Time
	lim Limit
}

// modelRecord is what a run recorded, all that checkModel reads.
type modelRecord struct {
	start, end time.Time
	base       Limit
	arrivals   []time.Time // sorted
	pauses     []modelPause
	changes    []modelChange
	cmds       []time.Time // sorted: the workers' Redis commands
	callers    int         // the callers waiting at the start
	stops      []time.Time // when a worker's callers stopped
}

// callersAt is how many callers wait at t.
func (r *modelRecord) callersAt(t time.Time) int {
	return r.callers - modelGoroutines*between(r.stops, time.Time{}, t)
}

// limitAt is the Limit in force at t: the last change before it, or base.
func (r *modelRecord) limitAt(t time.Time) Limit {
	lim := r.base
	for _, c := range r.changes {
		if !c.at.After(t) {
			lim = c.lim
		}
	}
	return lim
}

// held merges the pauses: a pause that begins inside another extends it,
// never shortens it, and a Resume ends the pause in force.
func (r *modelRecord) held() []held {
	ps := slices.Clone(r.pauses)
	slices.SortStableFunc(ps, func(a, b modelPause) int { return a.from.Compare(b.from) })
	var out []held
	for _, p := range ps {
		open := len(out) > 0 && p.from.Before(out[len(out)-1].to)
		switch {
		case p.resume && open:
			out[len(out)-1].to = p.from
			out[len(out)-1].what += ", Resume"
		case p.resume:
		case open:
			last := &out[len(out)-1]
			if p.to.After(last.to) {
				last.to = p.to
			}
			last.what += ", " + p.what
		default:
			out = append(out, held{p.what, p.from, p.to, r.limitAt(p.from)})
		}
	}
	return out
}

// checkModel checks the promises against a record and returns each
// violation, with the figures behind it, and a summary of the figures.
func checkModel(r *modelRecord) (violations []string, summary string) {
	ts := r.arrivals
	hs := r.held()
	paused := func(t time.Time) bool {
		for _, h := range hs {
			if !t.Before(h.from) && t.Before(h.to) {
				return true
			}
		}
		return false
	}
	var sum strings.Builder
	// 1. Inside each pause.
	for _, h := range hs {
		early := between(ts, h.from, h.from.Add(pauseMargin))
		inside := between(ts, h.from.Add(pauseMargin), h.to.Add(-pauseMargin))
		allowed := int(math.Ceil(h.lim.Rate*pauseMargin.Seconds())) + 3
		desc := fmt.Sprintf("pause [%s] at %v for %v under %v: %d arrivals in its first 50 ms (%d allowed), %d from then to 50 ms before its end (1 allowed)",
			h.what, h.from.Sub(r.start).Round(time.Millisecond), h.to.Sub(h.from).Round(time.Millisecond), h.lim, early, allowed, inside)
		fmt.Fprintf(&sum, "\n  %s", desc)
		if early > allowed || inside > 1 {
			violations = append(violations, "promise 1: "+desc)
		}
	}
	// 2. Seconds clear of pauses and changes, each under the Limit in force.
	cuts := []time.Time{r.start, r.end}
	for _, h := range hs {
		cuts = append(cuts, h.from, h.to)
	}
	for _, c := range r.changes {
		cuts = append(cuts, c.at)
	}
	slices.SortFunc(cuts, time.Time.Compare)
	for i := 0; i+1 < len(cuts); i++ {
		a, b := cuts[i], cuts[i+1]
		if b.Sub(a) < 2*time.Second || paused(a.Add(b.Sub(a)/2)) {
			continue
		}
		lim := r.limitAt(a)
		n, worst := 0, time.Time{}
		for j, at := range ts {
			w := at
			if w.Before(a.Add(time.Second)) || w.Add(time.Second).After(b) {
				continue
			}
			if c := between(ts[j:], w, w.Add(time.Second)); c > n {
				n, worst = c, w
			}
		}
		limit := bound(lim, time.Second)
		limit += max(3, int(math.Ceil(0.2*float64(limit))))
		fmt.Fprintf(&sum, "\n  from %v to %v under %v: at most %d in a second (bound %d)",
			a.Sub(r.start).Round(time.Millisecond), b.Sub(r.start).Round(time.Millisecond), lim, n, limit)
		if n > limit {
			violations = append(violations, fmt.Sprintf("promise 2: %d arrivals in the second from %v, under %v (bound %d)",
				n, worst.Sub(r.start).Round(time.Millisecond), lim, limit))
		}
	}
	// 3. No stall outside pauses: from a second in, each gap between two
	// arrivals, a pause's end and the next arrival, or the last arrival and
	// the next pause or the end.
	at := r.start.Add(time.Second)
	longest := time.Duration(0)
	for _, t := range append(slices.Clone(ts), r.end) {
		if t.Before(at) {
			continue
		}
		for _, h := range hs {
			if h.from.Before(t) && h.to.After(at) { // a pause between at and t
				if gap := h.from.Sub(at); gap > modelStall {
					violations = append(violations, fmt.Sprintf("promise 3: no arrival for %v from %v, before the pause [%s]",
						gap.Round(time.Millisecond), at.Sub(r.start).Round(time.Millisecond), h.what))
				}
				at = h.to
			}
		}
		if gap := t.Sub(at); gap > modelStall {
			violations = append(violations, fmt.Sprintf("promise 3: no arrival for %v from %v outside pauses (callers wait)",
				gap.Round(time.Millisecond), at.Sub(r.start).Round(time.Millisecond)))
		}
		if t.After(at) {
			longest, at = max(longest, t.Sub(at)), t
		}
	}
	// 4. Redis commands per caller and second.
	calls, callers, perCaller := 0, 0, 0.0
	for i, c := range r.cmds {
		n, m := between(r.cmds[i:], c, c.Add(time.Second)), r.callersAt(c)
		if f := float64(n) / float64(m); f > perCaller {
			calls, callers, perCaller = n, m, f
		}
	}
	if perCaller >= modelCallsPerS {
		violations = append(violations, fmt.Sprintf("promise 4: %d Redis commands in a second for %d callers: %.1f each, fewer than %d allowed",
			calls, callers, perCaller, modelCallsPerS))
	}
	fmt.Fprintf(&sum, "\n  %d arrivals; the longest gap outside pauses %v; at most %d Redis commands in a second for %d callers (%.1f each; %d in all)",
		len(ts), longest.Round(time.Millisecond), calls, callers, perCaller, len(r.cmds))
	return violations, sum.String()
}

// within returns the sorted instants of ts in [from, to).
func within(ts []time.Time, from, to time.Time) []time.Time {
	return ts[between(ts, time.Time{}, from) : len(ts)-between(ts, to, to.Add(time.Hour))]
}

// cmdTimes is a go-redis hook that records when each command is sent.
type cmdTimes struct{ timeline }

func (c *cmdTimes) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *cmdTimes) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.add(time.Now())
		return next(ctx, cmd)
	}
}

func (c *cmdTimes) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for range cmds {
			c.add(time.Now())
		}
		return next(ctx, cmds)
	}
}

// runModel runs the plan on srv against a provider of its own and returns
// the record, and the errors of the operator's calls and of the workers'
// requests; opts go to each worker's Transport.
func runModel(t *testing.T, srv *redistest.Server, plan []modelStep, opts ...TransportOption) (*modelRecord, []error) {
	var mu sync.Mutex
	armed := 0 // the Retry-After of the next arrival's 429, if above zero
	p := newPacedProvider(t, func(int, time.Time) int {
		mu.Lock()
		defer mu.Unlock()
		s := armed
		armed = 0
		return s
	})
	name, ctx := p.name(), context.Background()
	operator := NewLimiter(srv.Client(t))
	cmds := &cmdTimes{}
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
	for w := range modelWorkers {
		rdb := srv.Client(t)
		rdb.AddHook(cmds)
		o := slices.Clone(opts)
		if w == 0 { // metered: reserves 2 tokens, gives 1 back
			o = append(o, WithCost(func(*http.Request) float64 { return 2 }),
				WithSettle(func(*http.Response) (float64, bool) { return 1, true }))
		}
		client := &http.Client{Transport: NewTransport(rdb, modelBase, o...)}
		ctx, cancel := context.WithCancel(context.Background())
		var wg sync.WaitGroup
		for range modelGoroutines {
			wg.Go(func() {
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, p.URL, nil)
					resp, err := client.Do(req)
					if err != nil {
						if ctx.Err() == nil {
							fail(fmt.Errorf("worker %d: %w", w, err))
							return
						}
						continue
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		}
		stops = append(stops, func() { cancel(); wg.Wait() })
	}
	r := &modelRecord{start: time.Now(), base: modelBase, callers: modelWorkers * modelGoroutines}
	for _, s := range plan {
		sleepUntil(r.start.Add(s.at))
		called := time.Now()
		var err error
		switch s.kind {
		case "429":
			mu.Lock()
			armed = int(s.d / time.Second)
			mu.Unlock()
			select {
			case sent := <-p.rejected:
				r.pauses = append(r.pauses, modelPause{what: s.what, from: sent, to: sent.Add(s.d)})
			case <-time.After(time.Second):
				mu.Lock()
				armed = 0
				mu.Unlock()
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
			r.stops = append(r.stops, called)
			stops[s.worker]()
		}
		if err != nil {
			fail(fmt.Errorf("%v: %w", s, err))
		}
	}
	sleepUntil(r.start.Add(modelRun))
	r.end = time.Now()
	for _, stop := range stops {
		stop()
	}
	r.arrivals, r.cmds = within(p.arrived.sorted(), r.start, r.end), within(cmds.sorted(), r.start, r.end)
	return r, errs
}

// modelSeeds are the seeds TestModelSequences runs: fixed ones, or
// QUOTA_SOAK_SEEDS from QUOTA_SOAK_FIRST.
func modelSeeds(t *testing.T) []uint64 {
	n, err := strconv.Atoi(os.Getenv("QUOTA_SOAK_SEEDS"))
	if err != nil || n <= 0 {
		return []uint64{1, 2, 3}
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
	srv := redistest.Start(t)
	for _, seed := range modelSeeds(t) {
		t.Run("seed="+strconv.FormatUint(seed, 10), func(t *testing.T) {
			t.Parallel()
			plan := modelPlan(seed)
			r, errs := runModel(t, srv, plan)
			for _, err := range errs {
				t.Errorf("seed %d: %v", seed, err)
			}
			violations, summary := checkModel(r)
			t.Logf("seed %d, plan %v:%s", seed, plan, summary)
			for _, v := range violations {
				t.Errorf("seed %d: %s", seed, v)
			}
		})
	}
}

// TestModelNegativeControl: the same run with the pauses of the 429s made
// invisible to the workers (WithMaxPause(0): each worker finds the 429 on
// its own) must fail the checker, and so must records with arrivals
// inside a pause, none after a Resume, or too many in a second.
func TestModelNegativeControl(t *testing.T) {
	t.Parallel()
	t.Run("checker", func(t *testing.T) {
		start := time.Now()
		r := &modelRecord{start: start, end: start.Add(4 * time.Second), base: modelBase, callers: 1,
			pauses: []modelPause{{what: "Pause(1s)", from: start.Add(time.Second), to: start.Add(2 * time.Second)}}}
		for at := time.Duration(0); at < 4*time.Second; at += 100 * time.Millisecond {
			r.arrivals = append(r.arrivals, start.Add(at))
		}
		if violations, _ := checkModel(r); len(violations) != 1 || !strings.HasPrefix(violations[0], "promise 1") {
			t.Errorf("arrivals every 100 ms through a pause: violations %q, want one of promise 1", violations)
		}
		r.pauses[0].to = start.Add(4 * time.Second)
		r.arrivals = r.arrivals[:between(r.arrivals, start, start.Add(time.Second))]
		r.end = start.Add(6 * time.Second)
		r.pauses = append(r.pauses, modelPause{what: "Resume", from: start.Add(2 * time.Second), resume: true})
		if violations, _ := checkModel(r); len(violations) != 1 || !strings.HasPrefix(violations[0], "promise 3") {
			t.Errorf("no arrival after a Resume: violations %q, want one of promise 3", violations)
		}
		r = &modelRecord{start: start, end: start.Add(3 * time.Second), base: modelBase, callers: 1}
		for at := time.Duration(0); at < 3*time.Second; at += 25 * time.Millisecond {
			r.arrivals = append(r.arrivals, start.Add(at))
			r.cmds = append(r.cmds, start.Add(at))
		}
		if violations, _ := checkModel(r); len(violations) != 2 || !strings.HasPrefix(violations[0], "promise 2") || !strings.HasPrefix(violations[1], "promise 4") {
			t.Errorf("40 arrivals and commands a second for one caller under 20/s: violations %q, want one of promise 2, one of promise 4", violations)
		}
	})
	t.Run("pauses unseen", func(t *testing.T) {
		redistest.Long(t)
		t.Parallel()
		srv := redistest.Start(t)
		plan := []modelStep{{at: 1500 * time.Millisecond, kind: "429", d: 2 * time.Second, what: "429 Retry-After 2s"},
			{at: 4500 * time.Millisecond, kind: "429", d: time.Second, what: "429 Retry-After 1s"}}
		r, errs := runModel(t, srv, plan, WithMaxPause(0))
		if len(errs) > 0 {
			t.Error(errs)
		}
		violations, summary := checkModel(r)
		t.Logf("WithMaxPause(0), plan %v:%s", plan, summary)
		n := 0
		for _, v := range violations {
			if strings.HasPrefix(v, "promise 1") {
				n++
			}
		}
		if n != 2 {
			t.Errorf("two 429s the workers do not pause for: violations %q, want two of promise 1", violations)
		}
	})
}
