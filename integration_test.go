package quota

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// The integration tests run the script on real redis-server processes that
// they start themselves: the atomicity argument is only evidence on the
// server that ships.

func TestMain(m *testing.M) {
	// The tests kill servers on purpose; go-redis would log every failed dial.
	redis.SetLogger(quietLogger{})
	if os.Getenv(workerEnv) != "" {
		os.Exit(runWorker())
	}
	os.Exit(redistest.Main(m))
}

type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// acquireFunc takes one grant or fails.
type acquireFunc func(ctx context.Context) error

// A stamp is one grant as a swarm saw it.
type stamp struct {
	// Due is when the script granted it, in the clock the script read (see
	// dueHook); zero when no take was granted, as under a Policy.
	Due time.Time
	// Waited tells that the reply carried a wait, so that Due follows from
	// its tats. A take granted at once is stamped when it was sent, at
	// most its round trip, Early, before the server granted it.
	Waited bool
	Early  time.Duration
	// Behind is how far the script's clock ran behind this machine's
	// (WithClock).
	Behind time.Duration
	// Asked is when the caller asked for it.
	Asked time.Time
	// Woke is when the acquisition returned to its caller.
	Woke time.Time
}

// swarm runs goroutines that each call acquire in a loop until d has passed
// after start, and returns the grants in the order their callers woke. Each
// acquisition's context is marked with a dueRecord (see dueHook), from
// which the grant's due instant is taken.
func swarm(ctx context.Context, goroutines int, start time.Time, d time.Duration, acquire acquireFunc) ([]stamp, error) {
	var (
		mu     sync.Mutex
		grants []stamp
		wg     sync.WaitGroup
		errs   = make(chan error, goroutines)
	)
	end := start.Add(d)
	for range goroutines {
		wg.Add(1)
		go func() {
			defer wg.Done()
			time.Sleep(time.Until(start))
			for time.Now().Before(end) {
				actx, rec := withDueRecord(ctx)
				asked := time.Now()
				if err := acquire(actx); err != nil {
					if err != errSwarmEnded {
						errs <- err
					}
					return
				}
				if rec.Asked.After(asked) {
					asked = rec.Asked
				}
				s := stamp{Due: rec.Due, Waited: rec.Waited, Behind: rec.Behind, Asked: asked, Woke: time.Now()}
				if !rec.Waited {
					s.Early = rec.Replied.Sub(rec.Sent)
				}
				mu.Lock()
				grants = append(grants, s)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	close(errs)
	slices.SortFunc(grants, func(a, b stamp) int { return a.Woke.Compare(b.Woke) })
	return grants, <-errs
}

// errSwarmEnded ends a swarm's goroutine quietly: its acquisition failed
// because the run's deadline came (workerSpec.Deadline).
var errSwarmEnded = errors.New("the run ended")

// maxInWindow returns the largest number of grants in any window of length
// w, closed at both ends. grants must be sorted.
func maxInWindow(grants []time.Time, w time.Duration) int {
	best, j := 0, 0
	for i := range grants {
		for j < len(grants) && grants[j].Sub(grants[i]) <= w {
			j++
		}
		best = max(best, j-i)
	}
	return best
}

// bound is the most grants a bucket of lim may issue in a window of w.
func bound(lim Limit, w time.Duration) int {
	lim, _ = lim.resolve()
	return int(math.Floor(lim.Burst + lim.Rate*w.Seconds()))
}

// dueRounding is all that due instants may be off by: the script floors
// the tats it replies to the microsecond, and each take adds its interval
// to a double that holds a quarter of a microsecond at today's epoch, so a
// window of up to 400 grants may drift by 50 µs. At the tests' rates that
// is less than a hundredth of a token: the bound is Burst + Rate×W.
const dueRounding = 50 * time.Microsecond

// maxJitter bounds how late a caller may wake after its grant fell due.
// Waking is the machine's business, not the limiter's: a bound of its own,
// wide enough for two busy cores running several test binaries, where the
// swarms measure a few milliseconds at the median and tens at the p99.
const maxJitter = time.Second

// dues returns the due instants of grants in this machine's clock, sorted,
// and fails the test when a grant has none.
func dues(t *testing.T, grants []stamp) []time.Time {
	t.Helper()
	out := make([]time.Time, 0, len(grants))
	for _, g := range grants {
		if g.Due.IsZero() {
			t.Fatalf("a grant without a due instant: the client lacks dueHook, or a Policy granted it")
		}
		out = append(out, g.Due.Add(g.Behind))
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out
}

// wakes returns when the callers of grants woke, sorted.
func wakes(grants []stamp) []time.Time {
	out := make([]time.Time, 0, len(grants))
	for _, g := range grants {
		out = append(out, g.Woke)
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out
}

// checkExact asserts that grants, of cost tokens each, never take more than
// lim allows, Burst + Rate×w tokens, in any closed window of length w of
// their due instants, and returns the most tokens in one.
func checkExact(t *testing.T, what string, due []time.Time, lim Limit, w time.Duration, cost float64) int {
	t.Helper()
	got, limit := int(float64(maxInWindow(due, w))*cost), bound(lim, w+dueRounding)
	if exact := bound(lim, w); limit != exact {
		t.Fatalf("%v over %v: the rounding allowance raises the bound from %d to %d", lim, w, exact, limit)
	}
	if got > limit {
		t.Errorf("%s: %d tokens granted in one %v window, bound Burst+Rate×%v = %d", what, got, w, w, limit)
	}
	return got
}

// minSpacing returns the shortest time between the due instants, in the
// script's clock, of two grants that waited, and how many waited.
func minSpacing(grants []stamp) (time.Duration, int) {
	var due []time.Time
	for _, g := range grants {
		if g.Waited {
			due = append(due, g.Due)
		}
	}
	slices.SortFunc(due, func(a, b time.Time) int { return a.Compare(b) })
	least := time.Duration(math.MaxInt64)
	for i := 1; i < len(due); i++ {
		least = min(least, due[i].Sub(due[i-1]))
	}
	return least, len(due)
}

// checkSpacing asserts that no two grants that waited, of cost tokens
// each, fell due closer than cost/rate apart, where rate is the fastest
// layer's. Each take that waits moves every layer's tat on by at least
// cost/rate_i, and falls due when the slowest layer allows, so this holds
// whatever else the callers do; it is the window bound at the scale of a
// single interval, where an over-issue of a few percent shows at any
// rate. Grants at once (a burst) are not spaced.
func checkSpacing(t *testing.T, grants []stamp, cost, rate float64) {
	t.Helper()
	least, n := minSpacing(grants)
	interval := time.Duration(cost / rate * float64(time.Second))
	if n < 2 {
		t.Errorf("%d grants waited, want a queue", n)
		return
	}
	t.Logf("%d grants waited, at least %v apart (interval %v)", n, least, interval)
	if least < interval-2*time.Microsecond {
		t.Errorf("two grants fell due %v apart, want at least the interval %v", least, interval)
	}
}

// checkJitter asserts that no caller woke before its grant fell due, which
// would be the limiter's fault, and that none woke more than maxJitter
// after, which is the machine's; it logs the distribution.
func checkJitter(t *testing.T, grants []stamp) {
	t.Helper()
	if len(grants) == 0 {
		return
	}
	late := make([]time.Duration, len(grants))
	for i, g := range grants {
		late[i] = g.Woke.Sub(g.Due.Add(g.Behind))
	}
	slices.Sort(late)
	q := func(p float64) time.Duration { return late[int(p*float64(len(late)-1))] }
	t.Logf("woke after the grant fell due: p50 %v, p99 %v, max %v (bound %v)", q(0.5), q(0.99), late[len(late)-1], maxJitter)
	if late[0] < -time.Microsecond {
		t.Errorf("a caller woke %v before its grant fell due", -late[0])
	}
	if late[len(late)-1] > maxJitter {
		t.Errorf("a caller woke %v after its grant fell due, bound %v", late[len(late)-1], maxJitter)
	}
}

// logAtOnce logs how many grants were granted at once, and so stamped when
// their takes were sent, and how much earlier than the server granted them
// that can be: the margin by which the exactness assertion may miss an
// over-issue among them.
func logAtOnce(t *testing.T, grants []stamp) {
	t.Helper()
	n, early := 0, time.Duration(0)
	for _, g := range grants {
		if !g.Waited {
			n++
			early = max(early, g.Early)
		}
	}
	t.Logf("%d granted at once, stamped up to %v before the server granted them", n, early)
}

// checkSwarm asserts that the grants never exceed the bucket's bound in any
// 1-second window of their due instants, that their callers woke neither
// early nor unreasonably late, and that the bucket did not simply starve
// them.
func checkSwarm(t *testing.T, grants []stamp, lim Limit, d time.Duration) {
	t.Helper()
	got := checkExact(t, "due instants", dues(t, grants), lim, time.Second, 1)
	t.Logf("%d grants in %v; at most %d due in any 1s window (bound %d); at most %d woke in one",
		len(grants), d, got, bound(lim, time.Second), maxInWindow(wakes(grants), time.Second))
	checkSpacing(t, grants, 1, lim.Rate)
	logAtOnce(t, grants)
	checkJitter(t, grants)
	lim, _ = lim.resolve()
	if want := int(lim.Burst + lim.Rate*d.Seconds()*0.9); len(grants) < want {
		t.Errorf("%d grants in %v, want at least %d: the bucket starves its callers", len(grants), d, want)
	}
}

// newServerClient starts a redis-server and returns a client of it that
// records due instants (dueHook).
func newServerClient(t *testing.T, opts ...func(*redis.Options)) *redis.Client {
	t.Helper()
	rdb := redistest.Start(t).Client(t, opts...)
	rdb.AddHook(dueHook{})
	return rdb
}

// warm dials n connections for a swarm on the bucket called name (see
// warmUp).
func warm(t *testing.T, rdb redis.UniversalClient, name string, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := warmUp(ctx, rdb, name, n); err != nil {
		t.Fatal(err)
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

// naiveWait is the get-then-set limiter the script exists to prevent: the
// same arithmetic, in three Redis calls that other callers interleave with.
// It is here only to show that the swarm assertions can fail. It records
// the instant its arithmetic grants at in ctx's dueRecord, as dueHook does
// for the script. Between its read and its write it waits a millisecond,
// a network's round trip: on loopback, a loaded machine could otherwise
// run each caller's two calls back to back, and the race the assertions
// exist to catch would not happen.
func naiveWait(ctx context.Context, rdb *redis.Client, key string, lim Limit) error {
	lim, _ = lim.resolve()
	interval := 1e6 / lim.Rate
	now := float64(time.Now().UnixMicro())
	tat, err := rdb.Get(ctx, key).Float64()
	if errors.Is(err, redis.Nil) {
		tat, err = now, nil
	}
	if err != nil {
		return err
	}
	time.Sleep(time.Millisecond)
	next := max(tat, now) + interval
	if err := rdb.Set(ctx, key, strconv.FormatFloat(next, 'f', -1, 64), time.Minute).Err(); err != nil {
		return err
	}
	if rec := dueRecordOf(ctx); rec != nil {
		due := max(next-lim.Burst*interval, now) // µs
		rec.setDue(time.Unix(0, int64(math.Round(due*1e3))), next-now > lim.Burst*interval, 0)
	}
	return sleep(ctx, time.Duration(next-now-lim.Burst*interval)*time.Microsecond)
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

func TestScriptFlushMidRun(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb, admin := srv.Client(t), srv.Client(t)
	logs := &logRecorder{}
	l := NewLimiter(rdb, WithLogger(slog.New(logs)))
	lim := Limit{Rate: 50, Burst: 5}
	time.AfterFunc(500*time.Millisecond, func() { admin.ScriptFlush(context.Background()) })
	time.AfterFunc(1000*time.Millisecond, func() { admin.ScriptFlush(context.Background()) })
	grants, err := swarm(context.Background(), 10, time.Now(), 1500*time.Millisecond, func(ctx context.Context) error {
		return l.Wait(ctx, "flush", lim)
	})
	if err != nil {
		t.Fatalf("a wait failed across SCRIPT FLUSH: %v", err)
	}
	if len(grants) < 50 {
		t.Errorf("%d grants, want about 80", len(grants))
	}
	if l.Mode() != ModeShared || logs.Len() > 0 {
		t.Errorf("SCRIPT FLUSH changed the mode to %v:\n%s", l.Mode(), logs)
	}
}

// The worker process: the test binary re-executed with workerEnv set. It
// builds its Redis client and its way of acquiring from the workerSpec in
// its environment, pings Redis, then says so on stdout with the line
// workerReady and waits for a workerStart on stdin. Only when every worker
// is ready does the parent send them the instant to start at, so a run
// never depends on how long a loaded machine takes to start a process.
// Each worker then runs its goroutines against the bucket and prints a
// workerReport as JSON.

const (
	workerEnv   = "QUOTA_TEST_WORKER"
	workerReady = "ready"

	// workerReadyTimeout bounds how long a worker may take to start, build
	// its client and reach Redis: a race-enabled binary on two busy cores
	// takes seconds.
	workerReadyTimeout = 60 * time.Second
	// workerStartMargin is how far ahead of the moment every worker is
	// ready the parent sets the start: time for each to read its line.
	workerStartMargin = 100 * time.Millisecond
	// workerEndTimeout bounds how long after its run a worker may take to
	// report.
	workerEndTimeout = 60 * time.Second
)

// workerSpec tells a worker process what to run. New kinds of acquisition
// add fields here and a case to acquirer.
type workerSpec struct {
	Addr       string   // a single server
	Cluster    []string // or the nodes of a Cluster
	Key        string
	Limit      Limit
	Goroutines int
	Duration   time.Duration
	Naive      bool
	Layers     []Limit // more Limits the bucket obeys, taken with WaitN
	Cost       float64 // tokens a grant takes, 1 when zero
	URL        string  // when set, GET it through a Transport instead
	Headers    bool    // with WithProviderHeaders
	Fallback   int     // with FallbackLocal(Fallback) when above zero
	Faults     bool    // a client with short timeouts and no retries, for Redis faults

	Concurrency int           // with WithConcurrency(Concurrency) when above zero
	SlotLease   time.Duration // with WithSlotLease(SlotLease) when above zero

	// Linger, when above zero, is WithSlotLinger(Linger); below zero,
	// WithSlotLinger(0).
	Linger time.Duration
	// NoRegister never holds in Redis the slots in use that it does not
	// hold: those granted during an outage stay unknown to it.
	NoRegister bool
	// NoLeaseCheck sends on a slot without checking its lease first.
	NoLeaseCheck bool
	// Stagger starts worker i's run i×Stagger after the first's.
	Stagger time.Duration
	// Delay starts the first worker's run Delay after every worker is
	// ready, not at once.
	Delay time.Duration
	// Deadline gives every acquisition a deadline at the end of its
	// worker's run, as a job with a time budget does: the last ones end
	// cancelled, and a failure that the deadline caused is no error.
	Deadline bool
	// Think, when above zero, is how long each goroutine rests after each
	// request, so that no call of its own follows its release at once.
	Think time.Duration
	// ReleaseDelay, when above zero, replaces slots.ReleaseDelay.
	ReleaseDelay time.Duration
	// NoFlush exits without Limiter.Flush.
	NoFlush bool
	// NoJoin: the Limiter neither learns of an outage from its reads in
	// the background nor holds the shared bucket until the fleet resumes.
	NoJoin bool

	// LLM, with URL, posts to an LLM API through a Transport
	// WithMetering of that API's profile: "anthropic" or "openai", under
	// LLMLimits (Limit is the requests').
	LLM       string
	LLMLimits llmLimits
	Stream    bool // ask for answers as event streams
	MaxTokens int  // each request's max_tokens
	NoSettle  bool // the profile without its Usage: reservations never settle
	// ReserveOutput, when above zero, is what a request reserves of the
	// output meter in place of its max_tokens: a quantile of the usage.
	ReserveOutput float64
	// OwnPrefix gives each worker a prefix of its own: per-process
	// limiters, which share nothing.
	OwnPrefix bool
	// Priority is the priority of the worker's acquisitions (WaitN, or
	// the requests to URL).
	Priority int
	// MinShare, when above zero, is WithMinShare(0, MinShare).
	MinShare float64
	// Tenant, when set, names the tenant of the worker's acquisitions
	// (ContextWithTenant); Weights, when set, are the Limiter's
	// WithTenants.
	Tenant  string
	Weights map[string]float64
	// Rest, when above zero, is how long each goroutine rests between its
	// requests, as Think, but before the next one: the time a request
	// waited counts from its ask (stamp.Asked), after the rest.
	Rest time.Duration
}

// llmLimits are the token limits of an LLM profile.
type llmLimits struct {
	Input, Output, Tokens Limit
}

// workerHeader names the worker process (its pid) on each request it sends
// to a provider.
const workerHeader = "X-Quota-Worker"

// workerStart is the parent's go-ahead, sent on a worker's stdin once every
// worker is ready.
type workerStart struct {
	Start time.Time // when the worker's goroutines begin
}

// workerReport is what a worker process did: its grants, by when their
// callers woke and when the script granted them.
type workerReport struct {
	Grants   []time.Time    // when the caller of each grant woke, in order
	Stamps   []stamp        // the same grants with when the script granted them (see dueHook)
	Commands int64          // Redis commands sent during the run
	Ops      map[string]int // the scripts' calls during the run, by operation
	Err      string
}

// client returns the Redis client the spec names.
func (spec workerSpec) client() redis.UniversalClient {
	if spec.Cluster != nil {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: spec.Cluster, PoolSize: spec.Goroutines})
	}
	o := &redis.Options{Addr: spec.Addr}
	if spec.Faults {
		o = faultOptions(spec.Addr)
	}
	o.PoolSize = spec.Goroutines
	return redis.NewClient(o)
}

// limiterOptions returns the Limiter's options.
func (spec workerSpec) limiterOptions() []Option {
	var opts []Option
	if spec.Fallback > 0 {
		opts = append(opts, WithPolicy(FallbackLocal(spec.Fallback)), WithLogger(discardLogger()))
	}
	if spec.SlotLease > 0 {
		opts = append(opts, WithSlotLease(spec.SlotLease))
	}
	if spec.MinShare > 0 {
		opts = append(opts, WithMinShare(0, spec.MinShare))
	}
	if spec.Weights != nil {
		opts = append(opts, WithTenants(Tenants{Weights: spec.Weights}))
	}
	if spec.OwnPrefix {
		opts = append(opts, WithPrefix(fmt.Sprintf("quota:%d:", os.Getpid())))
	}
	return opts
}

// transportOptions returns the Transport's options, its Limiter's among
// them.
func (spec workerSpec) transportOptions() []TransportOption {
	var opts []TransportOption
	for _, o := range spec.limiterOptions() {
		opts = append(opts, o)
	}
	if spec.Headers {
		opts = append(opts, WithProviderHeaders())
	}
	if spec.Concurrency > 0 {
		opts = append(opts, WithConcurrency(spec.Concurrency))
	}
	if len(spec.Layers) > 0 {
		opts = append(opts, WithLayers(spec.Layers...))
	}
	switch {
	case spec.Linger > 0:
		opts = append(opts, WithSlotLinger(spec.Linger))
	case spec.Linger < 0:
		opts = append(opts, WithSlotLinger(0))
	}
	if spec.LLM != "" {
		var m Metering
		switch spec.LLM {
		case "anthropic":
			m = Anthropic(AnthropicLimits{InputTokens: spec.LLMLimits.Input, OutputTokens: spec.LLMLimits.Output})
		case "openai":
			m = OpenAI(OpenAILimits{Tokens: spec.LLMLimits.Tokens})
		}
		if spec.NoSettle {
			m.Usage = nil
		}
		if spec.ReserveOutput > 0 {
			estimate := m.Estimate
			m.Estimate = func(req *http.Request, body []byte) (Usage, error) {
				u, err := estimate(req, body)
				if n, ok := u[MeterOutputTokens]; ok {
					u[MeterOutputTokens] = min(n, spec.ReserveOutput)
				}
				return u, err
			}
		}
		opts = append(opts, WithMetering(m))
	}
	return opts
}

// acquirer returns how each of the worker's goroutines acquires one grant
// through rdb (WaitN on the spec's layers by default), and the Limiter it
// uses, if any. An LLM worker's Transport sends on base.
func (spec workerSpec) acquirer(rdb redis.UniversalClient, base http.RoundTripper) (acquireFunc, *Limiter) {
	cost := spec.Cost
	if cost == 0 {
		cost = 1
	}
	switch {
	case spec.Naive:
		key, _ := bucketKey(DefaultPrefix, spec.Key)
		return func(ctx context.Context) error { return naiveWait(ctx, rdb.(*redis.Client), key, spec.Limit) }, nil
	case spec.LLM != "":
		tr := NewTransport(rdb, spec.Limit, append(spec.transportOptions(), WithBase(base))...)
		client := &http.Client{Transport: tr}
		var seq atomic.Int64
		return func(ctx context.Context) error {
			body := llmRequest(spec.LLM, int(seq.Add(1)), spec.MaxTokens, spec.Stream)
			req, err := http.NewRequestWithContext(ctx, "POST", spec.URL, bytes.NewReader(body))
			if err != nil {
				return err
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set(workerHeader, strconv.Itoa(os.Getpid()))
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			return err
		}, tr.Limiter()
	case spec.URL != "":
		tr := NewTransport(rdb, spec.Limit, spec.transportOptions()...)
		client := &http.Client{Transport: tr}
		return func(ctx context.Context) error {
			if spec.Priority > 0 {
				ctx = ContextWithPriority(ctx, spec.Priority)
			}
			if spec.Tenant != "" {
				ctx = ContextWithTenant(ctx, spec.Tenant)
			}
			req, err := http.NewRequestWithContext(ctx, "GET", spec.URL, nil)
			if err != nil {
				return err
			}
			req.Header.Set(workerHeader, strconv.Itoa(os.Getpid()))
			resp, err := client.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			return err
		}, tr.Limiter()
	default:
		l := NewLimiter(rdb, spec.limiterOptions()...)
		return func(ctx context.Context) error {
			if spec.Priority > 0 {
				ctx = ContextWithPriority(ctx, spec.Priority)
			}
			if spec.Tenant != "" {
				ctx = ContextWithTenant(ctx, spec.Tenant)
			}
			return l.WaitN(ctx, spec.Key, cost, spec.Limit, spec.Layers...)
		}, l
	}
}

func runWorker() int {
	var spec workerSpec
	if err := json.Unmarshal([]byte(os.Getenv(workerEnv)), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 2
	}
	checkLeases = !spec.NoLeaseCheck
	if spec.ReleaseDelay > 0 {
		slots.ReleaseDelay = spec.ReleaseDelay
	}
	registerAtResume = !spec.NoRegister
	slots.Reregister = !spec.NoRegister
	// The client stays open until the process exits: closing it after the
	// run would fail the Limiter's bucket updates still in flight, and log
	// them.
	rdb := spec.client()
	rdb.AddHook(dueHook{})
	base := providerBase(spec.Goroutines)
	acquire, limiter := spec.acquirer(rdb, base)
	if limiter != nil {
		limiter.noJoin = spec.NoJoin
	}
	ctx, cancel := context.WithTimeout(context.Background(), workerReadyTimeout)
	err := warmUp(ctx, rdb, spec.Key, spec.Goroutines)
	if err != nil {
		cancel()
		fmt.Fprintln(os.Stderr, "worker: Redis does not answer:", err)
		return 2
	}
	if spec.LLM != "" {
		err = warmProvider(ctx, base, spec.URL, spec.Goroutines)
	}
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker: the provider does not answer:", err)
		return 2
	}
	cmds := newCmdCounter() // counts from here: the run's commands only
	rdb.AddHook(cmds)

	fmt.Println(workerReady)
	var start workerStart
	if err := json.NewDecoder(os.Stdin).Decode(&start); err != nil {
		fmt.Fprintln(os.Stderr, "worker: no start from the parent:", err)
		return 2
	}
	ctx = context.Background()
	if spec.Deadline {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, start.Start.Add(spec.Duration))
		defer cancel()
		inner := acquire
		acquire = func(actx context.Context) error {
			err := inner(actx)
			if err != nil && (actx.Err() != nil || errors.Is(err, ErrWouldExceedDeadline)) {
				return errSwarmEnded // the run's deadline, or a wait past it
			}
			return err
		}
	}
	if spec.Rest > 0 {
		inner := acquire
		var calls atomic.Int64
		acquire = func(actx context.Context) error {
			if calls.Add(1) > int64(spec.Goroutines) {
				time.Sleep(spec.Rest) // after the goroutine's request before
			}
			dueRecordOf(actx).Asked = time.Now()
			return inner(actx)
		}
	}
	if spec.Think > 0 {
		inner := acquire
		acquire = func(actx context.Context) error {
			err := inner(actx)
			time.Sleep(spec.Think)
			return err
		}
	}
	grants, err := swarm(ctx, spec.Goroutines, start.Start, spec.Duration, acquire)
	if limiter != nil && !spec.NoFlush {
		fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if ferr := limiter.Flush(fctx); ferr != nil && err == nil {
			err = fmt.Errorf("Flush: %w", ferr)
		}
		cancel()
	}
	rep := workerReport{Stamps: grants, Commands: int64(cmds.total()), Ops: cmds.byOp()}
	for _, g := range grants {
		rep.Grants = append(rep.Grants, g.Woke)
	}
	if err != nil {
		rep.Err = err.Error()
	}
	json.NewEncoder(os.Stdout).Encode(rep)
	return 0
}

// warmUp pings Redis and dials n connections on the node that holds the
// bucket called name: n goroutines block side by side for a moment on a
// list beside the bucket, in its hash slot. A swarm then starts without
// dialling, and its first takes reach Redis when they are sent, not a
// connection later.
func warmUp(ctx context.Context, rdb redis.UniversalClient, name string, n int) error {
	if err := rdb.Ping(ctx).Err(); err != nil {
		return err
	}
	key, err := bucketKey(DefaultPrefix, name)
	if err != nil {
		return err
	}
	errs := make(chan error, n)
	for range n {
		go func() {
			err := rdb.Do(ctx, "blpop", key+":warm-up", "0.05").Err() // (BLPop rounds up to a second)
			if errors.Is(err, redis.Nil) {
				err = nil
			}
			errs <- err
		}()
	}
	for range n {
		if e := <-errs; e != nil {
			err = e
		}
	}
	return err
}

// providerBase returns the RoundTripper an LLM worker's Transport sends
// on: http.DefaultTransport's, keeping an idle connection to the provider
// for each of the worker's n goroutines, where the default keeps 2 and
// dials again for the others' requests.
func providerBase(n int) *http.Transport {
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.MaxIdleConnsPerHost = n
	return base
}

// warmProvider opens connections from base to the provider at url for n
// goroutines, with n requests side by side that the provider does not
// meter (a GET, which llmfake refuses with 405), as warmUp does for
// Redis: the swarm's first requests then reach the provider without a
// dial first, and no later than those granted after them (see
// TestLLMFleet).
func warmProvider(ctx context.Context, base http.RoundTripper, url string, n int) error {
	errs := make(chan error, n)
	for range n {
		go func() {
			req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
			if err == nil {
				var resp *http.Response
				if resp, err = base.RoundTrip(req); err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
			errs <- err
		}()
	}
	var err error
	for range n {
		if e := <-errs; e != nil {
			err = e
		}
	}
	return err
}

// runWorkers runs procs worker processes of spec and returns their reports.
// It starts them all, waits until every one is ready, then starts their
// runs at the same instant.
func runWorkers(t *testing.T, procs int, spec workerSpec) []workerReport {
	t.Helper()
	return startWorkers(t, procs, spec).wait(t)
}

// runningWorkers are worker processes started by startWorkers.
type runningWorkers struct {
	start time.Time // when their runs began
	spec  workerSpec
	ps    []workerProc
}

type workerProc struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *bufio.Reader
	ready chan error
}

// startWorkers starts procs worker processes of spec, waits until every
// one is ready, starts their runs at the same instant and returns, so that
// the test can act while they run.
func startWorkers(t *testing.T, procs int, spec workerSpec) *runningWorkers {
	t.Helper()
	env, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	ps := make([]workerProc, procs)
	for i := range ps {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), workerEnv+"="+string(env))
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }) // a worker left behind by a failure
		ps[i] = workerProc{cmd: cmd, in: in, out: bufio.NewReader(out), ready: make(chan error, 1)}
		go func(p workerProc) {
			line, err := p.out.ReadString('\n')
			if err == nil && line != workerReady+"\n" {
				err = fmt.Errorf("said %q, want %q", line, workerReady)
			}
			p.ready <- err
		}(ps[i])
	}
	timeout := time.NewTimer(workerReadyTimeout)
	defer timeout.Stop()
	for i, p := range ps {
		select {
		case err := <-p.ready:
			if err != nil {
				t.Fatalf("worker %d is not ready: %v", i, err)
			}
		case <-timeout.C:
			t.Fatalf("worker %d is not ready after %v", i, workerReadyTimeout)
		}
	}
	at := time.Now().Add(workerStartMargin + spec.Delay)
	for i, p := range ps {
		start, _ := json.Marshal(workerStart{Start: at.Add(time.Duration(i) * spec.Stagger)})
		if _, err := fmt.Fprintf(p.in, "%s\n", start); err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
		p.in.Close()
	}
	return &runningWorkers{start: at, spec: spec, ps: ps}
}

// wait waits for the workers' reports.
func (w *runningWorkers) wait(t *testing.T) []workerReport {
	t.Helper()
	ps, procs := w.ps, len(w.ps)

	// A worker that does not report in time is killed, which ends its
	// output and fails the decoding below.
	kill := time.AfterFunc(time.Until(w.start)+time.Duration(procs)*w.spec.Stagger+w.spec.Duration+workerEndTimeout, func() {
		for _, p := range ps {
			_ = p.cmd.Process.Kill()
		}
	})
	defer kill.Stop()
	reports := make([]workerReport, procs)
	for i, p := range ps {
		if err := json.NewDecoder(p.out).Decode(&reports[i]); err != nil {
			t.Fatalf("worker %d: no report: %v", i, err)
		}
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
		if reports[i].Err != "" {
			t.Fatalf("worker %d: %s", i, reports[i].Err)
		}
	}
	return reports
}

// mergeStamps returns the grants of every report, in the order their
// callers woke.
func mergeStamps(reports []workerReport) []stamp {
	var all []stamp
	for _, r := range reports {
		all = append(all, r.Stamps...)
	}
	slices.SortFunc(all, func(a, b stamp) int { return a.Woke.Compare(b.Woke) })
	return all
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
