package quota

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of concurrency slots while Redis fails (concurrency.go), split from
// concurrency_test.go: slots under each policy and through an outage, and
// waiters whose place Redis forgets (a restart, FLUSHALL) or that a failed
// renewal hands to the policy.

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

// TestSlotsThroughAnOutage: 4 processes x 20 goroutines with
// WithConcurrency(8) under FallbackLocal(4), against a provider that
// holds each request 700 ms, through Redis killed and restarted empty.
// The requests in flight when Redis goes count against each process's
// local share, and the slots held locally are registered in Redis before
// the fleet resumes the shared slots, so the provider never sees more
// than 8 in flight: not 8 shared still in flight beside 8 local, nor 8
// local beside 8 granted by a Redis that knows none of them. The negative
// control never registers them.
func TestSlotsThroughAnOutage(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		name       string
		noRegister bool
	}{
		{"registered", false},
		{"unregistered", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			const slots, procs, latency = 8, 4, 700 * time.Millisecond
			p := &inFlight{latency: latency}
			provider := httptest.NewServer(p)
			defer provider.Close()
			spec := workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(provider.URL, "http://"), Limit: fastLimit, Goroutines: 20,
				Duration: 9 * time.Second, URL: provider.URL, Concurrency: slots, Fallback: procs, Faults: true, NoRegister: tc.noRegister}
			w := startWorkers(t, procs, spec)
			var peaks []int64
			phase := func(until time.Duration, do func()) {
				time.Sleep(time.Until(w.start.Add(until)))
				peaks = append(peaks, p.peak.Swap(p.now.Load()))
				if do != nil {
					do()
				}
			}
			phase(2*time.Second, srv.Kill)
			phase(4*time.Second, srv.Restart)
			phase(spec.Duration, nil)
			reports := w.wait(t)
			total := 0
			for _, r := range reports {
				total += len(r.Grants)
			}
			t.Logf("%s: the provider's peak in flight: %d before the kill, %d in the outage, %d from the restart (slots %d); %d requests in all",
				tc.name, peaks[0], peaks[1], peaks[2], slots, total)
			if tc.noRegister {
				if peaks[2] <= slots {
					t.Errorf("with the local slots never registered the provider saw at most %d in flight from the restart: the scenario shows nothing", peaks[2])
				}
				return
			}
			for i, what := range []string{"before the kill", "in the outage", "from the restart"} {
				if peaks[i] > slots {
					t.Errorf("%s: the provider saw %d requests in flight, limit %d", what, peaks[i], slots)
				}
			}
			// The fleet kept moving: at least half of 8 slots / 700 ms.
			if want := int(0.5 * slots / latency.Seconds() * spec.Duration.Seconds()); total < want {
				t.Errorf("%d requests in %v, want at least %d", total, spec.Duration, want)
			}
		})
	}
}

// acquireAsync acquires a slot of the bucket called name in the background
// and sends the result once it is in hand.
func acquireAsync(ctx context.Context, l *Limiter, name string, n int) <-chan slotResult {
	ch := make(chan slotResult, 1)
	go func() {
		s, err := l.AcquireSlot(ctx, name, n)
		ch <- slotResult{s, err}
	}()
	return ch
}

type slotResult struct {
	slot *Slot
	err  error
}

