package quota

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redistest"
)

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
			restarted.Sub(queued).Round(time.Millisecond), r.slot.mode, waited.Round(time.Millisecond), served.Load(), peak.Load())
		if waited > 1500*time.Millisecond {
			t.Errorf("the waiting caller got its slot %v after the restart, the others served %d times meanwhile; want within 1.5s",
				waited.Round(time.Millisecond), served.Load())
		}
		if peak.Load() > 1 {
			t.Errorf("%d callers held the bucket's one slot at once", peak.Load())
		}
	case <-time.After(8 * time.Second):
		stop()
		t.Fatalf("the waiting caller still waits 8s after the restart; the others were served %d times", served.Load())
	}
}
