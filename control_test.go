package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of pauses and limit changes as callers meet them (control.go): a
// pause holds every grant, queued and sleeping ones too, and moves the
// queue behind it; callers learn of a pause and its resume whether or not
// they hear the announcement; a caller that cannot wait out a pause is
// refused; a bucket's control record is read a bounded number of times, and
// expires. Several record a timeline, when each request reached the
// provider or each Wait returned, while pauses and changes of the Limit
// come and go, and check it against the promise: inside a pause, nothing
// beyond what the rate allows in its first 50 ms; after a change has
// settled, no second holds more than the burst and the rate of the Limit in
// force. The operator's calls themselves are tested in operate_test.go.

// setControlIdle makes Limiters stop listening after d unused, for the
// test.
func setControlIdle(t *testing.T, d time.Duration) {
	old := controlIdle
	controlIdle = d
	t.Cleanup(func() { controlIdle = old })
}

// recordOp runs a record operation of the bucket called name as an
// operator's Limiter would, announcing it on channel: "" loses the
// announcement.
func recordOp(t *testing.T, l *Limiter, name string, op store.RecordOp, channel string) {
	t.Helper()
	key, err := bucketKey(l.cfg.prefix, name)
	if err != nil {
		t.Fatal(err)
	}
	s := store.NewStore(l.store.Client(), store.Options{Channel: channel})
	if _, err := s.Record(context.Background(), []string{key}, op); err != nil {
		t.Fatalf("%s: %v", op.Op, err)
	}
}

// TestParkedCallersHearTheResume: callers parked on a pause with no end
// learn of its end within a second, however quiet the Limiter was meanwhile
// (it stops listening after controlIdle unused) and whether or not the
// resume's announcement reaches it.
func TestParkedCallersHearTheResume(t *testing.T) {
	redistest.Long(t)
	setControlIdle(t, 400*time.Millisecond)
	srv := redistest.Start(t)
	for _, lost := range []bool{false, true} {
		t.Run(fmt.Sprintf("announcement lost %v", lost), func(t *testing.T) {
			l := NewLimiter(srv.Client(t))
			operator := NewLimiter(srv.Client(t))
			name := fmt.Sprintf("parked-%v", lost)
			lim := Limit{Rate: 100, Burst: 100}
			ctx := context.Background()
			if err := l.Wait(ctx, name, lim); err != nil { // the Limiter knows the bucket
				t.Fatal(err)
			}
			if err := operator.Pause(ctx, name, Forever); err != nil {
				t.Fatal(err)
			}
			const workers = 8
			var returned atomic.Int64
			var wg sync.WaitGroup
			for range workers {
				wg.Go(func() {
					if err := l.Wait(ctx, name, lim); err != nil {
						t.Error(err)
					}
					returned.Add(1)
				})
			}
			// Quiet for four times controlIdle: no new acquisition.
			time.Sleep(4 * controlIdle)
			if n := returned.Load(); n != 0 {
				t.Fatalf("%d of %d workers returned during the pause", n, workers)
			}
			channel := l.cfg.prefix + control.Channel
			if lost {
				channel = ""
			}
			recordOp(t, operator, name, store.RecordOp{Op: "resume"}, channel)
			resumed := time.Now()
			done := make(chan struct{})
			go func() { wg.Wait(); close(done) }()
			select {
			case <-done:
			case <-time.After(5 * time.Second):
				t.Fatalf("%d of %d workers still parked 5s after the resume", workers-int(returned.Load()), workers)
			}
			took := time.Since(resumed)
			t.Logf("%d workers parked through %v of quiet returned %v after the resume", workers, 4*controlIdle, took.Round(time.Millisecond))
			if took > time.Second {
				t.Errorf("the workers returned %v after the resume, want within 1s", took)
			}
		})
	}
}

