package quota

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of how an acquisition waits for its tokens (acquire.go, behind
// Limiter.Wait): the wait it reports is exact, it never waits past its
// deadline or MaxWait, a cancelled wait hands its tokens back, callers keep
// first-come-first-served order and sleep between calls; and swarms of
// callers, in one process and across worker processes, never take more than
// the Limit allows. Takes that share one script call are in
// acquire_batch_test.go.

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

// TestNothingSpins counts the script calls of callers on a bucket blocked
// for years, by a Limit or by a pause: every one sleeps between calls.
func TestNothingSpins(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	for _, tc := range []struct {
		name  string
		block func(t *testing.T, l *Limiter, name string) Limit
	}{
		{"a queue of years", func(t *testing.T, l *Limiter, name string) Limit {
			lim := Limit{Rate: 1 / (300 * 86400.0), Burst: 1} // a token every 300 days
			if err := l.Wait(context.Background(), name, lim); err != nil {
				t.Fatal(err)
			}
			b, _ := l.bucket(name, []Limit{lim})
			for range 4 { // four more: four years
				if _, err := l.store.Take(context.Background(), b.Bucket, store.Tokens(1), 5*365*24*time.Hour); err != nil {
					t.Fatal(err)
				}
			}
			return lim
		}},
		{"a pause with no end", func(t *testing.T, l *Limiter, name string) Limit {
			if err := l.Pause(context.Background(), name, Forever); err != nil {
				t.Fatal(err)
			}
			return Limit{Rate: 100, Burst: 100}
		}},
		{"a pause rescaled by a limit change", func(t *testing.T, l *Limiter, name string) Limit {
			ctx := context.Background()
			// A token owed for a second, so that the bucket is not full
			// again when the pause comes, however slow the machine: the
			// change stretches what is owed then to months.
			lim := Limit{Rate: 1, Burst: 1}
			if err := l.Wait(ctx, name, lim); err != nil {
				t.Fatal(err)
			}
			if err := l.Pause(ctx, name, Forever); err != nil {
				t.Fatal(err)
			}
			if err := l.SetLimit(ctx, name, Limit{Rate: 1 / (300 * 86400.0), Burst: 1}); err != nil {
				t.Fatal(err)
			}
			if err := l.Resume(ctx, name); err != nil {
				t.Fatal(err)
			}
			return lim
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rdb := srv.Client(t)
			cmds := newCmdCounter()
			rdb.AddHook(cmds)
			l := NewLimiter(rdb, WithMaxWait(200*time.Millisecond))
			name := strings.ReplaceAll(tc.name, " ", "-")
			lim := tc.block(t, l, name)
			cmds.reset()
			const callers, run = 4, 3 * time.Second
			// No deadline: each caller is bounded by MaxWait and asks again.
			ctx, cancel := context.WithCancel(context.Background())
			var wg sync.WaitGroup
			for range callers {
				wg.Go(func() {
					if err := l.Wait(ctx, name, lim); !errors.Is(err, context.Canceled) {
						t.Errorf("Wait returned %v on a blocked bucket", err)
					}
				})
			}
			// With a deadline a year away: refused at once, or parked.
			year, cancelYear := context.WithTimeout(ctx, 365*24*time.Hour)
			defer cancelYear()
			wg.Go(func() {
				if err := l.Wait(year, name, lim); err == nil {
					t.Error("a Wait with a deadline a year away was granted")
				}
			})
			time.Sleep(run)
			calls := cmds.get("evalsha") + cmds.get("eval") + cmds.get("control")
			cancel()
			wg.Wait()
			perCaller := float64(calls) / (callers + 1) / run.Seconds()
			t.Logf("%d callers for %v: %v (%.1f script calls a second each)", callers+1, run, cmds, perCaller)
			// A caller without a deadline asks every MaxWait (5 a second),
			// and the Limiter reads the record of a bucket callers wait on
			// every control.WaitRefresh (2 a second, for all of them).
			if perCaller > 8 {
				t.Errorf("%.1f script calls a second per caller, want at most 8", perCaller)
			}
		})
	}
	// The negative control: the counter sees a caller that does not sleep.
	rdb := srv.Client(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	l := NewLimiter(rdb, WithNoBatching())
	b, _ := l.bucket("spun", []Limit{{Rate: 1 / (300 * 86400.0), Burst: 1}})
	const spins = 100
	began := time.Now()
	for range spins {
		_, _ = l.store.Take(context.Background(), b.Bucket, store.Tokens(1), 0)
	}
	took := time.Since(began)
	if n := cmds.get("evalsha") + cmds.get("eval"); n < spins || float64(n)/took.Seconds() <= 8 {
		t.Errorf("a loop without a sleep made %d calls in %v and the counter counted %d, at most 8 a second: it misses them", spins, took, n)
	}
}

// placed reports whether caller i of the bucket called name has its place:
// first, closed on its first grant, is, or its take holds the bucket's
// call or is queued behind the call in flight.
func placed(l *Limiter, name string, i int, first chan struct{}) bool {
	select {
	case <-first:
		return true
	default:
	}
	key, _ := bucketKey(l.cfg.prefix, name)
	return l.store.Placed(key, func(ctx context.Context) bool { return ctx.Value(callerKey{}) == i })
}

// TestOverloadKeepsFirstComeFirstServed: 150 callers on 20/s queue for
// 7.5 s, longer than MaxWait; every caller's context allows 30 s, so each
// gets its place at once and keeps it.
func TestOverloadKeepsFirstComeFirstServed(t *testing.T) {
	redistest.Long(t)
	const callers = 150
	lim := Limit{Rate: 20, Burst: 1}
	queue := time.Duration(float64(callers-1) / lim.Rate * float64(time.Second))

	srv := redistest.Start(t)
	rdb := srv.Client(t, func(o *redis.Options) { o.PoolSize = callers })
	var mu sync.Mutex
	due := make([]time.Time, callers)       // when the server's last grant to each caller fell due
	first := make([]chan struct{}, callers) // closed on each caller's first grant
	for i := range first {
		first[i] = make(chan struct{})
	}
	rdb.AddHook(replyHook{seen: func(i int, at time.Time, reply any) {
		mu.Lock()
		defer mu.Unlock()
		d, ok := dueOf(at, reply)
		if !ok {
			return // not a take's grant: the read of the control record, say
		}
		due[i] = d
		select {
		case <-first[i]:
		default:
			close(first[i])
		}
	}})
	l := NewLimiter(rdb)

	start := time.Now()
	errs := make([]error, callers)
	done := make([]time.Time, callers)
	began := make([]time.Time, callers)
	var wg sync.WaitGroup
	for i := range callers {
		began[i] = time.Now()
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), callerKey{}, i), 30*time.Second)
			defer cancel()
			errs[i] = l.Wait(ctx, "overload", lim)
			done[i] = time.Now()
		})
		// The next caller reaches Redis after this one: it starts once this
		// one has its reply, or holds its bucket's call, or is queued
		// behind a call, where the next one queues after it.
		for !placed(l, "overload", i, first[i]) {
			time.Sleep(100 * time.Microsecond)
		}
	}
	wg.Wait()
	t.Logf("%d callers on %v: a queue of %v, all served in %v", callers, lim, queue, time.Since(start).Round(time.Millisecond))

	var longest, lateness time.Duration
	for i := range callers {
		if errs[i] != nil {
			t.Fatalf("caller %d: %v", i, errs[i])
		}
		longest = max(longest, done[i].Sub(began[i]))
		if i > 0 && !due[i].After(due[i-1]) {
			t.Errorf("caller %d was granted for %v, not after caller %d (%v): not first come, first served",
				i, due[i].Sub(start), i-1, due[i-1].Sub(start))
		}
		late := done[i].Sub(due[i])
		if late < -time.Millisecond {
			t.Errorf("caller %d woke %v before its grant fell due", i, -late)
		}
		lateness = max(lateness, late)
	}
	t.Logf("longest wait %v (bound 1.3 x %v); latest wake-up %v after its grant fell due", longest.Round(time.Millisecond), queue, lateness.Round(time.Millisecond))
	if bound := queue * 13 / 10; longest > bound {
		t.Errorf("a caller waited %v, want at most %v", longest, bound)
	}
	// Waking up is the machine's business, not the limiter's: a bound of
	// its own, wide enough for two busy cores.
	if lateness > 500*time.Millisecond {
		t.Errorf("a caller woke %v after its grant fell due", lateness)
	}
}

