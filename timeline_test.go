package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// These tests record a timeline, when each request reached the provider or
// each Wait returned, while pauses and changes of the Limit come and go,
// and check it against the promise: inside a pause, nothing beyond what
// the rate allows in its first 50 ms (what was granted as the pause was
// set); after a change has settled, no second holds more than the burst
// and the rate of the Limit in force, with a margin for two busy cores.

// timeline is a record of instants, safe for many goroutines.
type timeline struct {
	mu sync.Mutex
	at []time.Time
}

// add records now and returns how many instants the timeline holds.
func (tl *timeline) add(now time.Time) int {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	tl.at = append(tl.at, now)
	return len(tl.at)
}

func (tl *timeline) sorted() []time.Time {
	tl.mu.Lock()
	defer tl.mu.Unlock()
	ts := slices.Clone(tl.at)
	slices.SortFunc(ts, time.Time.Compare)
	return ts
}

// held is a pause, from the instant it was set to its end, and the Limit
// in force at its start.
type held struct {
	what     string
	from, to time.Time
	lim      Limit
}

// pauseMargin is how late the first instants of a pause and its end may be
// on a busy machine: what happens within it of either is not counted as
// inside the pause.
const pauseMargin = 50 * time.Millisecond

// checkHeld checks ts against each pause of ps: at most what lim allows in
// the pause's first 50 ms (its rate's share and one token, and a margin),
// and nothing from then on to 50 ms before its end (a margin of one). It
// returns how many instants were inside the pauses, all told.
func checkHeld(t *testing.T, ts []time.Time, ps []held) int {
	t.Helper()
	total := 0
	for _, p := range ps {
		early := between(ts, p.from, p.from.Add(pauseMargin))
		inside := between(ts, p.from.Add(pauseMargin), p.to.Add(-pauseMargin))
		allowed := int(math.Ceil(p.lim.Rate*pauseMargin.Seconds())) + 3
		var first time.Time
		for _, at := range ts {
			if at.After(p.from.Add(pauseMargin)) && at.Before(p.to.Add(-pauseMargin)) {
				first = at
				break
			}
		}
		firstAfter := time.Duration(0)
		if !first.IsZero() {
			firstAfter = first.Sub(p.from)
		}
		t.Logf("%s (%v, %v on %v): %d in its first 50 ms (allowed %d), %d from then to 50 ms before its end (the first %v in)",
			p.what, p.from.Format("15:04:05.000"), p.to.Sub(p.from).Round(time.Millisecond), p.lim, early, allowed,
			inside, firstAfter.Round(time.Millisecond))
		if early > allowed {
			t.Errorf("%s: %d in its first 50 ms, the rate allows %d", p.what, early, allowed)
		}
		if inside > 1 {
			t.Errorf("%s: %d inside the pause, the first %v after it began", p.what, inside, firstAfter.Round(time.Millisecond))
		}
		total += early + inside
	}
	return total
}

// busiest returns the most instants of ts in any second that starts at or
// after from.
func busiest(ts []time.Time, from time.Time) int {
	n := 0
	for i, at := range ts {
		if !at.Before(from) {
			n = max(n, between(ts[i:], at, at.Add(time.Second)))
		}
	}
	return n
}

// waiters runs goroutines that Wait for lim's tokens of name in a loop,
// at the priority prio(i) when prio is not nil, until stop is called, and
// records when each Wait returned.
func waiters(t *testing.T, l *Limiter, name string, lim Limit, goroutines int, prio func(int) int) (tl *timeline, stop func() []time.Time) {
	tl = &timeline{}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var failed timeline
	for i := range goroutines {
		c := ctx
		if prio != nil {
			c = ContextWithPriority(ctx, prio(i))
		}
		wg.Go(func() {
			for c.Err() == nil {
				err := l.Wait(c, name, lim)
				if err != nil {
					if c.Err() == nil {
						failed.add(time.Now())
						t.Errorf("Wait: %v", err)
					}
					return
				}
				tl.add(time.Now())
			}
		})
	}
	return tl, func() []time.Time {
		cancel()
		wg.Wait()
		return tl.sorted()
	}
}

// pacedProvider is an httptest server that records when each request arrived
// and answers the n-th (from 1) with a 429 and Retry-After: retry(n)
// seconds when that is above zero.
type pacedProvider struct {
	*httptest.Server
	arrived  timeline
	rejected chan time.Time // each 429, as it is answered
	delay    time.Duration  // how long it takes to answer, once it has the request
}

