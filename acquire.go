package quota

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// refundTimeout bounds the Redis call that hands tokens back after a
// cancelled wait; the caller does not wait for it.
const refundTimeout = time.Second

// ask is what one acquisition asks for: n tokens from each of the layers
// lims (or with meters, each[i] from the layer that meters meters[i]),
// and, when slots is above zero, one of the bucket's slots; at once or
// not at all when noWait is set (AllowN, WithNoWait), failing with
// ErrWouldWait otherwise.
type ask struct {
	n      float64 // with meters, each[0]
	each   []float64
	meters []string
	lims   []Limit
	slots  int
	noWait bool
	class  int       // the priority; below zero: the context's (see ContextWithPriority)
	shares []float64 // the priorities' minimum shares (see WithMinShare)

	// The tenant the tokens are for, when tenantSet (see WithTenants);
	// otherwise the context's. weight is above 0 once weigh found one.
	tenant    string
	tenantSet bool
	weight    float64
	tenantCap int
	listed    bool // named in Tenants.Weights
	// wake, while it is first in its tenant's line, tells of a give-back
	// on the bucket: a held take asks again at once.
	wake <-chan struct{}
}

// cost returns what o asks of the bucket's layers.
func (o ask) cost() store.Cost {
	return store.Cost{N: o.n, Each: o.each, Class: o.class, Shares: o.shares, Tenant: o.tenant, Weight: o.weight, TenantCap: o.tenantCap}
}

// acquire serves an ask on the bucket called name: the one acquisition
// path. It takes the slot first and then the tokens, so that the grant is
// fresh when the request goes: a caller never sends on tokens taken before
// it waited for a slot, and so never on a grant that a pause or a change
// of the Limit overtook meanwhile. Under WithDryRun it records what it
// would have done and returns at once, with an error only when ctx has
// ended, holding a slot only if one was free.
func (l *Limiter) acquire(ctx context.Context, name string, o ask) (_ *Slot, err error) {
	if o.class < 0 {
		o.class = priorityOf(ctx)
	}
	o.shares = l.cfg.minShares
	l.weigh(ctx, &o)
	ctx, span := l.obs.start(ctx, name, o.n)
	span.mode, span.dryRun, span.priority = l.mode(), l.cfg.dryRun, o.class
	if o.weight > 0 {
		span.tenant(o.tenant, o.listed)
	}
	defer func() {
		span.end(err)
		if span.dryRun && err != nil && outcome(err) != outcomeCancelled {
			err = nil // measured, not enforced
		}
	}()

	if o.class < 0 || o.class > MaxPriority {
		return nil, fmt.Errorf("%w: %d, want 0 to %d", ErrInvalidPriority, o.class, MaxPriority)
	}
	b, err := l.bucket(name, o.lims, o.meters...)
	if err != nil {
		return nil, err
	}
	if b, err = l.controlled(ctx, &span, b); err != nil {
		return nil, err
	}
	span.limit(b.limit(0))
	if err := b.checkCost(o.cost()); err != nil {
		return nil, err
	}
	if o.slots == 0 {
		return nil, l.waitTokens(ctx, &span, b, o, nil)
	}
	if err := checkSlots(o.slots); err != nil {
		return nil, err
	}
	// A pause the caller is to wait out, it waits out before it queues for
	// a slot, so as not to hold one idle meanwhile.
	if err := l.awaitPause(ctx, &span, b, &o); err != nil {
		return nil, err
	}
	slot, first, err := l.acquireSlot(ctx, &span, b, o.slots, o.noWait || span.dryRun, &o)
	switch {
	case err == slots.ErrNone && span.dryRun:
		slot = nil // measured: it would have waited for a slot
	case err == slots.ErrNone:
		return nil, fmt.Errorf("%w: every one of %q's %d slots is in use", ErrWouldWait, name, o.slots)
	case err != nil:
		return nil, err
	}
	if err := l.waitTokens(ctx, &span, b, o, first); err != nil {
		slot.Release()
		return nil, err
	}
	return slot, nil
}

