package quota

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Helpers shared by the tests of several files, split from helpers_test.go:
// the timing of grants and requests. When the script granted a take
// (dueHook, takeDues), swarms of callers and the windows their grants are
// checked in, timelines of instants, and the arrivals of a fleet of
// Limiters.

// Grant instants. A take's reply says when the script granted its tokens,
// in the clock the script read (the server's, the same as this machine's,
// unless WithClock), to the microsecond: the exactness of the limiter,
// apart from when the caller happened to wake up.

// dueKey marks an acquisition's context with the *dueRecord that dueHook
// fills in.
type dueKey struct{}

// dueRecord is what dueHook learned of an acquisition's granted take.
type dueRecord struct {
	Due     time.Time     // when the script granted the tokens; zero before a granted take
	Waited  bool          // the reply carried a wait, and Due follows from its tats
	Wait    time.Duration // the wait the reply reported
	Sent    time.Time     // when the take was sent
	Replied time.Time     // and when its reply arrived
	Now     time.Time     // the script's now, when the take carried the caller's clock (WithClock)
	Behind  time.Duration // how far the clock the script read runs behind this machine's; the caller sets it
	Asked   time.Time     // when the caller asked, if later than the swarm's call (workerSpec.Rest)

	granted chan struct{} // closed at the first granted take
}

// withDueRecord returns ctx marked with a new dueRecord, for dueHook.
func withDueRecord(ctx context.Context) (context.Context, *dueRecord) {
	rec := &dueRecord{granted: make(chan struct{})}
	return context.WithValue(ctx, dueKey{}, rec), rec
}

// dueRecordOf returns the dueRecord ctx is marked with, or nil.
func dueRecordOf(ctx context.Context) *dueRecord {
	rec, _ := ctx.Value(dueKey{}).(*dueRecord)
	return rec
}

// setDue records a grant at due; the first closes rec.granted.
func (rec *dueRecord) setDue(due time.Time, waited bool, wait time.Duration) {
	rec.Due, rec.Waited, rec.Wait = due, waited, wait
	select {
	case <-rec.granted:
	default:
		close(rec.granted)
	}
}

// A grant that a pause, a change of the Limit or a give-back moved falls
// due when the bucket's timeline says, which the Limiter tells movedHook.
func init() {
	movedHook = func(ctx context.Context, moved time.Duration) {
		if rec := dueRecordOf(ctx); rec != nil && !rec.Due.IsZero() {
			rec.Due = rec.Due.Add(moved)
		}
	}
}

// dueHook is a go-redis hook that works out, from the reply of each take
// made under a context marked by withDueRecord, when the script granted
// the tokens (see takeDues), and records it there. A call that serves
// several callers' takes carries their contexts (callersKey), and each
// caller's record gets its own part of the reply. The hook runs in the
// goroutine that makes the call, before any caller sees the reply.
type dueHook struct{}

func (dueHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (dueHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		callers, _ := ctx.Value(store.CallersKey{}).([]context.Context)
		if callers == nil {
			callers = []context.Context{ctx}
		}
		recs := make([]*dueRecord, len(callers))
		marked := false
		for i, c := range callers {
			recs[i] = dueRecordOf(c)
			marked = marked || recs[i] != nil
		}
		if !marked {
			return next(ctx, cmd)
		}
		sent := time.Now()
		err := next(ctx, cmd)
		replied := time.Now()
		if err != nil {
			return err
		}
		tks := takeDues(cmd, sent)
		if len(tks) != len(recs) {
			return err
		}
		for i, rec := range recs {
			if rec != nil && tks[i].granted {
				tk := tks[i]
				rec.Sent, rec.Replied, rec.Now = sent, replied, tk.now
				rec.setDue(tk.due, tk.waited, tk.wait)
			}
		}
		return err
	}
}

