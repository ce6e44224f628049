package quota

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of concurrency slots as callers acquire them (concurrency.go):
// AcquireSlot and WithConcurrency, waiting in order without polling, the
// hand-off of a released slot to the next waiter, in one process and across
// processes, and the tokens a waiter takes with its slot. Slots through
// outages and restarts are in concurrency_outage_test.go; a held slot's
// release, linger and lease in slots_test.go.

func TestAcquireSlotServesInOrder(t *testing.T) {
	rdb := newServerClient(t)
	other := redis.NewClient(&redis.Options{Addr: rdb.Options().Addr})
	t.Cleanup(func() { other.Close() })
	// Two Limiters stand for two processes: the queue is the fleet's.
	ls := []*Limiter{NewLimiter(rdb), NewLimiter(other)}
	ctx := context.Background()
	// A name with spaces: the announcements of hand-offs still name it.
	const name = "an ordered queue"
	first, err := ls[0].AcquireSlot(ctx, name, 1)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 12
	var mu sync.Mutex
	var order []int
	var wg sync.WaitGroup
	for i := range waiters {
		wg.Go(func() {
			s, err := ls[i%2].AcquireSlot(ctx, name, 1)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			s.Release()
		})
		// The next waiter comes once this one is queued.
		eventually(t, 5*time.Second, "the waiter queued", func() bool {
			_, w := slotsHeld(t, rdb, name)
			return w == int64(i+1)
		})
	}
	released := time.Now()
	first.Release()
	wg.Wait()
	// Each hand-off is announced: without the announcement, a waiter
	// would learn of its slot at its next renewal, a quarter lease later.
	if took := time.Since(released); took > 2*time.Second {
		t.Errorf("%d hand-offs took %v: not announced", waiters, took)
	}
	for i, got := range order {
		if got != i {
			t.Fatalf("served in the order %v, want the order of arrival", order)
		}
	}
	if len(order) != waiters {
		t.Fatalf("%d of %d waiters served", len(order), waiters)
	}
}

func TestAcquireSlotHonoursTheDeadline(t *testing.T) {
	rdb := newServerClient(t)
	l := NewLimiter(rdb)
	held, err := l.AcquireSlot(context.Background(), "deadline", 1)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = l.AcquireSlot(ctx, "deadline", 1)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("AcquireSlot past its deadline: %v, want DeadlineExceeded", err)
	}
	if waited := time.Since(start); waited < 150*time.Millisecond {
		t.Errorf("gave up after %v, before the deadline", waited)
	}
	eventually(t, 5*time.Second, "the waiter left the queue", func() bool {
		h, w := slotsHeld(t, rdb, "deadline")
		return h == 1 && w == 0
	})
}

func TestAcquireSlotInvalid(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	for _, n := range []int{0, -1} {
		if _, err := l.AcquireSlot(context.Background(), "x", n); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("AcquireSlot(n=%d): %v, want ErrInvalidLimit", n, err)
		}
	}
	if _, err := l.AcquireSlot(context.Background(), "", 1); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("AcquireSlot of an empty name: %v, want ErrInvalidKey", err)
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid input sent %d Redis commands", n)
	}
}