// TestMissedAnnouncementBound: a Limiter that misses the announcement of
// a pause grants nothing new (every take finds the pause in the script),
// and its callers already sleeping on grants learn of it within
// control.WaitRefresh: at most rate x control.WaitRefresh of their grants go.
func TestMissedAnnouncementBound(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	ls := fleetOf(t, srv, 2)
	operator := NewLimiter(srv.Client(t))
	lim := Limit{Rate: 100, Burst: 1}
	const name = "deaf"
	start := time.Now()
	stop := start.Add(3 * time.Second)
	done := arrivals(t, ls, 20, name, lim, stop)
	time.Sleep(time.Second)
	// The pause ends 1.5 s after the script read its clock, from here on.
	pausing := time.Now()
	recordOp(t, operator, name, store.RecordOp{Op: "hold", Hold: 1500 * time.Millisecond}, "") // announced to no one
	paused := time.Now()
	_, granted := done()
	ends := pausing.Add(1500 * time.Millisecond)
	late := between(granted, paused.Add(20*time.Millisecond), ends)
	allowed := int(lim.Rate*control.WaitRefresh.Seconds()) + 2
	settled := between(granted, paused.Add(control.WaitRefresh+100*time.Millisecond), ends)
	t.Logf("a pause of 1.5s announced to no one: %d grants after it (bound %d), %d after %v", late, allowed, settled, control.WaitRefresh+100*time.Millisecond)
	if late > allowed {
		t.Errorf("%d grants inside a pause the Limiters missed, bound %d", late, allowed)
	}
	if settled != 0 {
		t.Errorf("%d grants once the Limiters read the pause", settled)
	}
}