func (dueHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// takeGrant is what a take's command and reply say of one caller's take.
type takeGrant struct {
	granted bool          // false for a refusal
	due     time.Time     // when the script granted the tokens
	wait    time.Duration // the wait the reply reported
	waited  bool          // the reply carried a wait, and due follows from its tats
	now     time.Time     // the caller's clock the take carried (WithClock), or zero
}

// takeDues returns what a take's command and reply say of each caller's
// take, in order: one for a take of its own, one a caller for a batch; nil
// for any other command. sent is when the command was sent.
//
// A take that waits replies {1, wait, tat_1, ..., tat_k}: tat_i is layer
// i's new theoretical arrival time, max(old tat_i, now) + n/rate_i. Layer
// i holds burst_i tokens again at tat_i less burst_i/rate_i. The layer
// that sets the wait had its old tat beyond the grant instant g, so g =
// tat_i - burst_i/rate_i for it, and for every other layer
// tat_j - burst_j/rate_j <= g (its own wait is no longer). So g is the
// largest tat_i - burst_i/rate_i: found here to within the microsecond to
// which the script floors the tats, never later. A batch replies such a
// table for each caller, one after another.
//
// A take granted at once replies 0 alone (a batch: 0 when every caller
// was, or a wait of 0 in its part), and g is the script's now, which the
// reply does not give. It is the caller's clock in ARGV[2] when the take
// carries one (WithClock); otherwise the server read its clock after the
// take was sent, and sent, never later, stands in for it.
func takeDues(cmd redis.Cmder, sent time.Time) []takeGrant {
	k, callers, argv, ok := takeCall(cmd)
	c, isCmd := cmd.(*redis.Cmd)
	if !ok || !isCmd {
		return nil
	}
	var now time.Time
	if s := fmt.Sprint(argv[1]); s != "" {
		us, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil
		}
		now = time.UnixMicro(us)
	}
	atOnce := takeGrant{granted: true, due: sent, now: now}
	if !now.IsZero() {
		atOnce.due = now
	}
	out := make([]takeGrant, callers)
	switch v := c.Val().(type) {
	case int64:
		if v != 0 {
			return nil
		}
		for i := range out {
			out[i] = atOnce
		}
		return out
	case []any:
		stride := 2 + 2*k                                                 // and the positions
		if rest := len(v) - stride*callers; rest < 2 || (rest-2)%k != 0 { // the timeline's count and now, and the pushes
			return nil
		}
		for j := range out {
			r := v[j*stride : (j+1)*stride]
			w, _ := r[1].(int64)
			switch {
			case r[0] != int64(1):
				continue // refused
			case w == 0 && callers > 1:
				out[j] = atOnce
				continue
			}
			tk := takeGrant{granted: true, now: now}
			for i := range k {
				tat, okTat := r[2+i].(int64)
				limits := len(argv) - 2*k // the layers' rates and bursts (script.lua)
				rate, err1 := strconv.ParseFloat(fmt.Sprint(argv[limits+2*i]), 64)
				burst, err2 := strconv.ParseFloat(fmt.Sprint(argv[limits+2*i+1]), 64)
				if !okTat || err1 != nil || err2 != nil {
					return nil
				}
				full := time.Duration(math.Round(burst / rate * float64(time.Second)))
				if g := time.UnixMicro(tat).Add(-full); i == 0 || g.After(tk.due) {
					tk.due = g
				}
			}
			tk.wait, tk.waited = time.Duration(w)*time.Microsecond, true
			out[j] = tk
		}
		return out
	}
	return nil
}

// takeCall reads the command of a take, as script.lua lays out its
// ARGV: the layers it takes from, the callers it serves and its ARGV; ok
// is false for any other command.
func takeCall(cmd redis.Cmder) (k, callers int, argv []any, ok bool) {
	if n := cmd.Name(); n != "evalsha" && n != "eval" {
		return 0, 0, nil, false
	}
	args := cmd.Args() // evalsha, sha, numkeys, keys..., argv...
	if len(args) < 3 {
		return 0, 0, nil, false
	}
	numkeys, err := strconv.Atoi(fmt.Sprint(args[2]))
	k = numkeys - 1 // the layers; the control record's key comes last
	if err != nil || k < 1 || len(args) < 3+numkeys+4 || fmt.Sprint(args[3+numkeys]) != "take" {
		return 0, 0, nil, false
	}
	argv = args[3+numkeys:]
	stride := map[string]int{"plain": 1 + k, "class": 3 + k, "tenant": 6 + k}[fmt.Sprint(argv[2])]
	if stride == 0 || (len(argv)-4-2*k)%stride != 0 || len(argv)-4-2*k < stride {
		return 0, 0, nil, false
	}
	return k, (len(argv) - 4 - 2*k) / stride, argv, true
}

// takeReplies returns the reply of a take for each caller it served, in
// order, each as a take of its own would have it: the reply itself for a
// take of one caller; for a batch, each caller's part of the reply, or
// the integer 0 for each when the batch replied 0. It returns nil for any
// other command or reply.
func takeReplies(cmd *redis.Cmd) []any {
	k, callers, _, ok := takeCall(cmd)
	if !ok {
		return nil
	}
	out := make([]any, callers)
	switch v := cmd.Val().(type) {
	case int64:
		for i := range out {
			out[i] = v
		}
		return out
	case []any:
		stride := 2 + 2*k                                                 // and the positions
		if rest := len(v) - stride*callers; rest < 2 || (rest-2)%k != 0 { // the timeline's count and now, and the pushes
			return nil
		}
		for i := range out {
			out[i] = v[i*stride : (i+1)*stride]
		}
		return out
	}
	return nil
}

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

// hearing bounds how late a sleeper may learn of a change from its
// announcement, which a busy machine may deliver to a Limiter's subscriber
// 100 ms late: a sleeper due before it hears goes at its old instant.
const hearing = 250 * time.Millisecond

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

