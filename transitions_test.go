package quota

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

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
	rdb.AddHook(replyHook{seen: func(i int, at time.Time, reply any) {
		mu.Lock()
		defer mu.Unlock()
		due[i], _ = dueOf(at, reply)
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
	time.Sleep(100 * time.Millisecond)
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
	// The queue resumes at the bucket's rate: in the first half second after
	// the pause, at most one token and the half second's refill (and a
	// little jitter), not the 15 callers at once.
	if n := maxInWindow(after, 500*time.Millisecond); n > 1+int(lim.Rate/2)+3 {
		t.Errorf("%d requests in a half second after the pause, want the bucket's rate", n)
	}
	if len(after) < int(lim.Rate) {
		t.Errorf("%d requests after the pause, want the traffic to resume", len(after))
	}
}

// transition is a change in Redis during a run, and when it happened.
type transition struct {
	what string
	at   time.Time
}

// TestTransitionsAcrossProcesses: 4 worker processes on FallbackLocal(4)
// send through Transports while Redis is killed and restarted empty, hung
// with SIGSTOP and let go, and killed, restarted and killed again before
// the fleet has resumed. In any window of 1 s or 2 s, the seconds around
// every transition included, the provider sees at most Burst + Rate x W
// plus the local shares' bursts, and a jitter allowance of a tenth of a
// second's rate for the callers' wake-ups on two busy cores.
func TestTransitionsAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		lim        Limit
		goroutines int
	}{
		{Limit{Rate: 100, Burst: 10}, 20},
		{Limit{Rate: 10, Burst: 4}, 5},
	} {
		t.Run(tc.lim.String(), func(t *testing.T) {
			t.Parallel()
			const procs = 4
			srv := redistest.Start(t)
			prov := newProvider(t)
			w := startWorkers(t, procs, workerSpec{Addr: srv.Addr(), Key: "transitions", URL: prov.URL, Limit: tc.lim,
				Goroutines: tc.goroutines, Duration: 14 * time.Second, Fallback: procs, Faults: true})
			var events []transition
			at := func(offset time.Duration, what string, do func()) {
				time.Sleep(time.Until(w.start.Add(offset)))
				do()
				events = append(events, transition{what, time.Now()})
			}
			at(2*time.Second, "killed", srv.Kill)
			at(4*time.Second, "restarted empty", srv.Restart)
			at(6*time.Second, "hung (SIGSTOP)", srv.Pause)
			at(7500*time.Millisecond, "let go (SIGCONT)", srv.Resume)
			at(9500*time.Millisecond, "killed", srv.Kill)
			at(10200*time.Millisecond, "restarted empty", srv.Restart)
			at(10900*time.Millisecond, "killed before the fleet resumed", srv.Kill)
			at(11900*time.Millisecond, "restarted empty", srv.Restart)
			w.wait(t)

			arrivals := prov.between(w.start, w.start.Add(w.spec.Duration))
			localBursts := procs * int(math.Max(1, math.Floor(tc.lim.Burst/procs)))
			jitter := int(math.Ceil(tc.lim.Rate/10)) + 1
			for _, win := range []time.Duration{time.Second, 2 * time.Second} {
				limit := bound(tc.lim, win) + localBursts + jitter
				got := maxInWindow(arrivals, win)
				t.Logf("%d requests; at most %d in any %v window (bound %d: Burst + Rate x W %d, local bursts %d, jitter %d)",
					len(arrivals), got, win, limit, bound(tc.lim, win), localBursts, jitter)
				if got > limit {
					t.Errorf("%d requests in a %v window, bound %d; per 100ms: %v", got, win, limit, histogram(arrivals, w.start, 100*time.Millisecond))
				}
			}
			for _, e := range events {
				near := prov.between(e.at.Add(-1500*time.Millisecond), e.at.Add(1500*time.Millisecond))
				t.Logf("%5.1fs  %-32s  busiest 1s window around it: %d", e.at.Sub(w.start).Seconds(), e.what, maxInWindow(near, time.Second))
			}
			// The fleet kept moving: at least 80% of the rate over the run.
			if want := int(0.8 * tc.lim.Rate * w.spec.Duration.Seconds()); len(arrivals) < want {
				t.Errorf("%d requests in %v, want at least %d", len(arrivals), w.spec.Duration, want)
			}
		})
	}
}