// TestForgottenWaiterQueuesAgain: Redis forgets a waiter (FLUSHALL) while
// its slot is held; the holder's release finds nothing and a newcomer
// arrives. The forgotten waiter must find out within a lease and queue
// again, so that it is served once the newcomer is done.
func TestForgottenWaiterQueuesAgain(t *testing.T) {
	const lease = time.Second
	rdb := newServerClient(t)
	l := NewLimiter(rdb, WithSlotLease(lease), WithLogger(discardLogger()))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	first, err := l.AcquireSlot(ctx, "forgotten", 1)
	if err != nil {
		t.Fatal(err)
	}
	second := acquireAsync(ctx, l, "forgotten", 1)
	eventually(t, 5*time.Second, "the second caller queued", func() bool {
		_, w := slotsHeld(t, rdb, "forgotten")
		return w == 1
	})
	if err := rdb.FlushAll(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	flushed := time.Now()
	first.Release()
	var inUse, peak atomic.Int32
	use := func(s *Slot, d time.Duration) {
		if n := inUse.Add(1); n > peak.Load() {
			peak.Store(n)
		}
		time.Sleep(d)
		inUse.Add(-1)
		s.Release()
	}
	third := acquireAsync(ctx, l, "forgotten", 1)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r := <-third
		if r.err != nil {
			t.Error("the third caller:", r.err)
			return
		}
		use(r.slot, 200*time.Millisecond)
	}()
	select {
	case r := <-second:
		if r.err != nil {
			t.Fatal("the second caller:", r.err)
		}
		waited := time.Since(flushed)
		use(r.slot, 0)
		// One lease to find out, the third caller's 200ms, and slack.
		if waited > 2*lease+500*time.Millisecond {
			t.Errorf("the forgotten waiter got its slot %v after Redis forgot it, want within about a lease", waited)
		}
	case <-time.After(4 * lease):
		t.Fatalf("the forgotten waiter still waits %v after Redis forgot it", 4*lease)
	}
	<-done
	if peak.Load() > 1 {
		t.Errorf("%d callers held the bucket's one slot at once", peak.Load())
	}
	if m := l.Mode(); m != ModeShared {
		t.Errorf("mode %v, want shared: the slots came from Redis", m)
	}
}

// TestForgottenWaiterTakesAFreeSlot: Redis restarts empty while a caller
// waits, and the slot is free once the holder releases. The waiter must
// take it within about a lease.
func TestForgottenWaiterTakesAFreeSlot(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	const lease = time.Second
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := NewLimiter(rdb, WithSlotLease(lease), WithLogger(discardLogger()))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	first, err := l.AcquireSlot(ctx, "restarted", 1)
	if err != nil {
		t.Fatal(err)
	}
	second := acquireAsync(ctx, l, "restarted", 1)
	eventually(t, 5*time.Second, "the second caller queued", func() bool {
		_, w := slotsHeld(t, rdb, "restarted")
		return w == 1
	})
	srv.Restart()
	restarted := time.Now()
	first.Release()
	select {
	case r := <-second:
		if r.err != nil {
			t.Fatal("the second caller:", r.err)
		}
		defer r.slot.Release()
		if waited := time.Since(restarted); waited > lease+500*time.Millisecond {
			t.Errorf("the forgotten waiter got the free slot %v after the restart, want within about a lease", waited)
		}
	case <-time.After(4 * lease):
		t.Fatalf("the forgotten waiter still waits %v after the restart", 4*lease)
	}
	if h, w := slotsHeld(t, rdb, "restarted"); h != 1 || w != 0 {
		t.Errorf("Redis counts %d held and %d waiting, want the waiter holding its slot", h, w)
	}
	if m := l.Mode(); m != ModeShared {
		t.Errorf("mode %v, want shared", m)
	}
}

// failRenewals is a hook that fails the next renewals of slots, as if
// Redis were unreachable for them, while every other call goes through.
type failRenewals struct{ left atomic.Int32 }

func (*failRenewals) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f *failRenewals) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if scriptOp(cmd) == "renew" && f.left.Add(-1) >= 0 {
			err := errors.New("injected: connection reset by peer")
			cmd.SetErr(err)
			return err
		}
		return next(ctx, cmd)
	}
}

