package quota

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// What a run of the model recorded, and the promises checkModel holds it
// to (see model_test.go).

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

// modelOutage is Redis killed, and answering again, empty.
type modelOutage struct{ kill, back time.Time }

// modelCaller is one goroutine of a worker: when it sent each request and
// when the request returned (zero if it had not by the end), and when its
// worker stopped (zero if it did not).
type modelCaller struct {
	worker, prio int
	tenant       string
	waits        []modelWait
	stopped      time.Time
}

// A modelWait is one request of a caller: when it was asked for, when
// its slot was acquired (with AcquireSlot), and when it was answered.
type modelWait struct{ asked, slotted, answered time.Time }

// modelLoad is how many requests were at the provider as one arrived,
// itself included.
type modelLoad struct {
	at time.Time
	n  int
}

// modelRecord is what a run recorded, all that checkModel reads.
type modelRecord struct {
	start, end time.Time
	base       Limit
	arrivals   []time.Time // sorted
	pauses     []modelPause
	changes    []modelChange
	outages    []modelOutage
	callers    []modelCaller
	cmds       [][]time.Time // each worker's Redis commands, sorted
	slots      int           // the slots the requests hold; 0: none
	loads      []modelLoad
	minShare   float64 // of priority 0, when some callers have priority 1
	record     string  // what Redis held at the end (modelDump)
}

// unanswered describes the callers' requests not answered by the end: when
// each was asked for and when it had its slot, for a failure's report.
func (r *modelRecord) unanswered() string {
	var b strings.Builder
	for i, c := range r.callers {
		if len(c.waits) == 0 || !c.stopped.IsZero() {
			continue
		}
		w := c.waits[len(c.waits)-1]
		if !w.answered.IsZero() {
			continue
		}
		slotted := "no slot"
		if !w.slotted.IsZero() {
			slotted = "slot at " + w.slotted.Sub(r.start).Round(time.Millisecond).String()
		}
		fmt.Fprintf(&b, "\n      worker %d's caller %d: asked at %v, %s", c.worker, i, w.asked.Sub(r.start).Round(time.Millisecond), slotted)
	}
	return b.String()
}

