package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
)

// fastLimit never makes anyone wait for a token: the tests of slots
// measure the slots alone.
var fastLimit = Limit{Rate: 1e6, Burst: 1e6}

// inFlight is a provider that counts the requests in flight and remembers
// the most at once.
type inFlight struct {
	now, peak, total atomic.Int64
	latency          time.Duration
	hold             chan struct{} // when set, requests last until it is closed
	body             string

	mu       sync.Mutex
	arrivals []time.Time
}

func (p *inFlight) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := p.now.Add(1)
	p.total.Add(1)
	p.mu.Lock()
	p.arrivals = append(p.arrivals, time.Now())
	p.mu.Unlock()
	for {
		peak := p.peak.Load()
		if n <= peak || p.peak.CompareAndSwap(peak, n) {
			break
		}
	}
	if p.hold != nil {
		select {
		case <-p.hold:
		case <-r.Context().Done():
		}
	} else {
		time.Sleep(p.latency)
	}
	p.now.Add(-1)
	io.WriteString(w, p.body)
}

// slotsHeld returns how many slots of the bucket called name Redis counts
// as held, and how many callers wait.
func slotsHeld(t *testing.T, rdb redis.UniversalClient, name string) (held, waiting int64) {
	t.Helper()
	key, _ := bucketKey(DefaultPrefix, name)
	ctx := context.Background()
	now := fmt.Sprint(time.Now().UnixMicro())
	held, err := rdb.ZCount(ctx, key+slots.HeldSuffix, now, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	waiting, err = rdb.ZCount(ctx, key+slots.WaitingSuffix, now, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	return held, waiting
}

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

// TestBodiesReleaseSlots: with one slot, each request can only go once the
// one before has released it, whichever way its body ends.
func TestBodiesReleaseSlots(t *testing.T) {
	rdb := newServerClient(t)
	srv := httptest.NewServer(&inFlight{body: strings.Repeat("x", 64<<10)})
	defer srv.Close()
	client := &http.Client{Transport: NewTransport(rdb, fastLimit, WithConcurrency(1))}
	get := func(t *testing.T) *http.Response {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		t.Cleanup(cancel)
		req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL, nil)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("the slot was not released: %v", err)
		}
		return resp
	}
	for _, tc := range []struct {
		name string
		end  func(*http.Response)
	}{
		{"closed early", func(r *http.Response) {
			io.CopyN(io.Discard, r.Body, 100)
			r.Body.Close()
		}},
		{"never read", func(r *http.Response) { r.Body.Close() }},
		{"read to EOF", func(r *http.Response) { io.Copy(io.Discard, r.Body) }},
		{"dropped unclosed", func(r *http.Response) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := get(t)
			tc.end(resp)
			resp = nil
			runtime.GC() // the dropped body's cleanup
			resp = get(t)
			resp.Body.Close()
		})
	}
	t.Run("error", func(t *testing.T) {
		failing := NewTransport(rdb, fastLimit, WithConcurrency(1), WithBase(roundTripFunc(func(*http.Request) (*http.Response, error) {
			return nil, errors.New("connection refused")
		})))
		req, _ := http.NewRequest("GET", srv.URL, nil)
		if _, err := failing.RoundTrip(req); err == nil {
			t.Fatal("want the base's error")
		}
		get(t).Body.Close()
	})
}

