package quota

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// AcquireSlot waits for one of the n concurrency slots of the bucket called
// name: at most n slots of a bucket are held at once, across every process
// that shares the Redis. Hand the slot back with its Release once the work
// it guards is done; until then the Limiter renews its lease in Redis, and
// should the process die, the slot comes back when its lease ends (see
// WithSlotLease).
//
// Callers that find every slot held wait in the bucket's queue, first come,
// first served across the fleet (behind the waiters of a Transport's
// requests of a priority above 0, see WithPriority), and are woken by the release that frees
// their slot: nobody polls. Nobody can know when a slot will free, so a
// caller waits in its place until its context ends, and then leaves the
// queue with the context's error. Give ctx a deadline to bound the wait.
//
// The slots are counted apart from the bucket's tokens: a Transport with
// WithConcurrency takes both. An n below 1 fails at once with an error
// matching ErrInvalidLimit. While Redis is unavailable the Limiter's Policy
// decides: FailOpen grants, FailClosed refuses with ErrUnavailable, and
// FallbackLocal grants this process n divided by the workers, at least 1.
// Under WithDryRun it never waits: it holds a slot when one is free, and
// returns a Slot that holds nothing otherwise.
func (l *Limiter) AcquireSlot(ctx context.Context, name string, n int) (*Slot, error) {
	return l.acquireSlotSpan(ctx, name, n)
}

// acquireSlotSpan is AcquireSlot, in its span.
func (l *Limiter) acquireSlotSpan(ctx context.Context, name string, n int) (_ *Slot, err error) {
	ctx, span := l.obs.Start(ctx, name, 0)
	span.Mode, span.DryRun = l.mode().String(), l.cfg.dryRun
	defer func() {
		span.End(err)
		if span.DryRun && err != nil && sentinels.Outcome(err) != obs.Cancelled {
			err = nil // measured, not enforced
		}
	}()
	b, err := l.bucket(name, []Limit{{Rate: 1, Burst: 1}})
	if err != nil {
		return nil, err
	}
	if err := checkSlots(n); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	slot, _, err := l.acquireSlot(ctx, &span, b, n, span.DryRun, nil)
	if err == slots.ErrNone {
		return &Slot{}, nil // under dry run: it would have waited
	}
	if err == nil {
		slot.h.InUse() // the caller's work begins
	}
	return slot, err
}

// checkSlots reports whether a bucket can have n slots.
func checkSlots(n int) error {
	if n < 1 {
		return fmt.Errorf("%w: %d concurrency slots, want at least 1", ErrInvalidLimit, n)
	}
	return nil
}

// acquireSlot waits for one of the n slots of bucket b, or with try takes
// one only if one is free now, and records the wait on span. With tokens,
// it asks for the tokens of the ask (of its pool's deployments, with
// tokens.pool) in the same call while Redis serves the slot, and returns
// their grant; nil when the slot came without them.
func (l *Limiter) acquireSlot(ctx context.Context, span *obs.Span, b bucket, n int, try bool, tokens *ask) (*Slot, *store.Grant, error) {
	start := time.Now()
	span.Slots = n
	defer func() { span.SlotWait = time.Since(start) }()
	for {
		mode := l.mode()
		if mode != ModeShared {
			span.Mode = mode.String()
			l.degraded(b)
			slot, err := l.degradedSlot(ctx, b, n, mode, try)
			if err == slots.ErrAgain {
				continue // Redis answers again
			}
			return slot, nil, err
		}
		var take *slots.Take
		if tokens != nil {
			maxWait, deadline := l.maxWait(ctx, tokens.noWait)
			keys, args := tokens.pool.Call(l.store, b.Bucket, tokens.cost(), maxWait)
			take = &slots.Take{Keys: keys, Args: args, Deadline: deadline}
		}
		set, id, taken, err := l.slots.Acquire(ctx, b.Name, b.Keys[0], n, try, take)
		switch {
		case err == nil:
			slot := &Slot{l.slots.Hold(ModeShared.String(), set, id)}
			if taken == nil {
				return slot, nil, nil
			}
			g, err := tokens.pool.Decode(b.Bucket, taken)
			if err != nil {
				return slot, nil, nil // its tokens are taken again
			}
			return slot, &g, nil
		case err == slots.ErrNone:
			return nil, nil, err
		}
		var abandoned *slots.AbandonedError
		if errors.As(err, &abandoned) {
			// A renewal failed while the caller waited: the policy serves.
			l.trip(b, abandoned.Cause)
			continue
		}
		if cerr := l.classify(ctx, err); !errors.Is(cerr, ErrUnavailable) {
			return nil, nil, cerr
		}
		l.trip(b, err)
	}
}

// degradedSlot serves a slot by the Policy while Redis is unavailable.
// The slots it grants are counted with those Redis granted before, and
// held in Redis once it answers again, before the fleet resumes the
// shared slots (see settleLocal).
func (l *Limiter) degradedSlot(ctx context.Context, b bucket, n int, mode Mode, try bool) (*Slot, error) {
	switch mode {
	case ModeOpen:
		l.breaker.Served()
		set, id := l.slots.HoldOpen(b.Name, b.Keys[0], n)
		return &Slot{l.slots.Hold(ModeOpen.String(), set, id)}, nil
	case ModeLocal:
		share := max(n/l.workers.Divisor(l.cfg.policy.workers), 1)
		set, id, err := l.slots.AcquireLocal(ctx, b.Name, b.Keys[0], n, share, try)
		if err != nil {
			return nil, err
		}
		l.breaker.Served()
		return &Slot{l.slots.Hold(ModeLocal.String(), set, id)}, nil
	}
	l.breaker.Refused()
	return nil, fmt.Errorf("%w: %w", ErrUnavailable, l.breaker.Cause())
}