// TestWaitersDoNotPoll: callers waiting for a slot send nothing while
// they wait, however many; a release wakes the next.
func TestWaitersDoNotPoll(t *testing.T) {
	redistest.Long(t)
	rdb := newServerClient(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	l := NewLimiter(rdb)
	ctx := context.Background()
	held, err := l.AcquireSlot(ctx, "idle", 1)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 30
	got := make(chan *Slot, waiters)
	for range waiters {
		go func() {
			s, err := l.AcquireSlot(ctx, "idle", 1)
			if err != nil {
				t.Error(err)
			}
			got <- s
		}()
	}
	eventually(t, 5*time.Second, "every caller queued", func() bool {
		_, w := slotsHeld(t, rdb, "idle")
		return w == waiters
	})
	cmds.reset()
	time.Sleep(2 * time.Second)
	if n := cmds.total(); n > 2 {
		t.Errorf("%d waiters sent %d commands in 2s of waiting (%v), want at most 2 renewals", waiters, n, cmds)
	}
	held.Release()
	for range waiters {
		select {
		case s := <-got:
			s.Release()
		case <-time.After(10 * time.Second):
			t.Fatal("a release did not wake the next waiter")
		}
	}
}

func TestTransportConcurrencyInProcess(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	p := &inFlight{latency: 20 * time.Millisecond}
	srv := httptest.NewServer(p)
	defer srv.Close()
	client := &http.Client{Transport: NewTransport(rdb, fastLimit, WithConcurrency(3))}
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			for range 5 {
				resp, err := client.Get(srv.URL)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	if peak := p.peak.Load(); peak != 3 {
		t.Errorf("at most %d requests in flight, want 3", peak)
	}
	eventually(t, 5*time.Second, "every slot released", func() bool {
		h, w := slotsHeld(t, rdb, strings.TrimPrefix(srv.URL, "http://"))
		return h == 0 && w == 0
	})
}

// TestConcurrencyAcrossProcesses: 4 processes x 30 goroutines send through
// Transports with WithConcurrency(8) to a provider that takes 200 ms a
// request: it never sees more than 8 in flight, and serves close to
// 8 / 200 ms, since a release hands its slot on at once.
func TestConcurrencyAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	const slots, latency = 8, 200 * time.Millisecond
	p := &inFlight{latency: latency}
	provider := httptest.NewServer(p)
	defer provider.Close()
	spec := workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(provider.URL, "http://"), Limit: fastLimit, Goroutines: 30,
		Duration: 6 * time.Second, URL: provider.URL, Concurrency: slots}
	w := startWorkers(t, 4, spec)
	var cmds int64
	ops := map[string]int{}
	for _, r := range w.wait(t) {
		cmds += r.Commands
		for op, n := range r.Ops {
			ops[op] += n
		}
	}
	from, to := w.start.Add(time.Second), w.start.Add(spec.Duration-500*time.Millisecond)
	got := float64(p.arrivedIn(from, to)) / to.Sub(from).Seconds()
	want := slots / latency.Seconds()
	t.Logf("peak %d in flight (limit %d); %.1f requests/s in the steady window, %.3f of %v / %v; %d requests in all, %.2f Redis commands a request",
		p.peak.Load(), slots, got, got/want, slots, latency, p.total.Load(), float64(cmds)/float64(p.total.Load()))
	calls := 0
	for op, n := range ops {
		if op != "read" { // the control record's, apart (see cmdCounter.total)
			calls += n
		}
	}
	perRequest := float64(calls) / float64(p.total.Load())
	t.Logf("%.2f script calls a request, by operation: %v", perRequest, ops)
	// A request takes its slot and its tokens in one call, and its release
	// rides on its process's next one: 1.14 measured without the race
	// detector (scripts/slot-figures.sh), 1.16 to 1.31 under it, where a
	// goroutine slowed past a millisecond sends its release alone.
	bound := 1.3
	if raceDetector {
		bound = 1.5
	}
	if perRequest > bound {
		t.Errorf("%.2f script calls a request, want at most %v", perRequest, bound)
	}
	if peak := p.peak.Load(); peak > slots {
		t.Errorf("the provider saw %d requests in flight, limit %d", peak, slots)
	}
	// Hand-offs cost a few script calls each, and this machine runs four
	// processes and Redis on two cores under the race detector: 0.85 holds
	// with margin (0.93 to 0.98 measured). Without the announced hand-off a
	// waiter would learn of a free slot only at its next renewal, a quarter
	// lease later, and the fleet would serve a fraction of this.
	if got < 0.85*want {
		t.Errorf("%.1f requests/s, want at least 0.85 of %.0f: slots idle between requests", got, want)
	}
}

// handOffs is a provider for a fleet that holds one slot: it remembers
// when each request arrived and left, and from which worker process.
type handOffs struct {
	latency time.Duration
	began   atomic.Int32 // requests that arrived, counted as they arrive

	mu   sync.Mutex
	reqs []handOff
}