// arrivedIn counts the requests that arrived in [from, to).
func (p *inFlight) arrivedIn(from, to time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, a := range p.arrivals {
		if !a.Before(from) && a.Before(to) {
			n++
		}
	}
	return n
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

// TestKilledHolderSlotsReturn: a process killed with SIGKILL while it holds
// every slot renews nothing more, and its slots come back to a waiter
// within the lease.
func TestKilledHolderSlotsReturn(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	const slots, lease = 4, time.Second
	p := &inFlight{hold: make(chan struct{})}
	provider := httptest.NewServer(p)
	defer provider.Close()
	defer close(p.hold)
	name := strings.TrimPrefix(provider.URL, "http://") // the Transport's bucket
	spec := workerSpec{Addr: srv.Addr(), Key: name, Limit: fastLimit, Goroutines: slots,
		Duration: time.Minute, URL: provider.URL, Concurrency: slots, SlotLease: lease}
	w := startWorkers(t, 1, spec)
	eventually(t, 10*time.Second, "the worker holds every slot", func() bool { return p.now.Load() == slots })

	rdb := srv.Client(t)
	l := NewLimiter(rdb, WithSlotLease(lease))
	ctx, cancel := context.WithTimeout(context.Background(), 3*lease)
	defer cancel()
	got := make(chan time.Time, slots)
	for range slots {
		go func() {
			s, err := l.AcquireSlot(ctx, name, slots)
			if err != nil {
				t.Error(err)
				return
			}
			got <- time.Now()
			defer s.Release()
		}()
	}
	time.Sleep(lease) // held and renewed: nothing for the waiters
	if len(got) != 0 {
		t.Fatalf("%d slots granted while their holder lived", len(got))
	}
	if err := w.ps[0].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	var last time.Time
	for range slots {
		select {
		case last = <-got:
		case <-ctx.Done():
			t.Fatalf("the killed process's slots did not come back within %v", 3*lease)
		}
	}
	t.Logf("all %d slots back %v after the kill (lease %v)", slots, last.Sub(killed), lease)
	if back := last.Sub(killed); back > lease+300*time.Millisecond {
		t.Errorf("slots back %v after the kill, want within the lease, %v (+300ms)", back, lease)
	}
}

// TestRetryEachAttemptHoldsOneSlot: under retryablehttp, each attempt takes
// a slot and its failed response gives it back before the next: with one
// slot, three attempts go one after another.
func TestRetryEachAttemptHoldsOneSlot(t *testing.T) {
	rdb := newServerClient(t)
	var attempts, inFlightNow, peak atomic.Int64
	var name string // the Transport's bucket
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inFlightNow.Add(1)
		defer inFlightNow.Add(-1)
		peak.Store(max(peak.Load(), n))
		held, _ := slotsHeld(t, rdb, name)
		key, _ := bucketKey(DefaultPrefix, name)
		z, _ := rdb.ZRangeWithScores(context.Background(), key+slots.HeldSuffix, 0, -1).Result()
		t.Logf("DEBUG %v now %d", z, time.Now().UnixMicro())
		if held != 1 {
			t.Errorf("attempt %d: %d slots held in Redis, want 1", attempts.Load()+1, held)
		}
		if attempts.Add(1) < 3 {
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, "try again")
			return
		}
		io.WriteString(w, "ok")
	}))
	defer provider.Close()
	name = strings.TrimPrefix(provider.URL, "http://")
	client := retryingClient(NewTransport(rdb, fastLimit, WithConcurrency(1)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := retryablehttp.NewRequestWithContext(ctx, "GET", provider.URL, nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if attempts.Load() != 3 || peak.Load() != 1 {
		t.Errorf("%d attempts, %d at once; want 3, one at a time", attempts.Load(), peak.Load())
	}
	eventually(t, 5*time.Second, "the last slot released", func() bool {
		h, _ := slotsHeld(t, rdb, name)
		return h == 0
	})
}

func TestConcurrencyPolicies(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t, func(o *redis.Options) { o.MaxRetries = -1; o.DialTimeout = 200 * time.Millisecond })
	srv.Kill()
	for _, tc := range []struct {
		policy Policy
		peak   int64 // the most in flight of 10 at once; 0: refused
	}{
		{FailOpen, 10},
		{FallbackLocal(4), 2}, // 8 slots among 4 workers
		{FailClosed, 0},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			p := &inFlight{latency: 50 * time.Millisecond}
			provider := httptest.NewServer(p)
			defer provider.Close()
			client := &http.Client{Transport: NewTransport(rdb, fastLimit, WithConcurrency(8),
				WithPolicy(tc.policy), WithLogger(discardLogger()))}
			var refused atomic.Int64
			var wg sync.WaitGroup
			for range 10 {
				wg.Go(func() {
					resp, err := client.Get(provider.URL)
					if err != nil {
						if !errors.Is(err, ErrUnavailable) {
							t.Error(err)
						}
						refused.Add(1)
						return
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				})
			}
			wg.Wait()
			if got := p.peak.Load(); got != tc.peak {
				t.Errorf("%d in flight at most, want %d", got, tc.peak)
			}
			if tc.peak == 0 && refused.Load() != 10 {
				t.Errorf("%d of 10 refused, want all", refused.Load())
			}
		})
	}
}

