package quota

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
	"go.opentelemetry.io/otel/attribute"
)

// Tests of acquisitions that share one script call (acquire.go; the batches
// themselves are internal/store's, and WithNoBatching turns them off),
// split from acquire_test.go: order, refusals, refunds, held calls, bounds
// and spans. The batch tests make batches deterministic: a hook holds the
// call in flight for a bucket while the test queues callers behind it one
// at a time, in a known order, and then lets it go; the next call serves
// them all. They run on real redis-server processes.

// holdHook holds the script calls that take tokens while the test says
// so, and counts them. Other calls (a control record's read, a refund)
// pass.
type holdHook struct {
	mu    sync.Mutex
	gate  chan struct{} // closed by release; nil: calls pass
	held  chan struct{} // told when a call is held
	takes atomic.Int64
}

// hold makes the next takes wait until release.
func (h *holdHook) hold() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.gate, h.held = make(chan struct{}), make(chan struct{}, 1)
}

func (h *holdHook) release() {
	h.mu.Lock()
	defer h.mu.Unlock()
	close(h.gate)
	h.gate = nil
}

func (h *holdHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *holdHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if scriptOp(cmd) != "take" {
			return next(ctx, cmd) // a control record's read, a refund
		}
		h.takes.Add(1)
		h.mu.Lock()
		gate, held := h.gate, h.held
		h.mu.Unlock()
		if gate != nil {
			select {
			case held <- struct{}{}:
			default:
			}
			<-gate
		}
		return next(ctx, cmd)
	}
}