type handOff struct {
	arrived, left time.Time
	worker        string
}

func (p *handOffs) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
	p.began.Add(1)
	time.Sleep(p.latency)
	p.mu.Lock()
	p.reqs = append(p.reqs, handOff{arrived, time.Now(), r.Header.Get(workerHeader)})
	p.mu.Unlock()
	io.WriteString(w, "ok")
}

// gaps returns, sorted, how long after a request left the next one arrived
// when the next came from another process, for the requests that arrived
// between from and to; and how many arrived before the one before them
// left, which one slot forbids.
func (p *handOffs) gaps(from, to time.Time) (gaps []time.Duration, overlaps int) {
	p.mu.Lock()
	reqs := slices.Clone(p.reqs)
	p.mu.Unlock()
	slices.SortFunc(reqs, func(a, b handOff) int { return a.arrived.Compare(b.arrived) })
	for i := 1; i < len(reqs); i++ {
		prev, r := reqs[i-1], reqs[i]
		if r.arrived.Before(prev.left) {
			overlaps++
		}
		if r.arrived.After(from) && r.arrived.Before(to) && r.worker != prev.worker {
			gaps = append(gaps, r.arrived.Sub(prev.left))
		}
	}
	slices.Sort(gaps)
	return gaps, overlaps
}

// TestSlotHandOffAcrossProcesses: a released slot reaches a waiter in
// another process within a few milliseconds, whether the release rides on
// its process's next call (the goroutine asks again at once) or goes alone
// (nothing follows it within slots.ReleaseDelay). Four processes share one
// slot against a provider that holds each request 10 ms; the figure is the
// time from one request's end at the provider to the next one's arrival
// from another process, which includes the response, the release, the
// hand-off and the request. The control makes a lone release wait 30 ms
// for a call to ride on: the measure sees it.
func TestSlotHandOffAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	const run = 2 * time.Second
	measure := func(name string, goroutines int, think, delay time.Duration) time.Duration {
		t.Helper()
		p := &handOffs{latency: 10 * time.Millisecond}
		provider := httptest.NewServer(p)
		defer provider.Close()
		spec := workerSpec{Addr: srv.Addr(), Key: name, Limit: fastLimit, Goroutines: goroutines, Duration: run,
			URL: provider.URL + "/" + name, Concurrency: 1, Think: think, ReleaseDelay: delay}
		w := startWorkers(t, 4, spec)
		w.wait(t)
		gaps, overlaps := p.gaps(w.start.Add(300*time.Millisecond), w.start.Add(run-200*time.Millisecond))
		if overlaps > 0 {
			t.Errorf("%s: %d requests overlapped the one before, with one slot", name, overlaps)
		}
		if len(gaps) < 20 {
			t.Fatalf("%s: %d hand-offs across processes, too few to measure", name, len(gaps))
		}
		p50, p90 := gaps[len(gaps)/2], gaps[len(gaps)*9/10]
		t.Logf("%s: %d hand-offs across processes, from a request's end to the next one's arrival p50 %v, p90 %v",
			name, len(gaps), p50.Round(10*time.Microsecond), p90.Round(10*time.Microsecond))
		return p50
	}
	// The target is 5 ms, which scripts/slot-figures.sh measures
	// without the race detector (2 to 3 ms). Under it, the workers run
	// slowed several times: 2.4 to 3.5 ms in most runs, 4.1 and 6.3 in a
	// fresh-clone run on a loaded machine.
	bound := 5 * time.Millisecond
	if raceDetector {
		bound = 10 * time.Millisecond
	}
	if p50 := measure("riding", 2, 0, 0); p50 > bound {
		t.Errorf("releases riding on the next call: hand-off p50 %v, want under %v", p50, bound)
	}
	if p50 := measure("alone", 1, 20*time.Millisecond, 0); p50 > bound {
		t.Errorf("releases sent alone: hand-off p50 %v, want under %v", p50, bound)
	}
	if p50 := measure("control", 1, 20*time.Millisecond, 30*time.Millisecond); p50 < 15*time.Millisecond {
		t.Errorf("control, a lone release waiting 30ms: hand-off p50 %v, want over 15ms: the measure misses a delayed release", p50)
	}
}