// waitTokens waits for o.n tokens of bucket b, under its control record as
// the Limiter knows it when it asks; first, when not nil, is the grant of
// a take already made (with a slot), which it serves before it asks again.
// Every way back into its loop either sleeps or changes mode: it never
// calls Redis twice without a pause. A take for a tenant asks only when
// it is first in its tenant's line in this Limiter, and stays first while
// its take is held (see WithTenants).
func (l *Limiter) waitTokens(ctx context.Context, span *waitSpan, b bucket, o ask, first *store.Grant) error {
	var head *turn    // set while it is first in its tenant's line
	var listen func() // set while its take is held: give-backs are announced
	leave := func(next time.Time) {
		head.leave(next)
		if listen != nil {
			listen()
		}
		head, listen, o.wake = nil, nil, nil
	}
	defer func() {
		if head != nil {
			leave(time.Time{})
		}
	}()
	for {
		if first != nil {
			g := *first
			first = nil
			maxWait, deadline := l.maxWait(ctx)
			if o.noWait {
				maxWait = 0
			}
			if done, err := l.granted(ctx, span, b, o, g, maxWait, deadline); done {
				return err
			}
			continue
		}
		if b.ctl != nil {
			b = b.under(b.ctl)
			span.limit(b.limit(0))
		}
		if err := b.checkCost(o.cost()); err != nil {
			return err
		}
		if err := l.awaitPause(ctx, span, b, &o); err != nil {
			return err
		}
		if mode := l.mode(); mode != ModeShared {
			if head != nil {
				leave(time.Time{}) // the policy serves it: no turn to keep
			}
			span.mode = mode
			l.degraded(b)
			wait, err := l.degradedWait(ctx, b, o.cost(), mode, o.noWait)
			span.wait = wait
			if err == errAskAgain {
				continue // slept MaxWait: Redis may be back by now
			}
			return err
		}
		if o.weight > 0 && o.class == 0 && !o.noWait && head == nil {
			var err error
			if head, err = l.lines.join(ctx, lineKey{b.Keys[0], o.tenant}); err != nil {
				return err
			}
			o.wake = head.ln.wake
			// Not before the queue has room, as far as the grant of the
			// caller before it told.
			if err := sleepOr(ctx, time.Until(head.due()), o.wake); err != nil {
				return err
			}
		}
		maxWait, deadline := l.maxWait(ctx)
		if o.noWait {
			maxWait = 0
		}
		g, err := l.store.Take(ctx, b.Bucket, o.cost(), maxWait)
		if head != nil && g.Outcome == store.Held && listen == nil {
			listen = l.events.Hold()
		}
		if head != nil && g.Outcome != store.Held {
			var next time.Time
			if g.Granted() && g.Wait > 0 {
				next = roomAfter(g.Wait, b.costTime(o.cost()))
			}
			leave(next) // the next caller of the tenant may ask
		}
		span.trips += g.Trips
		if g.Size > 0 {
			batchSize(ctx, g.Size)
		}
		if err != nil {
			if cerr := l.classify(ctx, err); !errors.Is(cerr, ErrUnavailable) {
				return cerr
			}
			l.trip(b, err)
			continue // the policy serves this request too
		}
		if done, err := l.granted(ctx, span, b, o, g, maxWait, deadline); done {
			return err
		}
	}
}