func (*failRenewals) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestAbandonedWaitersLeaveTheQueue: a renewal fails as unavailable, so
// the Limiter sends its waiters to the policy. The breaker opens at once,
// and once Redis answers, the abandoned ids no longer stand in the queue:
// the slot released next goes to a caller that waits for it.
func TestAbandonedWaitersLeaveTheQueue(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	const lease = 3 * time.Second
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	faulty := srv.Client(t)
	fail := &failRenewals{}
	faulty.AddHook(fail)
	holder := NewLimiter(rdb, WithSlotLease(lease), WithLogger(discardLogger()))
	l := NewLimiter(faulty, WithSlotLease(lease), WithPolicy(FailOpen), WithLogger(discardLogger()))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	first, err := holder.AcquireSlot(ctx, "abandoned", 1)
	if err != nil {
		t.Fatal(err)
	}
	fail.left.Store(1)
	waiter := acquireAsync(ctx, l, "abandoned", 1)
	var r slotResult
	select {
	case r = <-waiter:
	case <-time.After(lease):
		t.Fatal("the waiter whose renewal failed still waits")
	}
	if r.err != nil {
		t.Fatal("the abandoned waiter:", r.err)
	}
	defer r.slot.Release()
	if m := l.Mode(); m != ModeOpen {
		t.Errorf("mode %v after the renewal failed, want open: the policy serves at once", m)
	}
	eventually(t, 2*time.Second, "the abandoned id out of the queue", func() bool {
		_, w := slotsHeld(t, rdb, "abandoned")
		return w == 0
	})
	first.Release()
	short, cancelShort := context.WithTimeout(ctx, time.Second)
	defer cancelShort()
	next, err := holder.AcquireSlot(short, "abandoned", 1)
	if err != nil {
		t.Fatalf("a caller after the release: %v; the abandoned ids took the slot", err)
	}
	next.Release()
}

// TestRestartReachesWaitingLimiters: a Limiter whose only caller waits in
// Redis's queue for a slot makes no call meanwhile, so it does not see
// Redis restart empty and forget the caller's place. Another Limiter's
// callers, which take the slot in turn, are served by the restarted Redis
// while it waits. It must queue again and get the slot within 1.5 s of
// the restart, not at its next renewal, a quarter lease after it queued
// (2.5 s with the default lease), behind whoever came since.
func TestRestartReachesWaitingLimiters(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	limiter := func() *Limiter {
		rdb := redis.NewClient(faultOptions(srv.Addr()))
		t.Cleanup(func() { rdb.Close() })
		return NewLimiter(rdb, WithPolicy(FallbackLocal(2)), WithLogger(discardLogger()))
	}
	others, idle := limiter(), limiter()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	held, err := others.AcquireSlot(ctx, "restart", 1)
	if err != nil {
		t.Fatal(err)
	}
	waiter := acquireAsync(ctx, idle, "restart", 1)
	rdb := srv.Client(t)
	eventually(t, 5*time.Second, "the caller queued", func() bool {
		_, w := slotsHeld(t, rdb, "restart")
		return w == 1
	})
	queued := time.Now()
	srv.Kill()
	time.Sleep(300 * time.Millisecond)
	srv.Restart()
	restarted := time.Now()
	held.Release()

	// The others go on: two callers that take the slot in turn, each
	// for 50 ms, as the waiting caller will once it has it.
	var served, inUse, peak atomic.Int32
	use := func(s *Slot) {
		if n := inUse.Add(1); n > peak.Load() {
			peak.Store(n)
		}
		time.Sleep(50 * time.Millisecond)
		inUse.Add(-1)
		s.Release()
	}
	turns, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for {
				s, err := others.AcquireSlot(turns, "restart", 1)
				if err != nil {
					return
				}
				served.Add(1)
				use(s)
			}
		})
	}
	select {
	case r := <-waiter:
		waited := time.Since(restarted)
		if r.err != nil {
			t.Fatal("the waiting caller:", r.err)
		}
		use(r.slot)
		stop()
		wg.Wait()
		t.Logf("queued %v before the restart; got its slot (%v) %v after it, the others served %d times meanwhile; at most %d in use",
			restarted.Sub(queued).Round(time.Millisecond), r.slot.h.Mode(), waited.Round(time.Millisecond), served.Load(), peak.Load())
		if waited > 1500*time.Millisecond {
			t.Errorf("the waiting caller got its slot %v after the restart, the others served %d times meanwhile; want within 1.5s",
				waited.Round(time.Millisecond), served.Load())
		}
		// A waiter that saw Redis down (its subscription broke in the
		// 300 ms) holds its local share, at least one slot, which Redis's
		// slots do not count until its resume: FallbackLocal's bound.
		most := int32(1)
		if r.slot.h.Mode() != ModeShared.String() {
			most = 2
		}
		if peak.Load() > most {
			t.Errorf("%d callers held the bucket's one slot at once, want at most %d", peak.Load(), most)
		}
	case <-time.After(8 * time.Second):
		stop()
		t.Fatalf("the waiting caller still waits 8s after the restart; the others were served %d times", served.Load())
	}
}