// TestShortSleeperHearsTheResume: a caller sleeping on a grant due within
// moments, which a pause with no end then holds, learns of the resume
// within a second although its announcement is lost.
func TestShortSleeperHearsTheResume(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	const name = "short-sleeper"
	lim := Limit{Rate: 5, Burst: 1}
	if err := l.Wait(ctx, name, lim); err != nil { // the one token
		t.Fatal(err)
	}
	returned := make(chan time.Time, 1)
	go func() {
		if err := l.Wait(ctx, name, lim); err != nil { // due in 200 ms
			t.Error(err)
		}
		returned <- time.Now()
	}()
	time.Sleep(20 * time.Millisecond)
	if err := operator.Pause(ctx, name, Forever); err != nil {
		t.Fatal(err)
	}
	select {
	case at := <-returned:
		t.Fatalf("the sleeper returned during the pause, %v after the call", time.Since(at))
	case <-time.After(time.Second):
	}
	recordOp(t, operator, name, store.RecordOp{Op: "resume"}, "") // announced to no one
	resumed := time.Now()
	select {
	case at := <-returned:
		t.Logf("a sleeper held by a pause with no end returned %v after its resume, announced to no one", at.Sub(resumed).Round(time.Millisecond))
		if d := at.Sub(resumed); d > time.Second {
			t.Errorf("the sleeper returned %v after the resume, want within 1s", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the sleeper still sleeps 5s after the resume")
	}
}

// TestAllowAfterAnUnheardResume: a Limiter that read a pause with no end
// grants Allow as soon as another resumes the bucket, announcement heard
// or not: the script decides with the record as it is, not the Limiter
// with what it read.
func TestAllowAfterAnUnheardResume(t *testing.T) {
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	lim := PerSecond(10)
	if err := operator.Pause(ctx, "unheard", Forever); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.Allow(ctx, "unheard", lim); ok || err != nil {
		t.Fatalf("Allow during the pause = %v, %v; want false", ok, err)
	}
	e := l.controls.Lookup("quota:{unheard}")
	if _, _, paused := e.Load().PausedAt(time.Now()); !paused {
		t.Fatal("the Limiter did not read the pause: the test shows nothing")
	}
	recordOp(t, operator, "unheard", store.RecordOp{Op: "resume"}, "") // announced to no one
	if ok, err := l.Allow(ctx, "unheard", lim); !ok || err != nil {
		t.Errorf("Allow just after the resume = %v, %v; want true", ok, err)
	}
}

// TestPauseMovesSleepers: a pause recorded by one Limiter moves the grants
// another Limiter's callers are already sleeping on behind it, each by the
// pause, so that they keep their order and the bucket's rate.
func TestPauseMovesSleepers(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	t.Run("server", func(t *testing.T) {
		srv := redistest.Start(t)
		pauseMovesSleepers(t, srv.Client(t), srv.Client(t))
	})
	// On a Cluster the announcement is a PUBLISH, which every node passes
	// on, and the Limiter's one subscription is on one node.
	t.Run("cluster", func(t *testing.T) {
		cl := redistest.StartCluster(t, 3, 0)
		pauseMovesSleepers(t, cl.Client(t), cl.Client(t))
	})
}

func pauseMovesSleepers(t *testing.T, rdb, other redis.UniversalClient) {
	const callers = 12
	var mu sync.Mutex
	due := make([]time.Time, callers) // when each grant fell due before the pause
	replied := 0
	rdb.AddHook(replyHook{seen: func(i int, at time.Time, reply any) {
		mu.Lock()
		defer mu.Unlock()
		due[i], _ = dueOf(at, reply)
		replied++
	}})
	a := NewLimiter(rdb)
	b := NewLimiter(other)
	lim := Limit{Rate: 20, Burst: 2}
	bk, _ := b.bucket("sleepers", []Limit{lim})

	// 2 callers granted at once, 10 queued 50 ms apart.
	woke := make([]time.Time, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			if err := a.Wait(context.WithValue(context.Background(), callerKey{}, i), "sleepers", lim); err != nil {
				t.Error(err)
			}
			woke[i] = time.Now()
		})
	}
	// The pause comes once every take has its reply, however late a
	// loaded machine runs them: a take after it would be moved already.
	for began := time.Now(); time.Since(began) < 5*time.Second; time.Sleep(5 * time.Millisecond) {
		mu.Lock()
		n := replied
		mu.Unlock()
		if n >= callers {
			break
		}
	}
	const pause = time.Second
	pausedAt := time.Now()
	if err := b.store.Pause(context.Background(), bk.Bucket, pause); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	moved, escaped := 0, 0
	var lateness time.Duration
	for i := range callers {
		if !due[i].After(pausedAt.Add(50 * time.Millisecond)) {
			escaped++ // due before the pause could reach it
			continue
		}
		moved++
		late := woke[i].Sub(due[i].Add(pause))
		lateness = max(lateness, late)
		if late < 0 {
			t.Errorf("a caller due %v after the pause was recorded woke %v after it: %v before its grant moved behind the pause",
				due[i].Sub(pausedAt), woke[i].Sub(pausedAt), -late)
		}
	}
	t.Logf("%d callers moved by the pause of %v, woken at most %v after their moved grants; %d due before it", moved, pause, lateness, escaped)
	if moved < 6 {
		t.Errorf("%d callers were sleeping at the pause, want most of 10", moved)
	}
	if lateness > 500*time.Millisecond {
		t.Errorf("a caller woke %v after its moved grant: moved too far", lateness)
	}
}