// fleetOf returns n Limiters, each with a client of its own, on srv.
func fleetOf(t *testing.T, srv *redistest.Server, n int, opts ...Option) []*Limiter {
	t.Helper()
	var ls []*Limiter
	for range n {
		rdb := srv.Client(t)
		rdb.AddHook(dueHook{})
		ls = append(ls, NewLimiter(rdb, opts...))
	}
	return ls
}

// arrivals runs goroutines on each Limiter that wait for lim's tokens of
// the bucket called name in a loop until stop. The function it returns
// waits for them and returns, sorted, when each acquisition returned and
// when the script granted it (dueHook, which fleetOf's clients carry).
// Windows that bound the limiter count the grants: a busy machine wakes
// callers late and bunches their returns, which the limiter cannot help.
func arrivals(t *testing.T, ls []*Limiter, goroutines int, name string, lim Limit, stop time.Time) func() (woke, due []time.Time) {
	var (
		mu    sync.Mutex
		woke  []time.Time
		due   []time.Time
		wg    sync.WaitGroup
		fails []error
	)
	for _, l := range ls {
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stop) {
					ctx, cancel := context.WithDeadline(context.Background(), stop.Add(5*time.Second))
					ctx, rec := withDueRecord(ctx)
					err := l.Wait(ctx, name, lim)
					cancel()
					mu.Lock()
					if err != nil {
						fails = append(fails, err)
						mu.Unlock()
						return
					}
					woke = append(woke, time.Now())
					due = append(due, rec.Due)
					mu.Unlock()
				}
			}()
		}
	}
	return func() ([]time.Time, []time.Time) {
		wg.Wait()
		if len(fails) > 0 {
			t.Fatalf("%d waits failed, the first: %v", len(fails), fails[0])
		}
		for _, d := range due {
			if d.IsZero() {
				t.Fatal("a grant without a due instant: a Limiter's client lacks dueHook")
			}
		}
		slices.SortFunc(woke, time.Time.Compare)
		slices.SortFunc(due, time.Time.Compare)
		return woke, due
	}
}

// between counts the times in [from, to).
func between(ts []time.Time, from, to time.Time) int {
	n := 0
	for _, t := range ts {
		if !t.Before(from) && t.Before(to) {
			n++
		}
	}
	return n
}

// lastRun returns the last of ts after from that ended a run of five
// within span: the end of a pace faster than four gaps in span. A run of
// gaps, not one, so that a late wake-up followed by a punctual one does
// not pass for the old pace.
func lastRun(ts []time.Time, from time.Time, span time.Duration) time.Time {
	var last time.Time
	for i := 4; i < len(ts); i++ {
		if ts[i].After(from) && ts[i].Sub(ts[i-4]) < span {
			last = ts[i]
		}
	}
	return last
}

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

func sleepUntil(at time.Time) { time.Sleep(time.Until(at)) }

// callerKey marks a Wait's context with the caller's number, for
// replyHook.
type callerKey struct{}

// replyHook calls seen with the caller's number, the time and the reply of
// every script call made for a caller whose context is marked with
// callerKey; a call that serves several callers' takes gives each its own
// part of the reply (see takeReplies).
type replyHook struct {
	seen func(caller int, at time.Time, reply any)
}

func (replyHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h replyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		c, ok := cmd.(*redis.Cmd)
		if err != nil || !ok {
			return err
		}
		at := time.Now()
		callers, _ := ctx.Value(store.CallersKey{}).([]context.Context)
		if callers == nil {
			if i, ok := ctx.Value(callerKey{}).(int); ok {
				h.seen(i, at, c.Val())
			}
			return err
		}
		replies := takeReplies(c)
		for j, cctx := range callers {
			if i, ok := cctx.Value(callerKey{}).(int); ok && len(replies) == len(callers) {
				h.seen(i, at, replies[j])
			}
		}
		return err
	}
}

func (replyHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// dueOf returns when a take's reply, received at at, grants its tokens,
// and false for a refusal or another reply.
func dueOf(at time.Time, reply any) (time.Time, bool) {
	switch v := reply.(type) {
	case int64:
		return at, v == 0
	case []any:
		if len(v) >= 2 && v[0] == int64(1) {
			wait, _ := v[1].(int64)
			return at.Add(time.Duration(wait) * time.Microsecond), true
		}
	}
	return time.Time{}, false
}

// histogram counts the instants ts in consecutive buckets of width w from
// from on.
func histogram(ts []time.Time, from time.Time, w time.Duration) []int {
	var h []int
	for _, at := range ts {
		i := int(at.Sub(from) / w)
		if i < 0 {
			continue
		}
		for len(h) <= i {
			h = append(h, 0)
		}
		h[i]++
	}
	return h
}