func TestSlotTelemetry(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	tel := newTelemetry(t)
	l := NewLimiter(rdb, tel.options()...)
	ctx := context.Background()
	first, err := l.AcquireSlot(ctx, "seen", 1)
	if err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	tel.reader.Collect(ctx, &rm)
	if held := sumOf(rm, "quota.slots.held", []attribute.KeyValue{attrMode.String("shared")}); held != 1 {
		t.Errorf("quota.slots.held = %d while one is held, want 1", held)
	}
	go func() {
		time.Sleep(300 * time.Millisecond)
		first.Release()
	}()
	second, err := l.AcquireSlot(ctx, "seen", 1)
	if err != nil {
		t.Fatal(err)
	}
	second.Release()
	spans := tel.waitSpans()
	if len(spans) != 2 {
		t.Fatalf("%d wait spans, want 2", len(spans))
	}
	a := attrs(spans[1])
	if w := a[attrSlotWait].AsFloat64(); w < 0.2 || a[attrSlots].AsInt64() != 1 {
		t.Errorf("the second span: slot wait %v s, slots %v; want about 0.3 s and 1", w, a[attrSlots].AsInt64())
	}
	eventually(t, 5*time.Second, "the gauge back to zero", func() bool {
		var rm metricdata.ResourceMetrics
		tel.reader.Collect(ctx, &rm)
		return sumOf(rm, "quota.slots.held", []attribute.KeyValue{attrMode.String("shared")}) == 0
	})
	rm = metricdata.ResourceMetrics{}
	tel.reader.Collect(ctx, &rm)
	if n := sumOf(rm, "quota.slot.events", []attribute.KeyValue{attrSlotEvent.String(slotHanded)}); n != 1 {
		t.Errorf("%d slots handed, want 1: the second waited for the first's release", n)
	}
	if find(rm, "quota.slot.wait.duration") == nil {
		t.Error("no quota.slot.wait.duration")
	}
}

// TestSlotLingerTelemetry: a request cancelled after it was written keeps
// its slot for the linger, in the gauge as lingering, then lets it go.
func TestSlotLingerTelemetry(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	tel := newTelemetry(t)
	arrived := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	}))
	defer srv.Close()
	const linger = 500 * time.Millisecond
	client := &http.Client{Transport: NewTransport(rdb, fastLimit, tel.transportOptions(WithConcurrency(1), WithSlotLinger(linger))...)}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-arrived
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL, nil)
	if _, err := client.Do(req); err == nil {
		t.Fatal("want the cancellation")
	}
	cancelled := time.Now()
	lingering := func() int64 {
		var rm metricdata.ResourceMetrics
		tel.reader.Collect(context.Background(), &rm)
		return sumOf(rm, "quota.slots.held", []attribute.KeyValue{attrSlotState.String(slotLingering)})
	}
	if n := lingering(); n != 1 {
		t.Errorf("%d slots lingering after the cancel, want 1", n)
	}
	// The slot is still held: another request waits for it.
	req, _ = http.NewRequest("GET", srv.URL, nil)
	wctx, wcancel := context.WithTimeout(context.Background(), linger/5)
	defer wcancel()
	if _, err := client.Do(req.WithContext(wctx)); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a request during the linger: %v, want to wait for the slot", err)
	}
	eventually(t, 5*time.Second, "the lingering slot let go", func() bool { return lingering() == 0 })
	if d := time.Since(cancelled); d < linger {
		t.Errorf("let go %v after the cancel, want the linger, %v", d, linger)
	}
	var rm metricdata.ResourceMetrics
	tel.reader.Collect(context.Background(), &rm)
	if n := sumOf(rm, "quota.slot.events", []attribute.KeyValue{attrSlotEvent.String(slotLingered)}); n != 1 {
		t.Errorf("%d lingered events, want 1", n)
	}
}

// handOffs is a provider for a fleet that holds one slot: it remembers
// when each request arrived and left, and from which worker process.
type handOffs struct {
	latency time.Duration

	mu   sync.Mutex
	reqs []handOff
}

type handOff struct {
	arrived, left time.Time
	worker        string
}

func (p *handOffs) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	arrived := time.Now()
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
		time.Sleep(50 * time.Millisecond)
		wg.Go(func() { get(b) })
		if pause > 0 {
			time.Sleep(time.Until(start.Add(100 * time.Millisecond)))
			if err := NewLimiter(srv.Client(t)).Pause(context.Background(), name, pause); err != nil {
				t.Fatal(err)
			}
		}
		wg.Wait()
		provider.Close()
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
		// The pause began at 100 ms at the latest: it ends at 800 ms.
		if ends := start.Add(100*time.Millisecond + pause); pause > 0 && bArrived.Before(ends.Add(-30*time.Millisecond)) {
			t.Errorf("B arrived %v before the pause ended", ends.Sub(bArrived))
		}
	}
}