// TestPauseReachesEveryProcess: one 429 with Retry-After, answered to one
// worker process, stops all of them within 50 ms, queued grants
// included, until the pause ends; then the queue resumes at the bucket's
// rate, not all at once.
func TestPauseReachesEveryProcess(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	var (
		mu       sync.Mutex
		arrivals []time.Time
		first429 time.Time
	)
	const pause = 2 * time.Second
	lim := Limit{Rate: 50, Burst: 5}
	prov := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		arrivals = append(arrivals, now)
		if len(arrivals) == 60 { // one 429, a while into the run
			first429 = now
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer prov.Close()

	runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(prov.URL, "http://"), URL: prov.URL,
		Limit: lim, Goroutines: 5, Duration: 5 * time.Second})
	mu.Lock()
	defer mu.Unlock()
	if first429.IsZero() {
		t.Fatal("the provider never answered 429")
	}
	known, end := first429.Add(50*time.Millisecond), first429.Add(pause)
	var before, during, after []time.Time
	for _, a := range arrivals {
		switch {
		case a.After(first429) && !a.After(known):
			before = append(before, a)
		case a.After(known) && a.Before(end):
			during = append(during, a)
		case !a.Before(end):
			after = append(after, a)
		}
	}
	resumed := time.Duration(0)
	if len(after) > 0 {
		resumed = after[0].Sub(first429)
	}
	t.Logf("3 processes x 5 goroutines on %v: %d requests in the 50ms after the 429, %d from then until the pause of %v ended, %d after it, the first %v after the 429",
		lim, len(before), len(during), pause, len(after), resumed.Round(time.Millisecond))
	if len(during) > 0 {
		t.Errorf("%d requests reached the provider during the pause, the first %v after the 429", len(during), during[0].Sub(first429))
	}
	// The queue resumes at the bucket's rate: in any half second after the
	// pause, at most the burst and the half second's refill (and a little
	// jitter, which a loaded machine's late wake-ups bunch), not the 15
	// callers at once on top of them.
	if n := maxInWindow(after, 500*time.Millisecond); n > int(lim.Burst)+int(lim.Rate/2)+3 {
		t.Errorf("%d requests in a half second after the pause, want the bucket's rate", n)
	}
	if len(after) < int(lim.Rate) {
		t.Errorf("%d requests after the pause, want the traffic to resume", len(after))
	}
}

// TestPauseBeforeListening: a pause announced before a Limiter listens on
// the bucket's channel still moves the grants its callers took before the
// pause: listening begins by reading the pause in force.
func TestPauseBeforeListening(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	a, b := NewLimiter(srv.Client(t)), NewLimiter(srv.Client(t))
	lim := Limit{Rate: 10, Burst: 1}
	bk, _ := a.bucket("early", []Limit{lim})
	ctx := context.Background()
	bk, err := a.controlled(ctx, &obs.Span{}, bk) // as an acquisition does
	if err != nil {
		t.Fatal(err)
	}
	if _, err := a.store.Take(ctx, bk.Bucket, store.Tokens(1), time.Second); err != nil { // the one token
		t.Fatal(err)
	}
	g, err := a.store.Take(ctx, bk.Bucket, store.Tokens(1), time.Second) // due in 100 ms
	if err != nil || g.Wait <= 0 {
		t.Fatalf("take: %+v, %v; want a wait", g, err)
	}
	taken := time.Now()
	const pause = 500 * time.Millisecond
	if err := b.store.Pause(ctx, bk.Bucket, pause); err != nil {
		t.Fatal(err)
	}
	if _, err := a.controls.SleepOn(ctx, bk.ctl, len(bk.Keys), g, store.Tokens(1), true); err != nil {
		t.Fatal(err)
	}
	slept := time.Since(taken)
	t.Logf("a grant due in %v, taken before a pause of %v that came before anyone listened, fell due after %v", g.Wait, pause, slept)
	if slept < g.Wait+pause-5*time.Millisecond {
		t.Errorf("the grant fell due after %v, want after its wait and the pause, %v", slept, g.Wait+pause)
	}
}

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