func newPacedProvider(t *testing.T, retry func(n int, now time.Time) int) *pacedProvider {
	p := &pacedProvider{rejected: make(chan time.Time, 16)}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		n := p.arrived.add(now)
		time.Sleep(p.delay)
		if s := retry(n, now); s > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(s))
			w.WriteHeader(http.StatusTooManyRequests)
			p.rejected <- now
		}
	}))
	t.Cleanup(p.Close)
	return p
}

// name is the provider's bucket: its host, as quota.Host names it.
func (p *pacedProvider) name() string { return strings.TrimPrefix(p.URL, "http://") }

// senders runs goroutines that send GETs to p through tr in a loop, at the
// priority prio(i) when prio is not nil, until stop is called, which
// returns when each request reached the provider.
func senders(t *testing.T, tr http.RoundTripper, p *pacedProvider, goroutines int, prio func(int) int) (stop func() []time.Time) {
	ctx, cancel := context.WithCancel(context.Background())
	client := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	for i := range goroutines {
		c := ctx
		if prio != nil {
			c = ContextWithPriority(ctx, prio(i))
		}
		wg.Go(func() {
			for c.Err() == nil {
				req, _ := http.NewRequestWithContext(c, http.MethodGet, p.URL, nil)
				resp, err := client.Do(req)
				if err != nil {
					if c.Err() == nil && !errors.Is(err, context.Canceled) {
						t.Errorf("request: %v", err)
						return
					}
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	return func() []time.Time {
		cancel()
		wg.Wait()
		return p.arrived.sorted()
	}
}

// after waits for the 429 that p answers next, or fails the test.
func (p *pacedProvider) after(t *testing.T, within time.Duration) time.Time {
	t.Helper()
	select {
	case at := <-p.rejected:
		return at
	case <-time.After(within):
		t.Fatalf("the provider answered no 429 within %v", within)
		return time.Time{}
	}
}

func sleepUntil(at time.Time) { time.Sleep(time.Until(at)) }

// TestSecondPauseHoldsTheFirstPausesQueue: a pause moves the queue behind
// it; a second pause must hold that queue too, not let the grants the
// first one moved fall back to the due times they had before it, all at
// once. Two 429s, two operator pauses, and two pauses forever with a
// Resume each.
func TestSecondPauseHoldsTheFirstPausesQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 10, Burst: 5}

	t.Run("429s", func(t *testing.T) {
		t.Parallel()
		p := newPacedProvider(t, func(n int, _ time.Time) int {
			if n == 20 || n == 32 {
				return 2
			}
			return 0
		})
		stop := senders(t, NewTransport(srv.Client(t), lim), p, 30, nil)
		first := p.after(t, 10*time.Second)
		second := p.after(t, 10*time.Second)
		sleepUntil(second.Add(2500 * time.Millisecond))
		ts := stop()
		checkHeld(t, ts, []held{
			{"the first 429's pause", first, first.Add(2 * time.Second), lim},
			{"the second 429's pause", second, second.Add(2 * time.Second), lim},
		})
	})

	operated := func(t *testing.T, first, second time.Duration) {
		t.Parallel()
		p := newPacedProvider(t, func(int, time.Time) int { return 0 })
		operator := NewLimiter(srv.Client(t))
		ctx := context.Background()
		stop := senders(t, NewTransport(srv.Client(t), lim), p, 30, nil)
		start := time.Now()
		var ps []held
		at := start.Add(1500 * time.Millisecond)
		for i, d := range []time.Duration{first, second} {
			sleepUntil(at)
			what := "Pause(" + d.String() + ")"
			hold := d
			if d == Forever {
				what, hold = "Pause(Forever)", 1500*time.Millisecond
			}
			from := time.Now()
			if err := operator.Pause(ctx, p.name(), d); err != nil {
				t.Fatal(err)
			}
			if d == Forever {
				sleepUntil(from.Add(hold))
				if err := operator.Resume(ctx, p.name()); err != nil {
					t.Fatal(err)
				}
			}
			ps = append(ps, held{what + " #" + strconv.Itoa(i+1), from, from.Add(hold), lim})
			at = from.Add(hold + 1500*time.Millisecond)
		}
		sleepUntil(at.Add(-time.Second))
		checkHeld(t, stop(), ps)
	}
	t.Run("operator", func(t *testing.T) { operated(t, 2*time.Second, time.Second) })
	t.Run("forever", func(t *testing.T) { operated(t, Forever, Forever) })
}

// TestPauseHoldsUnderOverride: a pause holds the callers of a bucket whose
// Limit an operator set, and a ClearLimit during a pause does not let the
// queue through before the pause ends.
func TestPauseHoldsUnderOverride(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim, low := Limit{Rate: 10, Burst: 1}, Limit{Rate: 2, Burst: 2}
	ctx := context.Background()

	t.Run("Pause", func(t *testing.T) {
		t.Parallel()
		const name = "override-pause"
		operator := NewLimiter(srv.Client(t))
		_, stop := waiters(t, NewLimiter(srv.Client(t)), name, lim, 20, nil)
		start := time.Now()
		sleepUntil(start.Add(time.Second))
		if err := operator.SetLimit(ctx, name, low); err != nil {
			t.Fatal(err)
		}
		sleepUntil(start.Add(2 * time.Second))
		from := time.Now()
		if err := operator.Pause(ctx, name, 3*time.Second); err != nil {
			t.Fatal(err)
		}
		sleepUntil(from.Add(3500 * time.Millisecond))
		checkHeld(t, stop(), []held{{"Pause(3s) under SetLimit(" + low.String() + ")", from, from.Add(3 * time.Second), low}})
	})

	t.Run("429 and ClearLimit", func(t *testing.T) {
		t.Parallel()
		start := time.Now()
		p := newPacedProvider(t, func(n int, now time.Time) int {
			if now.After(start.Add(2 * time.Second)) {
				return 3
			}
			return 0
		})
		operator := NewLimiter(srv.Client(t))
		stop := senders(t, NewTransport(srv.Client(t), lim), p, 20, nil)
		sleepUntil(start.Add(time.Second))
		if err := operator.SetLimit(ctx, p.name(), low); err != nil {
			t.Fatal(err)
		}
		rejected := p.after(t, 5*time.Second)
		sleepUntil(rejected.Add(time.Second))
		if err := operator.ClearLimit(ctx, p.name()); err != nil {
			t.Fatal(err)
		}
		sleepUntil(rejected.Add(3500 * time.Millisecond))
		checkHeld(t, stop(), []held{{"a 429's pause of 3s, ClearLimit 1s in", rejected, rejected.Add(3 * time.Second), low}})
	})
}

// TestLimitChangeBetweenPauses: a change of the Limit after one pause has
// ended does not open the next pause.
func TestLimitChangeBetweenPauses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	const name = "change-between"
	lim, changed := Limit{Rate: 10, Burst: 1}, Limit{Rate: 5, Burst: 1}
	ctx := context.Background()
	operator := NewLimiter(srv.Client(t))
	_, stop := waiters(t, NewLimiter(srv.Client(t)), name, lim, 20, nil)
	start := time.Now()
	pause := func(at time.Time, d time.Duration, what string, in Limit) held {
		sleepUntil(at)
		from := time.Now()
		if err := operator.Pause(ctx, name, d); err != nil {
			t.Fatal(err)
		}
		return held{what, from, from.Add(d), in}
	}
	first := pause(start.Add(time.Second), 1500*time.Millisecond, "the first Pause(1.5s)", lim)
	sleepUntil(first.to.Add(500 * time.Millisecond))
	if err := operator.SetLimit(ctx, name, changed); err != nil {
		t.Fatal(err)
	}
	second := pause(first.to.Add(time.Second), 2*time.Second, "the second Pause(2s), after SetLimit("+changed.String()+")", changed)
	sleepUntil(second.to.Add(500 * time.Millisecond))
	checkHeld(t, stop(), []held{first, second})
}

// TestLoweredLimitHoldsUnderPriorities: callers of priorities 0 and 5 on
// 40/s, half a second of queue at that rate; once SetLimit has lowered
// the bucket to 10/s burst 1 and the change has settled (a second), no
// second holds more than its burst and rate, and a margin of 2. Six
// trials on buckets of their own, one Limiter or two, as the excess comes
// in most runs, not all.
func TestLoweredLimitHoldsUnderPriorities(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 40, Burst: 1}
	for trial, v := range []struct{ fleet, p0, p5 int }{{1, 16, 4}, {2, 8, 2}, {1, 16, 4}, {2, 8, 2}, {1, 16, 4}, {2, 8, 2}} {
		t.Run(fmt.Sprintf("trial %d, %d Limiters of %d+%d callers", trial, v.fleet, v.p0, v.p5), func(t *testing.T) {
			t.Parallel()
			loweredUnderPriorities(t, srv, "lowered-"+strconv.Itoa(trial), lim, v.fleet, v.p0, v.p5)
		})
	}
}

// loweredUnderPriorities runs fleet Limiters with p0 callers of priority 0
// and p5 of priority 5 each on lim, lowers the bucket called name to 10/s
// burst 1 a second in, and checks the seconds from 1 s after the change.
func loweredUnderPriorities(t *testing.T, srv *redistest.Server, name string, lim Limit, fleet, p0, p5 int) {
	low := Limit{Rate: 10, Burst: 1}
	operator := NewLimiter(srv.Client(t))
	var stops []func() []time.Time
	for range fleet {
		_, stop := waiters(t, NewLimiter(srv.Client(t)), name, lim, p0+p5, func(i int) int {
			if i < p5 {
				return 5
			}
			return 0
		})
		stops = append(stops, stop)
	}
	start := time.Now()
	sleepUntil(start.Add(time.Second))
	set := time.Now()
	if err := operator.SetLimit(context.Background(), name, low); err != nil {
		t.Fatal(err)
	}
	sleepUntil(set.Add(4 * time.Second))
	var ts []time.Time
	for _, stop := range stops {
		ts = append(ts, stop()...)
	}
	slices.SortFunc(ts, time.Time.Compare)
	n, limit := busiest(ts[:between(ts, start, set.Add(4*time.Second))], set.Add(time.Second)), bound(low, time.Second)+2
	t.Logf("priorities 0 and 5 on %v, SetLimit(%v): %d Wait returns in the busiest second from 1s after the change, bound %d (%d and a margin of 2); each second from the change: %v",
		lim, low, n, limit, bound(low, time.Second), histogram(ts, set, time.Second))
	if n > limit {
		t.Errorf("%d in a second under %v, bound %d", n, low, limit)
	}
}

// TestGiveBacksDoNotOpenAPause: requests that reserve 4 tokens and settle
// at 1, giving 3 back, at two priorities: a pause forever holds them all
// until Resume. What a settle gives back during the pause must not hand
// the queue on. Several trials, on buckets of their own, as a give-back
// opens the pause only when it lands on a queue.
func TestGiveBacksDoNotOpenAPause(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 40, Burst: 8}
	const trials = 4
	var mu sync.Mutex
	opened := 0
	var wg sync.WaitGroup
	for trial := range trials {
		wg.Go(func() {
			rdb := srv.Client(t)
			p := newPacedProvider(t, func(int, time.Time) int { return 0 })
			p.delay = 200 * time.Millisecond // requests in flight as the pause begins settle inside it
			tr := NewTransport(rdb, lim,
				WithCost(func(*http.Request) float64 { return 4 }),
				WithSettle(func(*http.Response) (float64, bool) { return 1, true }))
			operator := NewLimiter(srv.Client(t))
			ctx := context.Background()
			stop := senders(t, tr, p, 20, func(i int) int { return 5 * (i % 2) })
			start := time.Now()
			sleepUntil(start.Add(time.Second + time.Duration(trial)*100*time.Millisecond))
			from := time.Now()
			if err := operator.Pause(ctx, p.name(), Forever); err != nil {
				t.Error(err)
				return
			}
			sleepUntil(from.Add(1500 * time.Millisecond))
			to := time.Now()
			if err := operator.Resume(ctx, p.name()); err != nil {
				t.Error(err)
			}
			sleepUntil(to.Add(300 * time.Millisecond))
			ts := stop()
			inside := between(ts, from.Add(pauseMargin), to.Add(-pauseMargin))
			var first time.Duration
			for _, at := range ts {
				if at.After(from.Add(pauseMargin)) && at.Before(to.Add(-pauseMargin)) {
					first = at.Sub(from)
					break
				}
			}
			t.Logf("trial %d: %d requests before the pause, %d in its first 50 ms, %d from then to 50 ms before Resume (the first %v in)",
				trial, between(ts, start, from), between(ts, from, from.Add(pauseMargin)), inside, first.Round(time.Millisecond))
			mu.Lock()
			defer mu.Unlock()
			if inside > 1 {
				opened++
			}
		})
	}
	wg.Wait()
	if opened > 0 {
		t.Errorf("give-backs handed requests on inside a pause forever in %d of %d trials", opened, trials)
	}
}