// TestFlushSendsTheReleasesBeforeExit: a process that calls Flush before
// it exits leaves no slot held in Redis; one that does not leaves the
// releases still waiting for a call to ride on, whose slots stay held for
// their leases. Releases wait 2 s here, so that the control cannot send
// them in time by chance.
func TestFlushSendsTheReleasesBeforeExit(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	for _, flush := range []bool{true, false} {
		provider := httptest.NewServer(&handOffs{latency: 5 * time.Millisecond})
		defer provider.Close()
		name := provider.Listener.Addr().String() // the Transport's bucket
		spec := workerSpec{Addr: srv.Addr(), Key: name, Limit: fastLimit, Goroutines: 4, Duration: 300 * time.Millisecond,
			URL: provider.URL, Concurrency: 4, ReleaseDelay: 2 * time.Second, NoFlush: !flush}
		reps := startWorkers(t, 1, spec).wait(t)
		if len(reps[0].Grants) < 4 {
			t.Fatalf("flush %v: %d requests, too few", flush, len(reps[0].Grants))
		}
		held, _ := slotsHeld(t, rdb, name)
		t.Logf("flush %v: %d requests, %d slots held in Redis after the process exited", flush, len(reps[0].Grants), held)
		switch {
		case flush && held != 0:
			t.Errorf("with Flush: %d slots held after the process exited, want 0", held)
		case !flush && held == 0:
			t.Errorf("control, without Flush: no slot held after the process exited: the test cannot tell a lost release")
		}
	}
}

// TestHandOffTakesTheWaitersTokens: a caller that waits for a slot makes
// one script call in all: the release that hands it its slot takes its
// tokens, under the bucket's rate and any pause in force at the hand-off.
// Two Limiters on clients of their own share a bucket of 5/s, burst 1, and
// one slot; the provider holds each request 300 ms. A sends first; B asks
// 50 ms later and queues. Without a pause, B's request goes as A's ends;
// with an operator's pause of 700 ms set 100 ms in, while B waits, B's
// request goes when the pause ends, though its slot was handed inside it.
func TestHandOffTakesTheWaitersTokens(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	for _, pause := range []time.Duration{0, 700 * time.Millisecond} {
		p := &handOffs{latency: 300 * time.Millisecond}
		provider := httptest.NewServer(p)
		defer provider.Close() // open to the end: the next provider's port, which names its bucket, is another
		name := provider.Listener.Addr().String()
		lim := Limit{Rate: 5, Burst: 1}
		clientFor := func(worker string) (*http.Client, *cmdCounter) {
			rdb := srv.Client(t)
			cmds := newCmdCounter()
			rdb.AddHook(cmds)
			base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
				r.Header.Set(workerHeader, worker)
				return http.DefaultTransport.RoundTrip(r)
			})
			return &http.Client{Transport: NewTransport(rdb, lim, WithConcurrency(1), WithBase(base))}, cmds
		}
		a, _ := clientFor("a")
		b, bCmds := clientFor("b")
		get := func(c *http.Client) {
			resp, err := c.Get(provider.URL)
			if err != nil {
				t.Error(err)
				return
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		start := time.Now()
		var wg sync.WaitGroup
		wg.Go(func() { get(a) })
		// B asks once A holds the slot: its request is at the provider,
		// however late a loaded machine ran A.
		for p.began.Load() == 0 && time.Since(start) < 5*time.Second {
			time.Sleep(5 * time.Millisecond)
		}
		start = time.Now()
		wg.Go(func() { get(b) })
		var pausedAt time.Time
		if pause > 0 {
			time.Sleep(time.Until(start.Add(50 * time.Millisecond)))
			pausedAt = time.Now()
			if err := NewLimiter(srv.Client(t)).Pause(context.Background(), name, pause); err != nil {
				t.Fatal(err)
			}
		}
		wg.Wait()
		var aLeft, bArrived time.Time
		for _, r := range p.reqs {
			switch r.worker {
			case "a":
				aLeft = r.left
			case "b":
				bArrived = r.arrived
			}
		}
		ops := bCmds.byOp()
		t.Logf("pause %v: B arrived %v after A left, %v after the start; B's script calls %v",
			pause, bArrived.Sub(aLeft).Round(time.Millisecond), bArrived.Sub(start).Round(time.Millisecond), ops)
		if len(p.reqs) != 2 {
			t.Fatalf("pause %v: %d requests reached the provider, want 2", pause, len(p.reqs))
		}
		if bArrived.Before(aLeft) {
			t.Errorf("pause %v: B arrived %v before A left, with one slot", pause, aLeft.Sub(bArrived))
		}
		if ops["acquire"] != 1 || ops["take"] != 0 {
			t.Errorf("pause %v: B's script calls %v, want one acquire and no take of its own", pause, ops)
		}
		if pause == 0 && bArrived.Sub(aLeft) > 100*time.Millisecond {
			t.Errorf("B arrived %v after A left, want at once", bArrived.Sub(aLeft))
		}
		// The pause began once the Pause call was made, at the earliest.
		if ends := pausedAt.Add(pause); pause > 0 && bArrived.Before(ends.Add(-30*time.Millisecond)) {
			t.Errorf("B arrived %v before the pause ended", ends.Sub(bArrived))
		}
	}
}