func (h *holdHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// batchRig is a Limiter on a redis-server of its own, with a holdHook, a
// command counter and dueHook on its client.
type batchRig struct {
	t     *testing.T
	srv   *redistest.Server
	rdb   *redis.Client
	l     *Limiter
	hold  *holdHook
	cmds  *cmdCounter
	calls []*batchCall
}

func newBatchRig(t *testing.T, opts ...Option) *batchRig {
	t.Helper()
	srv := redistest.Start(t)
	rdb := srv.Client(t, func(o *redis.Options) { o.MaxRetries = -1 })
	r := &batchRig{t: t, srv: srv, rdb: rdb, hold: &holdHook{}, cmds: newCmdCounter()}
	rdb.AddHook(r.hold) // outermost: a held call has not been sent
	rdb.AddHook(r.cmds)
	rdb.AddHook(dueHook{})
	r.l = NewLimiter(rdb, opts...)
	// The script is on the server before the test: every call is EVALSHA.
	if err := r.l.Wait(context.Background(), "prime", unlimited); err != nil {
		t.Fatal(err)
	}
	r.cmds.reset()
	r.hold.takes.Store(0)
	return r
}

// batchCall is one caller of a batch test.
type batchCall struct {
	rec      *dueRecord
	cancel   context.CancelFunc
	err      chan error // its Wait's error, once it returns
	returned time.Time  // when it returned; read after err
}

// queued returns how many takes of the bucket called name wait behind its
// call in flight.
func (r *batchRig) queued(name string) int {
	key, _ := bucketKey(r.l.cfg.prefix, name)
	return r.l.store.Queued(key)
}

// start starts a caller of WaitN(name, n, lims...) whose context has a
// deadline d from now (none when d is 0), and returns once its take holds
// the bucket's call (the first caller, while the rig holds calls) or has
// queued behind it.
func (r *batchRig) start(name string, d time.Duration, n float64, lims ...Limit) *batchCall {
	r.t.Helper()
	ctx, rec := withDueRecord(context.Background())
	var cancel context.CancelFunc
	if d > 0 {
		ctx, cancel = context.WithTimeout(ctx, d)
	} else {
		ctx, cancel = context.WithCancel(ctx)
	}
	r.t.Cleanup(cancel)
	c := &batchCall{rec: rec, cancel: cancel, err: make(chan error, 1)}
	r.calls = append(r.calls, c)
	before := r.queued(name)
	first := len(r.calls) == 1
	go func() {
		err := r.l.WaitN(ctx, name, n, lims[0], lims[1:]...)
		c.returned = time.Now()
		c.err <- err
	}()
	if first {
		select {
		case <-r.hold.held:
		case <-time.After(10 * time.Second):
			r.t.Fatal("the first caller's take was not held")
		}
		return c
	}
	eventually(r.t, 10*time.Second, "the take to queue", func() bool { return r.queued(name) == before+1 })
	return c
}

// A batch in which one caller cannot be served before its deadline: that
// caller alone is refused, at once and taking nothing, and the others are
// granted in their order, the one after it in the refused caller's place.
// The refused caller's deadline allows the wait it would have had when it
// called, not once it has spent half a second queued: the deadline counts
// from the call, queueing included.
func TestBatchRefusesOnlyTheCallerPastItsDeadline(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	r := newBatchRig(t)
	lim := Limit{Rate: 1, Burst: 1}
	r.hold.hold()
	first := r.start("deadline", 10*time.Second, 1, lim) // the one token, at once
	a := r.start("deadline", 10*time.Second, 1, lim)     // 1 s
	b := r.start("deadline", 2300*time.Millisecond, 1, lim)
	c := r.start("deadline", 10*time.Second, 1, lim) // 2 s, b's place
	d := r.start("deadline", 10*time.Second, 1, lim) // 3 s
	time.Sleep(500 * time.Millisecond)               // b now has less than the 2 s it would need
	released := time.Now()
	r.hold.release()

	errB := <-b.err
	if !errors.Is(errB, ErrWouldExceedDeadline) || !errors.Is(errB, context.DeadlineExceeded) {
		t.Fatalf("the caller past its deadline: err = %v, want ErrWouldExceedDeadline", errB)
	}
	t.Logf("the caller past its deadline returned %v after the release: %v", b.returned.Sub(released), errB)
	if b.returned.Sub(released) > time.Second {
		t.Errorf("the refused caller returned %v after the release, want at once", b.returned.Sub(released))
	}
	for i, call := range []*batchCall{first, a, c, d} {
		if err := <-call.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	if !a.rec.Waited || !c.rec.Waited || !d.rec.Waited {
		t.Fatalf("the queued callers did not wait: %+v %+v %+v", a.rec, c.rec, d.rec)
	}
	near := func(got, want time.Duration) bool { return (got - want).Abs() <= 2*time.Microsecond }
	if ac, cd := c.rec.Due.Sub(a.rec.Due), d.rec.Due.Sub(c.rec.Due); !near(ac, time.Second) || !near(cd, time.Second) {
		t.Errorf("the granted callers fell due %v and %v apart, want one interval (1s) each: the refused one took nothing", ac, cd)
	}
	if a.rec.Sent != c.rec.Sent || c.rec.Sent != d.rec.Sent {
		t.Error("the queued callers were not served by one call")
	}
	if n := r.hold.takes.Load(); n != 2 {
		t.Errorf("%d take calls, want 2: the held one and the batch", n)
	}
}

// Callers queued behind a call are served in the order they queued: each
// falls due one interval after the one before it, in one call.
func TestBatchServesInArrivalOrder(t *testing.T) {
	r := newBatchRig(t)
	lim := Limit{Rate: 100, Burst: 1}
	r.hold.hold()
	r.start("order", 0, 1, lim)
	const callers = 20
	for range callers {
		r.start("order", 0, 1, lim)
	}
	r.hold.release()
	for i, c := range r.calls {
		if err := <-c.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	for i := 2; i < len(r.calls); i++ {
		prev, cur := r.calls[i-1].rec, r.calls[i].rec
		if gap := cur.Due.Sub(prev.Due); (gap - 10*time.Millisecond).Abs() > 2*time.Microsecond {
			t.Errorf("caller %d fell due %v after caller %d, want 10ms", i, gap, i-1)
		}
	}
	if n := r.hold.takes.Load(); n != 2 {
		t.Errorf("%d take calls for %d callers, want 2", n, callers+1)
	}
}

// A caller whose context ends while it is queued leaves the queue at once
// and is not sent: the call serves the others, and the caller after it
// takes its place.
func TestBatchCallerLeavesTheQueue(t *testing.T) {
	r := newBatchRig(t)
	lim := Limit{Rate: 10, Burst: 1}
	r.hold.hold()
	r.start("leave", 0, 1, lim)
	a := r.start("leave", 0, 1, lim)
	b := r.start("leave", 0, 1, lim)
	c := r.start("leave", 0, 1, lim)
	b.cancel()
	if err := <-b.err; !errors.Is(err, context.Canceled) {
		t.Fatalf("the cancelled caller: err = %v, want context.Canceled", err)
	}
	r.hold.release()
	for i, call := range []*batchCall{r.calls[0], a, c} {
		if err := <-call.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	if gap := c.rec.Due.Sub(a.rec.Due); (gap - 100*time.Millisecond).Abs() > 2*time.Microsecond {
		t.Errorf("the caller after the one that left fell due %v after the one before, want one interval (100ms)", gap)
	}
	if n := r.hold.takes.Load(); n != 2 {
		t.Errorf("%d take calls, want 2", n)
	}
}

// A caller of a batch whose context ends while it sleeps on its grant hands
// its tokens back as a caller of its own would: the last of the batch
// hands back its place; one with a caller queued behind it hands back
// nothing, since that place is promised.
func TestBatchRefundsOneCaller(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	r := newBatchRig(t)
	lim := Limit{Rate: 2, Burst: 1} // a token each 500 ms
	key, _ := bucketKey(DefaultPrefix, "refund")
	tat := func() time.Time {
		t.Helper()
		v, err := r.rdb.Get(context.Background(), key).Float64()
		if err != nil {
			t.Fatal(err)
		}
		return time.UnixMicro(int64(v))
	}
	full := 500 * time.Millisecond // a tat is a grant's due instant plus burst/rate
	r.hold.hold()
	r.start("refund", 0, 1, lim)
	a := r.start("refund", 0, 1, lim) // 0.5 s
	b := r.start("refund", 0, 1, lim) // 1 s
	c := r.start("refund", 0, 1, lim) // 1.5 s
	r.hold.release()
	<-c.rec.granted

	// b gives up: c stays queued behind it, and the bucket keeps c's place.
	calls := func() int { return r.cmds.landedOp("refund") } // answered: the bucket shows it
	refunds := calls()
	b.cancel()
	if err := <-b.err; !errors.Is(err, context.Canceled) {
		t.Fatalf("b: err = %v, want context.Canceled", err)
	}
	eventually(t, 5*time.Second, "b's refund", func() bool { return calls() == refunds+1 })
	if got, want := tat(), c.rec.Due.Add(full); (got.Sub(want)).Abs() > 2*time.Microsecond {
		t.Errorf("after the refund of a caller with one queued behind it the bucket is at %v, want c's tat %v", got, want)
	}

	// c, the last, gives up: its place goes back to the bucket.
	c.cancel()
	if err := <-c.err; !errors.Is(err, context.Canceled) {
		t.Fatalf("c: err = %v, want context.Canceled", err)
	}
	eventually(t, 5*time.Second, "c's refund", func() bool { return calls() == refunds+2 })
	if got, want := tat(), b.rec.Due.Add(full); (got.Sub(want)).Abs() > 2*time.Microsecond {
		t.Errorf("after the refund of the last caller the bucket is at %v, want b's tat %v", got, want)
	}
	if err := <-a.err; err != nil {
		t.Fatal(err)
	}
	if late := a.returned.Sub(a.rec.Due); late < 0 || late > maxJitter {
		t.Errorf("a woke %v after its grant fell due", late)
	}
}

// Weighted takes on a bucket of layers, through the Limiter: a batch of
// them waits exactly as the same takes one after another do.
func TestBatchWeightedLayers(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	clock := newStoppedClock()
	r := newBatchRig(t, WithClock(clock.Now))
	lims := []Limit{{Rate: 20, Burst: 3}, {Rate: 8, Burst: 6}}
	costs := []float64{3, 1, 3, 2, 1, 3, 2}
	r.hold.hold()
	for _, n := range costs {
		r.start("weighted", 0, n, lims...)
	}
	r.hold.release()
	for i, c := range r.calls {
		if err := <-c.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	alone, _ := newBucket(DefaultPrefix, "weighted-alone", lims)
	one := store.NewStore(r.rdb, store.Options{Clock: clock.Now}) // every take a call of its own
	for i, n := range costs {
		want, err := one.Take(context.Background(), alone.Bucket, store.Tokens(n), time.Hour)
		if err != nil {
			t.Fatal(err)
		}
		if got := r.calls[i].rec.Wait; got != want.Wait {
			t.Errorf("caller %d, %v tokens: waited %v in the batch, %v alone", i, n, got, want.Wait)
		}
	}
	if n := r.hold.takes.Load(); n != int64(2+len(costs)) {
		t.Errorf("%d take calls, want 2 and one a take alone (%d)", n, 2+len(costs))
	}
}

// Swarms of 50 and 200 goroutines in one process on 100/s: the grants due
// in any window stay within Burst + Rate x its length, counted on the
// server's grant instants, and the Redis commands number well under half
// the grants. Each caller asks again as its grant falls due, one interval
// (10 ms) after the one before: far longer than a round trip, so that
// without the hold most would find no call in flight and go alone (0.85
// commands per grant with 50 goroutines and 0.6 with 200, with store.MaxHold set
// to 0). The hold gathers the callers of the next 50 ms into one call.
func TestBatchSwarmsHoldTheBound(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	lim := Limit{Rate: 100, Burst: 10}
	for _, goroutines := range []int{50, 200} {
		t.Run(fmt.Sprint(goroutines), func(t *testing.T) {
			rdb := newServerClient(t)
			cmds := newCmdCounter()
			rdb.AddHook(cmds)
			l := NewLimiter(rdb)
			name := fmt.Sprintf("batch-swarm-%d", goroutines)
			warm(t, rdb, name, rdb.Options().PoolSize)
			cmds.reset()
			const d = 3 * time.Second
			grants, err := swarm(context.Background(), goroutines, time.Now(), d, func(ctx context.Context) error {
				return l.Wait(ctx, name, lim)
			})
			if err != nil {
				t.Fatal(err)
			}
			checkSwarm(t, grants, lim, d)
			n := cmds.total()
			perGrant := float64(n) / float64(len(grants))
			t.Logf("%d goroutines on %v, store.MaxHold %v: %d Redis commands for %d grants, %.3f per grant (%v)", goroutines, lim, store.MaxHold, n, len(grants), perGrant, cmds)
			if perGrant > 0.5 {
				t.Errorf("%.3f Redis commands per grant, want at most 0.5: callers of a queue share calls", perGrant)
			}
		})
	}
}

// contend makes the bucket called name, of lim, have a queue that ends
// one interval from now: a take at once, then one that waits, sleeping in
// the background. It returns the second take's call once the Limiter knows
// where the queue ends.
func (r *batchRig) contend(name string, lim Limit) *batchCall {
	r.t.Helper()
	if err := r.l.Wait(context.Background(), name, lim); err != nil {
		r.t.Fatal(err)
	}
	ctx, rec := withDueRecord(context.Background())
	c := &batchCall{rec: rec, err: make(chan error, 1)}
	go func() { c.err <- r.l.Wait(ctx, name, lim) }()
	key, _ := bucketKey(r.l.cfg.prefix, name)
	eventually(r.t, 10*time.Second, "the end of the queue to be known", func() bool {
		_, ok := r.horizon(key)
		return ok
	})
	return c
}

// horizon returns where the store knows the queue of the bucket under key
// to end.
func (r *batchRig) horizon(key string) (time.Time, bool) {
	return r.l.store.Horizon(key)
}

// held reports whether the call of the bucket called name is held.
func (r *batchRig) held(name string) bool {
	key, _ := bucketKey(r.l.cfg.prefix, name)
	return r.l.store.Held(key)
}

// setMaxHold sets store.MaxHold for the test.
func setMaxHold(t *testing.T, d time.Duration) {
	old := store.MaxHold
	store.MaxHold = d
	t.Cleanup(func() { store.MaxHold = old })
}

// A caller that finds no call in flight on a bucket with a queue holds its
// call, and the callers that arrive meanwhile go in it, in their order,
// each an interval after the one before: one call for three. The hold
// delays nobody: the held caller's grant falls due one interval after the
// end of the queue it found, as it would have sent at once.
func TestHeldCallersShareACall(t *testing.T) {
	redistest.Long(t)
	setMaxHold(t, 400*time.Millisecond)
	r := newBatchRig(t)
	lim := Limit{Rate: 2, Burst: 1} // a token each 500 ms
	before := r.contend("held", lim)
	takes := r.hold.takes.Load()

	start := func() *batchCall {
		ctx, rec := withDueRecord(context.Background())
		c := &batchCall{rec: rec, err: make(chan error, 1)}
		go func() { c.err <- r.l.Wait(ctx, "held", lim) }()
		return c
	}
	a := start()
	eventually(t, 10*time.Second, "the first caller to hold its call", func() bool { return r.held("held") })
	b := start()
	eventually(t, 10*time.Second, "the second caller to queue", func() bool { return r.queued("held") == 1 })
	c := start()
	eventually(t, 10*time.Second, "the third caller to queue", func() bool { return r.queued("held") == 2 })
	if !r.held("held") {
		t.Fatal("the call was sent before the callers queued: the test's timing does not hold")
	}
	for i, call := range []*batchCall{before, a, b, c} {
		if err := <-call.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	if n := r.hold.takes.Load() - takes; n != 1 {
		t.Errorf("%d take calls for three callers, want 1", n)
	}
	if a.rec.Sent != b.rec.Sent || b.rec.Sent != c.rec.Sent {
		t.Error("the held caller and the ones after it were not served by one call")
	}
	for i, pair := range [][2]*batchCall{{before, a}, {a, b}, {b, c}} {
		if gap := pair[1].rec.Due.Sub(pair[0].rec.Due); (gap - 500*time.Millisecond).Abs() > 2*time.Microsecond {
			t.Errorf("grant %d fell due %v after the one before, want one interval (500ms)", i+1, gap)
		}
	}
}

// A caller that cannot wait for the queue of a bucket whose call is held
// does not wait for the hold either: it is refused at once.
func TestHeldCallRefusesAtOnce(t *testing.T) {
	setMaxHold(t, 2*time.Second)
	r := newBatchRig(t)
	lim := Limit{Rate: 1, Burst: 1}
	r.contend("refuse", lim)
	go func() { _ = r.l.Wait(context.Background(), "refuse", lim) }()
	eventually(t, 10*time.Second, "a caller to hold its call", func() bool { return r.held("refuse") })
	began := time.Now()
	ok, err := r.l.Allow(context.Background(), "refuse", lim)
	if ok || err != nil {
		t.Fatalf("Allow on a queue: %v, %v; want false, nil", ok, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := r.l.Wait(ctx, "refuse", lim); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Fatalf("a caller whose deadline comes before the queue ends: %v, want ErrWouldExceedDeadline", err)
	}
	if d := time.Since(began); d > time.Second {
		t.Errorf("the callers that cannot wait were refused after %v, want at once, not after the hold", d)
	}
}

// A pause recorded while a call is held stops it: its callers wait for
// the pause to end, as callers that came during the pause do, instead of
// taking tokens behind it.
func TestHeldCallWaitsForAPause(t *testing.T) {
	redistest.Long(t)
	setMaxHold(t, 400*time.Millisecond)
	r := newBatchRig(t)
	lim := Limit{Rate: 2, Burst: 1}
	r.contend("paused", lim)
	ctx, rec := withDueRecord(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- r.l.Wait(ctx, "paused", lim) }()
	eventually(t, 10*time.Second, "a caller to hold its call", func() bool { return r.held("paused") })
	const pause = 1500 * time.Millisecond
	if err := NewLimiter(r.rdb).Pause(context.Background(), "paused", pause); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	if woke := time.Since(paused); woke < pause-50*time.Millisecond {
		t.Errorf("the held caller was granted %v after a pause of %v", woke, pause)
	}
	// The call went during the pause, and the script queued it behind.
	if rec.Due.Before(paused.Add(pause - 50*time.Millisecond)) {
		t.Errorf("the held caller's grant fell due %v after the pause began, want after its end (%v)", rec.Due.Sub(paused), pause)
	}
}

// A bucket that never makes anyone wait has no queue to hold for: however
// long store.MaxHold, callers go at once, and the store keeps nothing for it.
func TestNeverHeld(t *testing.T) {
	setMaxHold(t, 2*time.Second)
	r := newBatchRig(t)
	const goroutines, each = 8, 100
	lat := make([]time.Duration, 0, goroutines*each)
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range goroutines {
		wg.Go(func() {
			for range each {
				began := time.Now()
				if err := r.l.Wait(context.Background(), "never", unlimited); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				lat = append(lat, time.Since(began))
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	slices.Sort(lat)
	t.Logf("%d waits: p50 %v, p99 %v, max %v (store.MaxHold %v)", len(lat), lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1], store.MaxHold)
	if lat[len(lat)-1] >= store.MaxHold/2 {
		t.Errorf("a wait took %v on a bucket that never makes anyone wait: held", lat[len(lat)-1])
	}
	if n := r.l.store.Horizons(); n != 0 {
		t.Errorf("the store keeps the ends of %d queues, want none", n)
	}
}

// The ends of queues a store keeps are bounded however many names it
// sees, the newest kept.
func TestHorizonsAreBounded(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	l := NewLimiter(rdb)
	lim := Limit{Rate: 0.001, Burst: 1} // the second take waits 1000 s
	ctx := context.Background()
	names := store.MaxHorizons + 300
	var last bucket
	for i := range names {
		b, err := l.bucket(fmt.Sprint("many-", i), []Limit{lim})
		if err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if _, err := l.store.Take(ctx, b.Bucket, store.Tokens(1), time.Hour); err != nil {
				t.Fatal(err)
			}
		}
		last = b
	}
	n := l.store.Horizons()
	t.Logf("%d buckets with a queue: the store keeps %d ends (bound %d)", names, n, store.MaxHorizons)
	if n > store.MaxHorizons {
		t.Errorf("the store keeps %d ends of queues, bound %d", n, store.MaxHorizons)
	}
	if _, ok := l.store.Horizon(last.Keys[0]); !ok {
		t.Error("the newest end of a queue was not kept")
	}
}

// A call that finds Redis unavailable fails the takes queued behind it
// too, without sending them: each goes to the policy at once rather than
// waiting for a timeout of its own.
func TestBatchSharesAnOutage(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	r := newBatchRig(t, WithLogger(discardLogger()))
	lim := Limit{Rate: 10, Burst: 1}
	r.hold.hold()
	for range 4 {
		r.start("outage", 0, 1, lim)
	}
	r.srv.Kill()
	r.hold.release()
	for i, c := range r.calls {
		if err := <-c.err; !errors.Is(err, ErrUnavailable) {
			t.Errorf("caller %d: err = %v, want ErrUnavailable", i, err)
		}
	}
	if n := r.hold.takes.Load(); n != 1 {
		t.Errorf("%d take calls, want the held one alone", n)
	}
}

// A call serves at most store.MaxBatch takes; the rest go in the call after.
func TestBatchIsBounded(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	r := newBatchRig(t)
	r.hold.hold()
	callers := store.MaxBatch + 44
	for range 1 + callers {
		r.start("bounded", 0, 1, unlimited)
	}
	r.hold.release()
	for i, c := range r.calls {
		if err := <-c.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	if n := r.hold.takes.Load(); n != 3 {
		t.Errorf("%d take calls for %d callers behind a held one, want 2 (%d and %d)", n, callers, store.MaxBatch, callers-store.MaxBatch)
	}
}

// Every caller of a batch has a wait span of its own, with the size of
// the batch its take went in and the one round trip it shared; the call
// runs in the first caller's span.
func TestBatchSpans(t *testing.T) {
	tel := newTelemetry(t)
	r := newBatchRig(t, tel.options()...)
	lim := Limit{Rate: 1000, Burst: 1}
	// The bucket's control record is read before: the takes are the
	// spans' only round trips.
	if _, _, err := r.l.controls.Entry(context.Background(), mustBucket(t, "spans", lim).Bucket, control.Limit(lim), true); err != nil {
		t.Fatal(err)
	}
	r.hold.hold()
	for range 4 {
		r.start("spans", 0, 1, lim)
	}
	r.hold.release()
	for i, c := range r.calls {
		if err := <-c.err; err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	spans := tel.waitSpans()[1:] // after the rig's first Wait
	if len(spans) != 4 {
		t.Fatalf("%d wait spans, want 4", len(spans))
	}
	sizes := map[int64]int{}
	for _, s := range spans {
		a := attrs(s)
		sizes[a["quota.batch.size"].AsInt64()]++
		if a["quota.redis.round_trips"] != attribute.IntValue(1) || a["quota.outcome"] != attribute.StringValue("granted") {
			t.Errorf("span %v: round trips %v, outcome %v; want 1 and granted", s.SpanContext().SpanID(), a["quota.redis.round_trips"].String(), a["quota.outcome"].String())
		}
	}
	if sizes[1] != 1 || sizes[3] != 3 {
		t.Errorf("quota.batch.size over the spans: %v, want one span of 1 (the held call) and three of 3", sizes)
	}
}

// mustBucket returns the bucket called name with layers lims.
func mustBucket(t *testing.T, name string, lims ...Limit) bucket {
	t.Helper()
	b, err := newBucket(DefaultPrefix, name, lims)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