func TestSwarmNeverOverIssues(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	l := NewLimiter(rdb)
	lim := Limit{Rate: 10, Burst: 5}
	warm(t, rdb, "swarm", 25)
	grants, err := swarm(context.Background(), 25, time.Now(), 3*time.Second, func(ctx context.Context) error {
		return l.Wait(ctx, "swarm", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	checkSwarm(t, grants, lim, 3*time.Second)
}

// checkCatchesNaive asserts that the swarm's exactness assertion fails the
// naive limiter's grants.
func checkCatchesNaive(t *testing.T, what string, grants []stamp, lim Limit) {
	t.Helper()
	due := dues(t, grants)
	got, limit := maxInWindow(due, time.Second), bound(lim, time.Second+dueRounding)
	least, _ := minSpacing(grants)
	t.Logf("naive get-then-set %s: %d grants, at most %d due in a 1s window (bound %d), %d woke in one; grants that waited at least %v apart (interval %v)",
		what, len(grants), got, limit, maxInWindow(wakes(grants), time.Second), least, time.Duration(float64(time.Second)/lim.Rate))
	if got <= limit {
		t.Errorf("the exactness assertion passed a get-then-set limiter %s: %d in a 1s window, bound %d", what, got, limit)
	}
	if least >= time.Duration(float64(time.Second)/lim.Rate)-2*time.Microsecond {
		t.Errorf("the spacing assertion passed a get-then-set limiter %s: grants at least %v apart", what, least)
	}
}

func TestSwarmCatchesNaiveGetThenSet(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	lim := Limit{Rate: 10, Burst: 5}
	warm(t, rdb, "naive", 25)
	grants, err := swarm(context.Background(), 25, time.Now(), 3*time.Second, func(ctx context.Context) error {
		return naiveWait(ctx, rdb, "naive", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	checkCatchesNaive(t, "in one process", grants, lim)
}

func TestSwarmWithLaggingCallerClocks(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	lim := Limit{Rate: 10, Burst: 5}
	const skew = 300 * time.Millisecond
	// Half the callers run 300ms behind. Their takes can never rewind the
	// bucket, but a take stamped in their past looks refilled to the
	// others: the documented cost of caller clocks is skew*Rate tokens.
	// On the script's own instants the bound is exact; the grants of the
	// late half fall due skew later than the script's clock says.
	onTime := NewLimiter(rdb, WithClock(time.Now))
	late := NewLimiter(rdb, WithClock(func() time.Time { return time.Now().Add(-skew) }))
	var i atomic.Int64
	warm(t, rdb, "clock", 24)
	grants, err := swarm(context.Background(), 24, time.Now(), 3*time.Second, func(ctx context.Context) error {
		if i.Add(1)%2 == 0 {
			dueRecordOf(ctx).Behind = skew
			return late.Wait(ctx, "clock", lim)
		}
		return onTime.Wait(ctx, "clock", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	script := make([]time.Time, 0, len(grants))
	for _, g := range grants {
		script = append(script, g.Due)
	}
	slices.SortFunc(script, func(a, b time.Time) int { return a.Compare(b) })
	inScript := checkExact(t, "in the script's clock", script, lim, time.Second, 1)
	checkSpacing(t, grants, 1, lim.Rate)
	got, limit := maxInWindow(dues(t, grants), time.Second), bound(lim, time.Second+skew+dueRounding)
	t.Logf("%d grants; in the script's clock at most %d in a 1s window (bound %d); in this machine's at most %d (bound Burst+Rate*(1s+skew) = %d)",
		len(grants), inScript, bound(lim, time.Second), got, limit)
	if got > limit {
		t.Errorf("%d grants fell due in one 1s window with lagging clocks, bound %d", got, limit)
	}
	checkJitter(t, grants)
}

func TestThroughputUnderSaturation(t *testing.T) {
	redistest.Long(t)
	rdb := newServerClient(t)
	l := NewLimiter(rdb)
	lim := Limit{Rate: 100, Burst: 10}
	const callers = 100 // a queue a second deep
	warm(t, rdb, "saturated", callers)
	grants, err := swarm(context.Background(), callers, time.Now(), 3*time.Second, func(ctx context.Context) error {
		return l.Wait(ctx, "saturated", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	// The rate is measured on the due instants, from the first grant that
	// waited to the last: the callers keep the queue full, so the script
	// grants one every 1/Rate, whenever they wake. Late callers cost
	// nothing unless all of them are late by more than the queue (1 s)
	// and the burst (100 ms) absorb, longer than checkJitter allows.
	var waited []time.Time
	for _, g := range grants {
		if g.Waited {
			waited = append(waited, g.Due)
		}
	}
	slices.SortFunc(waited, func(a, b time.Time) int { return a.Compare(b) })
	first, last := waited[0], waited[len(waited)-1]
	n := 0
	for _, d := range dues(t, grants) {
		if d.After(first) && !d.After(last) {
			n++
		}
	}
	span := last.Sub(first)
	rate := float64(n) / span.Seconds()
	t.Logf("sustained %.3f grants/s over %v against a rate of %v; %d grants", rate, span.Round(time.Millisecond), lim.Rate, len(grants))
	if math.Abs(rate-lim.Rate)/lim.Rate > 0.01 || span < 2900*time.Millisecond {
		t.Errorf("sustained %.3f/s over %v, want within 1%% of %v over at least 2.9s", rate, span, lim.Rate)
	}
	// Each grant that waited fell due one interval after the grant before
	// it, if that one waited too: the queue loses no slot and skips none.
	byDue := slices.Clone(grants)
	slices.SortFunc(byDue, func(a, b stamp) int { return a.Due.Compare(b.Due) })
	interval := time.Duration(float64(time.Second) / lim.Rate)
	for i := 1; i < len(byDue); i++ {
		if !byDue[i].Waited || !byDue[i-1].Waited {
			continue
		}
		if gap := byDue[i].Due.Sub(byDue[i-1].Due); (gap - interval).Abs() > 2*time.Microsecond {
			t.Errorf("grant %d of %d fell due %v after the one before it, want %v", i+1, len(byDue), gap, interval)
			break
		}
	}
	logAtOnce(t, grants)
	checkJitter(t, grants)
}

func TestReportedWaitIsExact(t *testing.T) {
	redistest.Long(t)
	rdb := newServerClient(t)
	ctx := context.Background()
	// take takes n tokens and returns the grant and what dueHook saw of it.
	take := func(l *Limiter, b bucket, n float64) (store.Grant, *dueRecord) {
		t.Helper()
		tctx, rec := withDueRecord(ctx)
		g, err := l.store.Take(tctx, b.Bucket, store.Tokens(n), time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if !g.Granted() || rec.Due.IsZero() {
			t.Fatalf("%v tokens refused, or no due instant (%+v)", n, rec)
		}
		return g, rec
	}
	// near reports whether d is within the script's microsecond rounding
	// of want.
	near := func(d, want time.Duration) bool { return (d - want).Abs() <= 2*time.Microsecond }
	// within reports whether at falls in the round trip of the take rec
	// saw, give or take the script's rounding.
	within := func(at time.Time, rec *dueRecord) bool {
		return !at.Before(rec.Sent.Add(-2*time.Microsecond)) && !at.After(rec.Replied.Add(2*time.Microsecond))
	}
	// attempts runs try until it reports that the machine did not stall
	// between the takes for longer than the bucket remembers them.
	attempts := func(lim Limit, try func(name string) bool) int {
		t.Helper()
		for i := 1; i <= 10; i++ {
			if try(fmt.Sprintf("exact-%v-%d", lim, i)) {
				return i
			}
		}
		t.Fatalf("%v: the machine stalled between the takes of each of 10 attempts", lim)
		return 0
	}
	for _, lim := range []Limit{{Rate: 10, Burst: 5}, {Rate: 3, Burst: 2}, {Rate: 250, Burst: 20}} {
		interval := time.Duration(float64(time.Second) / lim.Rate)
		full := time.Duration(lim.Burst / lim.Rate * float64(time.Second))

		// The caller's clock, stopped: after the bucket is emptied, the
		// wait for one more token is the refill interval, to the
		// microsecond, however long the machine takes between the takes
		// (unless it takes so long that the emptied bucket expires).
		frozen := time.Now()
		clocked := NewLimiter(rdb, WithClock(func() time.Time { return frozen }))
		var clockedWait time.Duration
		attempts(lim, func(name string) bool {
			b, _ := clocked.bucket(name+"-clock", []Limit{lim})
			take(clocked, b, lim.Burst)
			g, rec := take(clocked, b, 1)
			clockedWait = g.Wait
			return rec.Waited
		})
		if want := interval.Round(time.Microsecond); clockedWait != want {
			t.Errorf("%v, caller's clock: reported wait %v after the bucket was emptied, want the interval %v", lim, clockedWait, want)
		}

		// The server's clock: the script's now is not in the reply, but
		// the tats say when the first take emptied the bucket, and each
		// wait when its take was made (its grant less the wait): both
		// must fall within the round trips of those takes. The second
		// take queues a burst behind the first, so that the third, of one
		// token, still waits after a stall of the machine between them;
		// the grants fall due a burst and then an interval apart.
		l := NewLimiter(rdb)
		var (
			name            string
			empty, third    *dueRecord
			g3              store.Grant
			emptied, queued time.Time
		)
		tries := attempts(lim, func(n string) bool {
			name = n
			b, _ := l.bucket(name, []Limit{lim})
			var second *dueRecord
			_, empty = take(l, b, lim.Burst)
			_, second = take(l, b, lim.Burst)
			g3, third = take(l, b, 1)
			if !second.Waited || !third.Waited {
				return false
			}
			emptied, queued = time.UnixMicro(g3.Tats[0]).Add(-2*full-interval), second.Due
			return true
		})
		taken := third.Due.Add(-g3.Wait)
		if !within(emptied, empty) {
			t.Errorf("%v: the tats put the emptying take %v into its round trip of %v", lim, emptied.Sub(empty.Sent), empty.Replied.Sub(empty.Sent))
		}
		if !within(taken, third) {
			t.Errorf("%v: reported wait %v puts its take %v into its round trip of %v", lim, g3.Wait, taken.Sub(third.Sent), third.Replied.Sub(third.Sent))
		}
		if !near(queued.Sub(emptied), full) || !near(third.Due.Sub(queued), interval) {
			t.Errorf("%v: the queued burst fell due %v after the bucket was emptied and the next token %v after it, want %v and %v",
				lim, queued.Sub(emptied), third.Due.Sub(queued), full, interval)
		}

		// A waiter wakes when its token accrues: never before, and after
		// no longer than the machine takes to wake it.
		wctx, fourth := withDueRecord(ctx)
		if err := l.Wait(wctx, name, lim); err != nil {
			t.Fatal(err)
		}
		late := time.Since(fourth.Due)
		if fourth.Waited && !near(fourth.Due.Sub(third.Due), interval) {
			t.Errorf("%v: consecutive tokens fell due %v apart, want %v", lim, fourth.Due.Sub(third.Due), interval)
		}
		t.Logf("%v: caller's clock: reported %v for an interval of %v; server's clock (attempt %d): the take %v into a round trip of %v, the emptying %v into one of %v; the waiter woke %v after its token accrued",
			lim, clockedWait, interval, tries, taken.Sub(third.Sent), third.Replied.Sub(third.Sent), emptied.Sub(empty.Sent), empty.Replied.Sub(empty.Sent), late)
		if late < -time.Microsecond || late > maxJitter {
			t.Errorf("%v: the waiter woke %v after its token accrued, want between 0 and %v", lim, late, maxJitter)
		}
	}
}

func TestSwarmAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 10, Burst: 5}
	reports := runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: "procs", Limit: lim, Goroutines: 10, Duration: 3 * time.Second})
	for i, r := range reports {
		t.Logf("worker %d: %d grants", i, len(r.Grants))
	}
	checkSwarm(t, mergeStamps(reports), lim, 3*time.Second)
}

func TestSwarmAcrossProcessesCatchesNaive(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 10, Burst: 5}
	reports := runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: "naive-procs", Limit: lim, Goroutines: 10, Duration: 2 * time.Second, Naive: true})
	checkCatchesNaive(t, "across 3 processes", mergeStamps(reports), lim)
}

// 4 processes x 50 goroutines: the bound holds on the server's grant
// instants, and the processes send fewer than half a command a grant.
// After the first wave each caller asks as its grant falls due, an
// interval of the fleet's queue after the one before, mostly with no call
// of its process in flight: alone it would send a call of its own (0.75
// commands per grant with store.MaxHold set to 0); the hold gathers the callers
// of its process that come in the next 50 ms.
func TestCommandsPerGrantUnderContention(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	lim := Limit{Rate: 200, Burst: 20}
	const procs, goroutines = 4, 50
	reports := runWorkers(t, procs, workerSpec{Addr: srv.Addr(), Key: "contended", Limit: lim, Goroutines: goroutines, Duration: 3 * time.Second})
	var grants, cmds int64
	for i, r := range reports {
		grants += int64(len(r.Grants))
		cmds += r.Commands
		t.Logf("worker %d: %d commands for %d grants", i, r.Commands, len(r.Grants))
	}
	perGrant := float64(cmds) / float64(grants)
	t.Logf("%d processes x %d goroutines on %v, store.MaxHold %v: %d commands for %d grants, %.3f per grant", procs, goroutines, lim, store.MaxHold, cmds, grants, perGrant)
	if perGrant > 0.5 {
		t.Errorf("%.3f Redis commands per grant, want at most 0.5: the callers of each process share calls", perGrant)
	}
	checkSwarm(t, mergeStamps(reports), lim, 3*time.Second)
}

// Weighted requests across processes: grants of 3 tokens each never take
// more than the bucket allows in any window of their due instants, counted
// in tokens.
func TestWeightedAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 30, Burst: 15}
	const cost = 3
	reports := runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: "weighted", Limit: lim, Cost: cost, Goroutines: 10, Duration: 3 * time.Second})
	grants := mergeStamps(reports)
	got := checkExact(t, "due instants", dues(t, grants), lim, time.Second, cost)
	t.Logf("%d grants of %d tokens; at most %d tokens due in any 1s window (bound %d)", len(grants), cost, got, bound(lim, time.Second))
	checkSpacing(t, grants, cost, lim.Rate)
	checkJitter(t, grants)
	if want := int(0.9 * (lim.Burst + lim.Rate*3) / cost); len(grants) < want {
		t.Errorf("%d grants, want at least %d", len(grants), want)
	}
}