// granted serves the grant g of a take of o.n tokens of b with a longest
// wait of maxWait (the caller's deadline when deadline is set): it sleeps
// on a grant, and reports done with the acquisition's error; otherwise it
// sleeps when the loop is to ask again, and reports not done.
func (l *Limiter) granted(ctx context.Context, span *waitSpan, b bucket, o ask, g store.Grant, maxWait time.Duration, deadline bool) (done bool, err error) {
	name := b.Name
	l.workers.Heartbeat()
	if g.Granted() {
		if l.cfg.policy.mode() == ModeLocal {
			l.locals.Granted(b.Keys[0], g.Wait)
		}
		if span.dryRun {
			span.wait = g.Wait
			return true, nil
		}
		moved, err := l.sleepOn(ctx, b, g, o.cost())
		if err != nil {
			tats := g.Tats
			if moved != 0 && tats != nil {
				tats = slices.Clone(tats)
				for i := range tats {
					tats[i] += moved.Microseconds()
				}
			}
			go l.refund(context.WithoutCancel(ctx), b, o.cost(), tats)
			if err == ErrWouldExceedDeadline {
				return true, fmt.Errorf("%w: a pause moved %q's grant by %v", ErrWouldExceedDeadline, name, moved)
			}
			return true, err
		}
		return true, nil
	}
	if g.Outcome == store.Resuming {
		// The fleet is still on its local shares after an outage this
		// Limiter did not see: under FallbackLocal it joins them, and
		// resumes with them; under another policy it takes again
		// minRetry later.
		switch {
		case o.noWait && l.cfg.policy.mode() != ModeLocal:
			return true, fmt.Errorf("%w: %q resumes after an outage", ErrWouldWait, name)
		case span.dryRun:
			return true, nil
		case l.cfg.policy.mode() == ModeLocal:
			l.trip(b, errResuming)
			return false, nil
		}
		if err := sleep(ctx, minRetry); err != nil {
			return true, err
		}
		return false, nil
	}
	if g.Outcome == store.Crowded || g.Outcome == store.Held {
		// The take took nothing and is to ask again in g.Wait: it would
		// push a lower priority past its minimum share (WithMinShare), or
		// it is another tenant's turn, or the bucket's queue is full
		// (WithTenants). It asks again then, later by up to half as much
		// again, so that the callers refused together do not all ask at
		// once.
		why := fmt.Sprintf("%q's lower priorities are at their minimum share", name)
		if g.Outcome == store.Held {
			why = fmt.Sprintf("%q is shared between tenants and is not %q's", name, o.tenant)
		}
		switch {
		case o.noWait:
			return true, fmt.Errorf("%w: %s for %v", ErrWouldWait, why, g.Wait)
		case deadline && g.Wait > maxWait:
			return true, fmt.Errorf("%w: %s for %v", ErrWouldExceedDeadline, why, g.Wait)
		case span.dryRun:
			span.wait = g.Wait
			return true, nil
		}
		wait := max(g.Wait, minCrowded)
		if err := sleepOr(ctx, min(wait+rand.N(wait/2), maxWait), o.wake); err != nil {
			return true, err
		}
		return false, nil
	}
	if g.Outcome == store.Paused {
		// Paused until a resume, which the Limiter had not heard of: it
		// reads the record, and waits for the pause as the callers after
		// it will. Should the record say otherwise, it takes again
		// minRetry later, not at once.
		switch {
		case o.noWait:
			return true, fmt.Errorf("%w: %q is paused until resumed", ErrWouldWait, name)
		case span.dryRun:
			return true, nil
		}
		if b.ctl != nil {
			sent, err := l.controls.ReadNow(ctx, b.ctl)
			if sent {
				span.trips++
			}
			if err != nil {
				return true, l.classify(ctx, err)
			}
			if _, _, paused := b.ctl.Load().PausedAt(time.Now()); paused {
				return false, nil
			}
		}
		if err := sleep(ctx, minRetry); err != nil {
			return true, err
		}
		return false, nil
	}
	switch {
	case o.noWait:
		return true, fmt.Errorf("%w: %q needs %v", ErrWouldWait, name, g.Wait)
	case deadline:
		return true, fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, name, g.Wait)
	case span.dryRun:
		// Enforced, the caller would sleep MaxWait and ask again: its wait
		// would be about what the script replied, at least that.
		span.wait = g.Wait
		return true, nil
	}
	if err := sleep(ctx, maxWait); err != nil {
		return true, err
	}
	return false, nil
}

// recordFailure records, under dry run, an acquisition that failed with
// err before it had a bucket to take from.
func (l *Limiter) recordFailure(ctx context.Context, err error) {
	_, span := l.obs.start(ctx, "", 1)
	span.mode, span.dryRun = l.mode(), l.cfg.dryRun
	span.end(err)
}

// minCrowded is the least a take that a minimum share refused, or that
// was held for a tenant's turn, sleeps before it asks again.
const minCrowded = 5 * time.Millisecond

// errAskAgain tells acquire that the policy slept MaxWait without granting.
var errAskAgain = errors.New("quota: ask again")

// refund hands n taken at tats back to the bucket after the caller gave
// up waiting for it.
func (l *Limiter) refund(ctx context.Context, b bucket, n store.Cost, tats []int64) {
	ctx, cancel := context.WithTimeout(ctx, refundTimeout)
	defer cancel()
	if err := l.store.Refund(ctx, b.Bucket, n, tats); err == nil {
		l.obs.refunds.Add(ctx, 1)
	}
}