func TestPauseRefusesWhatCannotWait(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 10}
	if err := l.Wait(ctx, "p", lim); err != nil {
		t.Fatal(err)
	}
	if err := l.Pause(ctx, "p", time.Hour); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.Allow(ctx, "p", lim); ok || err != nil {
		t.Errorf("Allow during a pause: %v, %v; want false", ok, err)
	}
	prov, reached := countingServer(t)
	req, _ := http.NewRequest("GET", prov.URL, nil)
	if _, err := NewTransport(rdb, lim, WithKey(Fixed("p")), WithNoWait()).RoundTrip(req); !errors.Is(err, ErrWouldWait) || reached.Load() != 0 {
		t.Errorf("WithNoWait during a pause: %v, %d requests sent; want ErrWouldWait and none", err, reached.Load())
	}
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	began := time.Now()
	if err := l.Wait(short, "p", lim); !errors.Is(err, ErrWouldExceedDeadline) || time.Since(began) > 100*time.Millisecond {
		t.Errorf("Wait with a deadline before the pause ends: %v after %v; want ErrWouldExceedDeadline at once", err, time.Since(began))
	}
	dry := NewLimiter(rdb, WithDryRun())
	if err := dry.Wait(ctx, "p", lim); err != nil {
		t.Errorf("dry run during a pause: %v", err)
	}
	// Without a deadline a caller waits for the resume.
	waited := make(chan error, 1)
	go func() { waited <- l.Wait(ctx, "p", lim) }()
	select {
	case err := <-waited:
		t.Fatalf("Wait returned %v during the pause", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := l.Resume(ctx, "p"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Wait still waiting 2s after Resume")
	}

	for _, c := range []struct {
		what string
		err  error
		want error
	}{
		{"SetLimit rate 0", l.SetLimit(ctx, "p", Limit{}), ErrInvalidLimit},
		{"SetLimit burst -1", l.SetLimit(ctx, "p", Limit{Rate: 1, Burst: -1}), ErrInvalidLimit},
		{"Pause 0", l.Pause(ctx, "p", 0), ErrInvalidLimit},
		{"Pause -1s", l.Pause(ctx, "p", -time.Second), ErrInvalidLimit},
		{"Pause of an empty name", l.Pause(ctx, "", time.Second), ErrInvalidKey},
		{"SetLimit of an empty name", l.SetLimit(ctx, "", lim), ErrInvalidKey},
		{"Resume of an empty name", l.Resume(ctx, ""), ErrInvalidKey},
	} {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: %v, want %v", c.what, c.err, c.want)
		}
	}
	if _, err := l.Status(ctx, ""); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Status of an empty name: %v", err)
	}
}

func TestControlReadsAreBounded(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 1000, Burst: 1000}
	began := time.Now()
	for time.Since(began) < 2500*time.Millisecond {
		if err := l.Wait(ctx, "reads", lim); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	reads, takes := cmds.get("control"), cmds.get("evalsha")+cmds.get("eval")
	t.Logf("%d takes, %d reads of the control record in 2.5s", takes, reads)
	if reads < 2 || reads > 4 {
		t.Errorf("%d reads of the control record in 2.5s, want the first and one a second", reads)
	}
}

// A control record that holds nothing an operator set lives while its
// bucket is in use or queued, and no longer; one with an override or a
// pause with no end stays.
func TestControlRecordExpires(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	const name = "expiry"
	key := "quota:{" + name + "}"
	ttl := func() time.Duration {
		t.Helper()
		d, err := rdb.PTTL(ctx, key+control.Suffix).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	// A queue of a minute: the record lives as long.
	if ok, err := l.AllowN(ctx, name, 61, Limit{Rate: 1, Burst: 61}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if err := l.ClearLimit(ctx, name); err != nil { // a write, that sets the expiry again
		t.Fatal(err)
	}
	if d := ttl(); d < 55*time.Second || d > 62*time.Second {
		t.Errorf("a record whose bucket is full in a minute expires in %v", d)
	}
	for _, c := range []struct {
		what string
		do   func() error
		keep bool
	}{
		{"an override", func() error { return l.SetLimit(ctx, name, Limit{Rate: 2, Burst: 4}) }, true},
		{"no override", func() error { return l.ClearLimit(ctx, name) }, false},
		{"a pause forever", func() error { return l.Pause(ctx, name, Forever) }, true},
		{"a resume", func() error { return l.Resume(ctx, name) }, false},
	} {
		if err := c.do(); err != nil {
			t.Fatal(err)
		}
		if d := ttl(); (d == -1) != c.keep {
			t.Errorf("after %s the record expires in %v; want it kept: %v", c.what, d, c.keep)
		}
	}
	// An unqueued bucket's record goes 10 s after its last read.
	if err := rdb.Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	if err := l.ClearLimit(ctx, name); err != nil {
		t.Fatal(err)
	}
	if d := ttl(); d < 9*time.Second || d > 10*time.Second {
		t.Errorf("a record with nothing set and no queue expires in %v, want 10s", d)
	}
}