// TestFleetResumesTogether: four workers find Redis again at instants
// 150 ms apart, as workers whose probes back off out of step do. They
// leave their local shares together, so no worker draws on the shared
// bucket while another still spends its share: the second around the
// recovery holds the rate, not the rate and the shares still in use.
func TestFleetResumesTogether(t *testing.T) {
	redistest.Long(t)
	got, limit, spread := staggeredRecovery(t, true)
	if spread > 100*time.Millisecond {
		t.Errorf("the workers resumed %v apart, want together", spread)
	}
	if got > limit {
		t.Errorf("%d requests in a 1s window around the recovery, bound %d", got, limit)
	}
}

// TestFleetResumesTogetherCatchesWorkerByWorker is the negative control:
// workers that resume each on its own, as soon as each finds Redis,
// without settling the shared bucket, break the bound of the test above.
func TestFleetResumesTogetherCatchesWorkerByWorker(t *testing.T) {
	redistest.Long(t)
	t.Parallel() // a bound broken alone is broken beside the others too
	got, limit, _ := staggeredRecovery(t, false)
	if got <= limit {
		t.Errorf("workers resuming one by one stayed within the bound: %d in a 1s window, bound %d", got, limit)
	}
}

// staggeredRecovery runs four workers at 100/s into an outage that ends
// for one after the other, 150 ms apart, and returns the busiest 1s window
// at the provider around the recovery, its bound (Burst + Rate, the local
// shares' bursts, a jitter allowance) and how far apart the workers
// resumed. together false resumes each worker on its own.
func staggeredRecovery(t *testing.T, together bool) (got, limit int, spread time.Duration) {
	srv := redistest.Start(t)
	prov := newProvider(t)
	lim := Limit{Rate: 100, Burst: 10}
	const workers = 4
	var proxies []*faultproxy.Proxy
	ws := newWorkersOn(t, workers, lim, FallbackLocal(workers), func() redis.Scripter {
		p := faultproxy.New(t, srv.Addr())
		proxies = append(proxies, p)
		rdb := redis.NewClient(faultOptions(p.Addr()))
		t.Cleanup(func() { rdb.Close() })
		return rdb
	})
	if !together {
		for _, w := range ws {
			w.tr.limiter.handOver = false
		}
	}
	stop := make(chan struct{})
	done := make(chan []result)
	go func() { done <- drive(ws, 20, prov.URL, stop) }()

	time.Sleep(1500 * time.Millisecond)
	for _, p := range proxies { // Redis is gone for every worker
		p.Refuse(true)
		p.ResetAll()
	}
	time.Sleep(1500 * time.Millisecond)
	healed := time.Now()
	for _, p := range proxies { // and back for one after the other
		p.Refuse(false)
		time.Sleep(150 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)
	close(stop)
	<-done

	var back []time.Time
	for i, w := range ws {
		r, ok := w.logs.Last("available again")
		if !ok {
			t.Fatalf("worker %d never found Redis again:\n%s", i, w.logs)
		}
		back = append(back, r.Time)
		t.Logf("worker %d: shared again %v after the first worker could reach Redis", i, r.Time.Sub(healed).Round(time.Millisecond))
	}
	spread = slices.MaxFunc(back, time.Time.Compare).Sub(slices.MinFunc(back, time.Time.Compare))
	around := prov.between(healed.Add(-time.Second), healed.Add(2*time.Second))
	got = maxInWindow(around, time.Second)
	limit = bound(lim, time.Second) + workers*2 + int(lim.Rate/10) + 1 // local bursts, jitter
	t.Logf("the workers resumed within %v of each other; busiest 1s window around the recovery %d (bound %d); per 100ms from 1s before: %v",
		spread.Round(time.Millisecond), got, limit, histogram(around, healed.Add(-time.Second), 100*time.Millisecond))
	return got, limit, spread
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
	bk, err := a.controlled(ctx, &waitSpan{}, bk) // as an acquisition does
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
	if _, err := a.sleepOn(ctx, bk, g, store.Tokens(1)); err != nil {
		t.Fatal(err)
	}
	slept := time.Since(taken)
	t.Logf("a grant due in %v, taken before a pause of %v that came before anyone listened, fell due after %v", g.Wait, pause, slept)
	if slept < g.Wait+pause-5*time.Millisecond {
		t.Errorf("the grant fell due after %v, want after its wait and the pause, %v", slept, g.Wait+pause)
	}
}