// callersAt is how many callers of worker w (all of them when w is below
// 0) wait at t.
func (r *modelRecord) callersAt(w int, t time.Time) int {
	n := 0
	for _, c := range r.callers {
		if (w < 0 || c.worker == w) && (c.stopped.IsZero() || t.Before(c.stopped)) {
			n++
		}
	}
	return n
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

// slowest is the lowest rate in force at any instant of [from, to).
func (r *modelRecord) slowest(from, to time.Time) float64 {
	rate := r.limitAt(from).Rate
	for _, c := range r.changes {
		if c.at.After(from) && c.at.Before(to) {
			rate = min(rate, c.lim.Rate)
		}
	}
	return rate
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

// blocked returns the intervals in which the callers are not owed
// service, sorted: the pauses, and each outage until the fleet is back
// on the shared bucket (modelRejoin after Redis answers again).
func (r *modelRecord) blocked() []held {
	out := r.held()
	for _, o := range r.outages {
		out = append(out, held{what: "outage", from: o.kill, to: o.back.Add(modelRejoin), lim: r.limitAt(o.kill)})
	}
	slices.SortFunc(out, func(a, b held) int { return a.from.Compare(b.from) })
	return out
}

// outside returns how much of [from, to) lies outside every interval of bs.
func outside(bs []held, from, to time.Time) time.Duration {
	d := to.Sub(from)
	at := from // intervals may overlap: count each instant once
	for _, b := range bs {
		lo, hi := maxTime(b.from, at), minTime(b.to, to)
		if hi.After(lo) {
			d -= hi.Sub(lo)
			at = hi
		}
	}
	return d
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func minTime(a, b time.Time) time.Time {
	if a.Before(b) {
		return a
	}
	return b
}

// in reports whether t lies in one of bs.
func in(bs []held, t time.Time) bool {
	for _, b := range bs {
		if !t.Before(b.from) && t.Before(b.to) {
			return true
		}
	}
	return false
}

// checkModel checks the promises against a record and returns each
// violation, with the figures behind it, and a summary of the figures.
func checkModel(r *modelRecord) (violations []string, summary string) {
	var sum strings.Builder
	for _, check := range []func(*modelRecord, *strings.Builder) []string{
		checkPauses, checkWindows, checkFlow, checkCommands, checkCallers, checkInFlight,
	} {
		violations = append(violations, check(r, &sum)...)
	}
	return violations, sum.String()
}

// checkPauses: promise 1, inside each pause.
func checkPauses(r *modelRecord, sum *strings.Builder) (violations []string) {
	ts := r.arrivals
	for _, h := range r.held() {
		early := between(ts, h.from, h.from.Add(pauseMargin))
		inside := between(ts, h.from.Add(pauseMargin), h.to.Add(-pauseMargin))
		allowed := int(math.Ceil(h.lim.Rate*pauseMargin.Seconds())) + 3
		desc := fmt.Sprintf("pause [%s] at %v for %v under %v: %d arrivals in its first 50 ms (%d allowed), %d from then to 50 ms before its end (1 allowed)",
			h.what, h.from.Sub(r.start).Round(time.Millisecond), h.to.Sub(h.from).Round(time.Millisecond), h.lim, early, allowed, inside)
		fmt.Fprintf(sum, "\n  %s", desc)
		if early > allowed || inside > 1 {
			var at []string
			for _, t := range ts {
				if !t.Before(h.from.Add(pauseMargin)) && t.Before(h.to.Add(-pauseMargin)) {
					at = append(at, t.Sub(r.start).Round(time.Millisecond).String())
				}
			}
			violations = append(violations, fmt.Sprintf("promise 1: %s; inside at %s", desc, strings.Join(at, ", ")))
		}
	}
	return violations
}

// checkWindows: promise 2, each second under the Limit in force: the
// seconds clear of pauses, changes and outages, and those around each
// outage.
func checkWindows(r *modelRecord, sum *strings.Builder) (violations []string) {
	ts := r.arrivals
	hs := r.held()
	paused := func(t time.Time) bool { return in(hs, t) }
	busiest := func(from, to time.Time) (int, time.Time) {
		n, worst := 0, time.Time{}
		for j, at := range ts {
			if at.Before(from) || at.Add(time.Second).After(to) {
				continue
			}
			if c := between(ts[j:], at, at.Add(time.Second)); c > n {
				n, worst = c, at
			}
		}
		return n, worst
	}
	margin := func(limit int) int { return limit + max(3, int(math.Ceil(0.2*float64(limit)))) }
	cuts := []time.Time{r.start, r.end}
	for _, h := range hs {
		cuts = append(cuts, h.from, h.to)
	}
	for _, c := range r.changes {
		cuts = append(cuts, c.at)
	}
	for _, o := range r.outages {
		cuts = append(cuts, o.kill, o.back.Add(modelRejoin))
	}
	slices.SortFunc(cuts, time.Time.Compare)
	for i := 0; i+1 < len(cuts); i++ {
		a, b := cuts[i], cuts[i+1]
		if b.Sub(a) < 2*time.Second || paused(a.Add(b.Sub(a)/2)) {
			continue
		}
		lim := r.limitAt(a)
		n, worst := busiest(a.Add(time.Second), b)
		limit := margin(bound(lim, time.Second))
		fmt.Fprintf(sum, "\n  from %v to %v under %v: at most %d in a second (bound %d)",
			a.Sub(r.start).Round(time.Millisecond), b.Sub(r.start).Round(time.Millisecond), lim, n, limit)
		if n > limit {
			violations = append(violations, fmt.Sprintf("promise 2: %d arrivals in the second from %v, under %v (bound %d)",
				n, worst.Sub(r.start).Round(time.Millisecond), lim, limit))
		}
	}
	// Around an outage the local shares, then the hand-over: Burst + Rate,
	// the local shares' bursts and the wake-ups' jitter (docs/outages.md).
	for _, o := range r.outages {
		a, b := o.kill.Add(-time.Second), o.back.Add(modelRejoin+time.Second)
		lim := r.limitAt(o.kill) // the local shares'
		if after := r.limitAt(o.back); after.Rate > lim.Rate {
			lim = after // the restarted bucket's
		}
		shares := modelWorkers * int(math.Max(1, math.Floor(lim.Burst/modelWorkers)))
		limit := margin(bound(lim, time.Second) + shares + int(lim.Rate/10) + 1)
		n, worst := busiest(a, b)
		fmt.Fprintf(sum, "\n  around the outage from %v to %v under %v: at most %d in a second (bound %d)",
			o.kill.Sub(r.start).Round(time.Millisecond), o.back.Sub(r.start).Round(time.Millisecond), lim, n, limit)
		if n > limit {
			violations = append(violations, fmt.Sprintf("promise 2: %d arrivals in the second from %v, around the outage, under %v (bound %d)",
				n, worst.Sub(r.start).Round(time.Millisecond), lim, limit))
		}
	}
	return violations
}

// checkFlow: promise 3, the fleet is served outside pauses and outages:
// from a second in, no gap between two arrivals, the end of a pause or an
// outage and the next arrival, or the last arrival and the next pause or
// the end, is above modelStall.
func checkFlow(r *modelRecord, sum *strings.Builder) (violations []string) {
	bs := r.blocked()
	at := r.start.Add(time.Second)
	longest := time.Duration(0)
	for _, t := range append(slices.Clone(r.arrivals), r.end) {
		if t.Before(at) {
			continue
		}
		for _, h := range bs {
			if h.from.Before(t) && h.to.After(at) { // held between at and t
				if gap := h.from.Sub(at); gap > modelStall {
					violations = append(violations, fmt.Sprintf("promise 3: no arrival for %v from %v, before the %s",
						gap.Round(time.Millisecond), at.Sub(r.start).Round(time.Millisecond), h.what))
				}
				at = maxTime(at, h.to)
			}
		}
		if gap := t.Sub(at); gap > modelStall {
			violations = append(violations, fmt.Sprintf("promise 3: no arrival for %v from %v outside pauses and outages (callers wait)",
				gap.Round(time.Millisecond), at.Sub(r.start).Round(time.Millisecond)))
		}
		if t.After(at) {
			longest, at = max(longest, t.Sub(at)), t
		}
	}
	fmt.Fprintf(sum, "\n  %d arrivals; the longest gap outside pauses and outages %v", len(r.arrivals), longest.Round(time.Millisecond))
	return violations
}

// checkCommands: promise 4, each worker sends Redis fewer than
// modelCallsPerS commands a second for each of its callers, besides
// modelCallsPerRequest for each request answered in that second.
func checkCommands(r *modelRecord, sum *strings.Builder) (violations []string) {
	answered := make([][]time.Time, len(r.cmds))
	for _, c := range r.callers {
		for _, w := range c.waits {
			if !w.answered.IsZero() && c.worker < len(answered) {
				answered[c.worker] = append(answered[c.worker], w.answered)
			}
		}
	}
	worst, calls, answers, callers, perCaller, when := 0, 0, 0, 0, 0.0, time.Time{}
	for w, cmds := range r.cmds {
		for i, c := range cmds {
			m := r.callersAt(w, c)
			if m == 0 {
				continue
			}
			n, a := between(cmds[i:], c, c.Add(time.Second)), between(answered[w], c, c.Add(time.Second))
			if f := float64(n-modelCallsPerRequest*a) / float64(m); f > perCaller {
				worst, calls, answers, callers, perCaller, when = w, n, a, m, f, c
			}
		}
	}
	total := 0
	for _, cmds := range r.cmds {
		total += len(cmds)
	}
	if perCaller >= modelCallsPerS {
		violations = append(violations, fmt.Sprintf("promise 4: worker %d sent %d Redis commands in the second from %v for %d callers, answered %d times: %.1f each besides %d a request, fewer than %d allowed",
			worst, calls, when.Sub(r.start).Round(time.Millisecond), callers, answers, perCaller, modelCallsPerRequest, modelCallsPerS))
	}
	fmt.Fprintf(sum, "; at most %d Redis commands in a second for %d callers of a worker, answered %d times (%.1f each besides %d a request; %d in all)",
		calls, callers, answers, perCaller, modelCallsPerRequest, total)
	return violations
}

// checkCallers: promise 5, every caller is served at the rate, with no
// stall. From a second in, each wait of a caller for an answer, less the
// time pauses and outages held it, is at most what serving each caller
// once takes at the lowest rate in force meanwhile (at priority 0's
// minimum share when callers of priority 1 pass it), and modelStall; and
// meanwhile the callers of its priority or below were served at most
// twice each, and 4 more: it was not passed over. A tenant's callers
// share its half of the rate, so that a caller of a tenant with fewer
// callers waiting may be served as many times more often. A wait ends
// with its answer, or at the end or its worker's stop.
func checkCallers(r *modelRecord, sum *strings.Builder) (violations []string) {
	bs := r.blocked()
	var longest, allowedThen time.Duration
	closest, passedThen, boundThen := math.MinInt, 0, 0 // passed less its bound, at its most
	for i, c := range r.callers {
		for _, w := range c.waits {
			from, to := maxTime(w.asked, r.start.Add(time.Second)), w.answered
			switch {
			case !c.stopped.IsZero() && (to.IsZero() || to.After(c.stopped)):
				to = c.stopped
			case to.IsZero():
				to = r.end
			}
			if !to.After(from) {
				continue
			}
			waited := outside(bs, from, to)
			rate := r.slowest(from, to)
			if c.prio == 0 && r.minShare > 0 {
				rate *= r.minShare
			}
			allowed := time.Duration(float64(r.callersAt(-1, from))/rate*float64(time.Second)) + modelStall
			alive := func(o modelCaller) bool {
				return o.prio <= c.prio && (o.stopped.IsZero() || from.Before(o.stopped))
			}
			inTenant := map[string]int{}
			for _, o := range r.callers {
				if alive(o) && o.prio == 0 {
					inTenant[o.tenant]++
				}
			}
			passed, others := 0, 0
			for j, o := range r.callers {
				if j == i || !alive(o) {
					continue
				}
				others += max(1, int(math.Ceil(float64(inTenant[c.tenant])/float64(max(inTenant[o.tenant], 1)))))
				for _, ow := range o.waits {
					if a := ow.answered; a.After(from) && a.Before(to) && !in(bs, a) {
						passed++
					}
				}
			}
			if waited > longest {
				longest, allowedThen = waited, allowed
			}
			if passed-(2*others+4) > closest {
				closest, passedThen, boundThen = passed-(2*others+4), passed, 2*others+4
			}
			if waited > allowed || passed > 2*others+4 {
				violations = append(violations, fmt.Sprintf("promise 5: worker %d's caller %d (priority %d) waited from %v to %v: %v outside pauses and outages (%v allowed), while the others of its priority or below were served %d times (%d allowed)",
					c.worker, i, c.prio, from.Sub(r.start).Round(time.Millisecond), to.Sub(r.start).Round(time.Millisecond),
					waited.Round(time.Millisecond), allowed.Round(time.Millisecond), passed, 2*others+4))
			}
		}
	}
	fmt.Fprintf(sum, "\n  the longest wait of a caller outside pauses and outages %v (%v allowed then); the others served %d times during a wait (%d allowed then), the closest to the bound",
		longest.Round(time.Millisecond), allowedThen.Round(time.Millisecond), passedThen, boundThen)
	return violations
}

// checkInFlight: promise 6, with slots, the provider never has more
// requests in flight than the slots; during an outage, until the fleet
// is back on the shared slots, the local shares' slots more. A Redis
// restarted empty knows none of the slots the policy granted until each
// Limiter's probe holds them in it again, half a second later at most,
// and meanwhile grants its free slots to whoever asks: a Limiter that
// did not see the outage, or a waiter whose renewal comes first.
func checkInFlight(r *modelRecord, sum *strings.Builder) (violations []string) {
	if r.slots == 0 {
		return nil
	}
	var outages []held
	for _, o := range r.outages {
		outages = append(outages, held{from: o.kill, to: o.back.Add(modelRejoin)})
	}
	shares := modelWorkers * max(1, r.slots/modelWorkers)
	peak, at, peakOut := 0, time.Time{}, 0
	for _, l := range r.loads {
		limit := r.slots
		if in(outages, l.at) {
			limit += shares
			peakOut = max(peakOut, l.n)
		} else if l.n > peak {
			peak, at = l.n, l.at
		}
		if l.n > limit {
			violations = append(violations, fmt.Sprintf("promise 6: %d requests in flight at %v, %d allowed (%d slots)",
				l.n, l.at.Sub(r.start).Round(time.Millisecond), limit, r.slots))
		}
	}
	fmt.Fprintf(sum, "\n  at most %d requests in flight (at %v), %d slots", peak, at.Sub(r.start).Round(time.Millisecond), r.slots)
	if len(outages) > 0 {
		fmt.Fprintf(sum, "; %d in outages (%d allowed)", peakOut, r.slots+shares)
	}
	return violations
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

// TestModelNegativeControl: records that break a promise fail the checker
// with that promise alone, and so must a run with the pauses of the 429s
// made invisible to the workers (WithMaxPause(0): each worker finds the
// 429 on its own).
func TestModelNegativeControl(t *testing.T) {
	t.Parallel()
	t.Run("checker", func(t *testing.T) {
		start := time.Now()
		at := func(d time.Duration) time.Time { return start.Add(d) }
		every := func(from, to, step time.Duration) []time.Time {
			var ts []time.Time
			for d := from; d < to; d += step {
				ts = append(ts, at(d))
			}
			return ts
		}
		served := func(worker int, ts []time.Time) modelCaller {
			c := modelCaller{worker: worker}
			for _, a := range ts {
				c.waits = append(c.waits, modelWait{asked: a.Add(-time.Millisecond), answered: a})
			}
			return c
		}
		want := func(what string, r *modelRecord, promises ...string) {
			t.Helper()
			violations, _ := checkModel(r)
			var got []string
			for _, v := range violations {
				got = append(got, v[:strings.Index(v, ":")])
			}
			if !slices.Equal(got, promises) {
				t.Errorf("%s: violations %q, want those of %q", what, violations, promises)
			}
		}

		r := &modelRecord{start: start, end: at(4 * time.Second), base: modelBase, arrivals: every(0, 4*time.Second, 100*time.Millisecond),
			pauses: []modelPause{{what: "Pause(1s)", from: at(time.Second), to: at(2 * time.Second)}}}
		want("arrivals every 100 ms through a pause", r, "promise 1")

		r.pauses[0].to = at(4 * time.Second)
		r.arrivals = r.arrivals[:between(r.arrivals, start, at(time.Second))]
		r.end = at(6 * time.Second)
		r.pauses = append(r.pauses, modelPause{what: "Resume", from: at(2 * time.Second), resume: true})
		want("no arrival after a Resume", r, "promise 3")

		ts := every(0, 3*time.Second, 25*time.Millisecond)
		r = &modelRecord{start: start, end: at(3 * time.Second), base: modelBase, arrivals: ts, cmds: [][]time.Time{ts},
			callers: []modelCaller{served(0, every(0, 3*time.Second, 500*time.Millisecond))}}
		want("40 arrivals and commands a second for one caller answered twice a second, under 20/s", r, "promise 2", "promise 4")

		ts = every(0, 4*time.Second, 100*time.Millisecond)
		stalled := modelCaller{worker: 1, waits: []modelWait{{asked: at(time.Second)}}}
		r = &modelRecord{start: start, end: at(4 * time.Second), base: modelBase, arrivals: ts,
			callers: []modelCaller{served(0, ts), stalled}}
		want("a caller unanswered for 3s while another is served", r, "promise 5")

		r.outages = []modelOutage{{kill: at(time.Second), back: at(1500 * time.Millisecond)}}
		r.callers[1].waits[0].answered = at(3 * time.Second)
		want("a caller answered 250 ms after an outage's hand-over", r)

		r = &modelRecord{start: start, end: at(2 * time.Second), base: modelBase, slots: modelSlots,
			loads: []modelLoad{{at(time.Second), modelSlots}, {at(1100 * time.Millisecond), modelSlots + 1}}}
		want("one request in flight more than the slots", r, "promise 6")
	})
	t.Run("pauses unseen", func(t *testing.T) {
		redistest.Long(t)
		t.Parallel()
		srv := redistest.Start(t)
		plan := []modelStep{{at: 1500 * time.Millisecond, kind: "429", d: 2 * time.Second, what: "429 Retry-After 2s"},
			{at: 4500 * time.Millisecond, kind: "429", d: time.Second, what: "429 Retry-After 1s"}}
		r, errs := runModel(t, srv, modelFeatures{}, plan, WithMaxPause(0))
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