// TestSlotWaitersKeepTheRate: callers that wait for a concurrency slot
// take their tokens once they hold it, so that what reaches the provider
// keeps to the rate, and nothing reaches it inside a pause.
func TestSlotWaitersKeepTheRate(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	p := &inFlight{latency: 2 * time.Second} // the provider holds each request 2s
	provider := httptest.NewServer(p)
	defer provider.Close()
	lim := Limit{Rate: 10, Burst: 1}
	var clients []*http.Client
	for range 2 {
		clients = append(clients, &http.Client{Transport: NewTransport(srv.Client(t), lim, WithConcurrency(5))})
	}
	start := time.Now()
	stop := start.Add(6 * time.Second)
	var wg sync.WaitGroup
	var pausedAt atomic.Int64
	for i := range 30 {
		c := clients[i%2]
		wg.Go(func() {
			for time.Now().Before(stop) {
				ctx, cancel := context.WithDeadline(context.Background(), stop.Add(3*time.Second))
				req, _ := http.NewRequestWithContext(ctx, "GET", provider.URL, nil)
				resp, err := c.Do(req)
				cancel()
				if err != nil {
					if pausedAt.Load() == 0 && !errors.Is(err, context.DeadlineExceeded) {
						t.Error(err)
					}
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	// The kill switch, 4s in.
	time.Sleep(time.Until(start.Add(4 * time.Second)))
	operator := NewLimiter(srv.Client(t))
	if err := operator.Pause(context.Background(), provider.Listener.Addr().String(), Forever); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	pausedAt.Store(paused.UnixNano())
	wg.Wait()
	p.mu.Lock()
	arrived := slices.Clone(p.arrivals)
	p.mu.Unlock()
	before := arrived[:0:0]
	for _, a := range arrived {
		if a.Before(paused) {
			before = append(before, a)
		}
	}
	busiest := maxInWindow(before, time.Second)
	after := between(arrived, paused.Add(100*time.Millisecond), paused.Add(3*time.Second))
	t.Logf("30 callers, 10/s burst 1, 5 slots, 2s a request: %d arrivals before the pause, at most %d in a second (bound %d); %d from 100ms after Pause(Forever) returned to 3s after",
		len(before), busiest, bound(lim, time.Second), after)
	if busiest > bound(lim, time.Second)+1 {
		t.Errorf("%d arrivals in a second, bound %d", busiest, bound(lim, time.Second))
	}
	if after != 0 {
		t.Errorf("%d requests reached the provider during the pause", after)
	}
	if len(before) < 10 {
		t.Errorf("%d arrivals before the pause: the slots let too few through", len(before))
	}
}
