package quota

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/lines"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/pool"
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
	listed    bool  // named in Tenants.Weights
	since     int64 // when its take was first held, on the server's clock (see store.Cost)
	// line is its place in its tenant's line, whose give-backs wake a held
	// take to ask again at once.
	line *lines.Place
	pool *pool.Take // the pool it takes from, when not nil (see WithPool)
}

// cost returns what o asks of the bucket's layers.
func (o ask) cost() store.Cost {
	return store.Cost{N: o.n, Each: o.each, Class: o.class, Shares: o.shares, Tenant: o.tenant, Weight: o.weight, TenantCap: o.tenantCap, Since: o.since}
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
	ctx, span := l.obs.Start(ctx, name, o.n)
	span.Mode, span.DryRun, span.Priority = l.mode().String(), l.cfg.dryRun, o.class
	if o.weight > 0 {
		span.Tenant(o.tenant, o.listed)
	}
	defer func() {
		span.End(err)
		if span.DryRun && err != nil && sentinels.Outcome(err) != obs.Cancelled {
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
	switch { // a pool's turns read its deployments' records
	case o.pool == nil:
		if b, err = l.controlled(ctx, &span, b); err == nil {
			span.Limit(b.Lims[0].Rate, b.Lims[0].Burst)
			err = b.checkCost(o.cost())
		}
	case o.slots > 0: // the slot's call takes from them
		_, o.pool.Cands, err = l.deployments(ctx, &span, b, o)
	}
	if err != nil {
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
	slot, first, err := l.acquireSlot(ctx, &span, b, o.slots, o.noWait || span.DryRun, &o)
	switch {
	case err == slots.ErrNone && span.DryRun:
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
// the Limiter knows it when it asks, or with o.pool of the deployment of
// pool b that grants them soonest (see WithPool); first, when not nil, is
// the grant of a take already made (with a slot), which it serves before
// it asks again.
// Every way back into its loop either sleeps or changes mode: it never
// calls Redis twice without a pause. A take for a tenant asks only when
// it is first in its tenant's line in this Limiter, and stays first while
// its take is held (see WithTenants).
func (l *Limiter) waitTokens(ctx context.Context, span *obs.Span, b bucket, o ask, first *store.Grant) (err error) {
	var deps []bucket // a pool's deployments, under their records (see WithPool)
	whole := b        // a pool's name and layers
	defer func() {
		o.line.Leave(time.Time{})
		if err == nil && b.ctl != nil {
			l.controls.Count(b.ctl, time.Now(), o.n, o.each) // what the fleet's Status reads as its rate
		}
	}()
	for {
		if o.pool != nil {
			if deps, o.pool.Cands, err = l.deployments(ctx, span, whole, o); err != nil {
				return err
			}
			b = deps[0] // whose key names its tenant's line
		}
		if first != nil {
			g := *first
			first = nil
			if o.pool != nil {
				b = deps[o.pool.Chosen] // the slot's call took from it
			}
			if g.Outcome == store.Held && o.since == 0 {
				o.since = g.Now // held in its slot's hand-off: its age too
			}
			maxWait, deadline := l.maxWait(ctx, o.noWait)
			if done, err := l.granted(ctx, span, b, o, g, maxWait, deadline); done {
				return err
			}
			continue
		}
		if o.pool == nil && b.ctl != nil {
			b = b.under(b.ctl)
			span.Limit(b.Lims[0].Rate, b.Lims[0].Burst)
		}
		if err := b.checkCost(o.cost()); err != nil {
			return err
		}
		if err := l.awaitPause(ctx, span, b, &o); err != nil {
			return err
		}
		if mode := l.mode(); mode != ModeShared {
			o.line.Leave(time.Time{}) // the policy serves it: no turn to keep
			span.Mode = mode.String()
			if o.pool != nil {
				o.pool.Chosen = l.locals.Soonest(o.pool.Cands, o.cost(), l.workers.Divisor(l.cfg.policy.workers))
				b = deps[o.pool.Chosen]
			}
			l.degraded(b)
			wait, err := l.degradedWait(ctx, b.lowered(), o.cost(), mode, o.noWait)
			span.Wait = wait
			if err == errAskAgain {
				continue // slept MaxWait: Redis may be back by now
			}
			return err
		}
		if o.weight > 0 && o.class == 0 && !o.noWait {
			if o.line == nil {
				o.line = new(lines.Place)
			}
			if err := o.line.Join(ctx, &l.lines, b.Keys[0], o.tenant); err != nil {
				return err
			}
		}
		maxWait, deadline := l.maxWait(ctx, o.noWait)
		var g store.Grant
		if o.pool != nil {
			g, o.pool.Chosen, err = l.store.TakePool(ctx, o.pool.Cands, o.cost(), maxWait)
			b = deps[o.pool.Chosen]
		} else {
			g, err = l.store.Take(ctx, b.Bucket, o.cost(), maxWait)
		}
		if g.Outcome == store.Held {
			o.line.Held(l.events.Hold)
			if o.since == 0 {
				o.since = g.Now // its age, which the tenant's later takes do not pass
			}
		} else if o.line.First() {
			var next time.Time
			if g.Granted() && g.Wait > 0 {
				next = lines.RoomAfter(g.Wait, b.CostTime(o.cost()))
			}
			o.line.Leave(next) // the next caller of the tenant may ask
		}
		span.Trips += g.Trips
		if g.Size > 0 {
			obs.BatchSize(ctx, g.Size)
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

// movedHook, set by tests, learns how far the bucket's timeline moved
// each grant a caller slept on.
var movedHook func(ctx context.Context, moved time.Duration)

// granted serves the grant g of a take of o.n tokens of b with a longest
// wait of maxWait (the caller's deadline when deadline is set): it sleeps
// on a grant, and reports done with the acquisition's error; otherwise it
// sleeps when the loop is to ask again, and reports not done.
func (l *Limiter) granted(ctx context.Context, span *obs.Span, b bucket, o ask, g store.Grant, maxWait time.Duration, deadline bool) (done bool, err error) {
	name := b.Name
	l.workers.Heartbeat()
	if g.Granted() {
		if l.cfg.policy.mode() == ModeLocal {
			l.locals.Granted(b.Keys[0], g.Wait)
		}
		if span.DryRun {
			span.Wait = g.Wait
			return true, nil
		}
		moved, err := l.controls.SleepOn(ctx, b.ctl, len(b.Keys), g, o.cost(), !l.off(pushes))
		if err != nil {
			go l.refund(context.WithoutCancel(ctx), b, o.cost(), g.TatsMoved(moved))
			if err == control.ErrPastDeadline {
				return true, fmt.Errorf("%w: a pause moved %q's grant by %v", ErrWouldExceedDeadline, name, moved)
			}
			return true, err
		}
		if movedHook != nil {
			movedHook(ctx, moved)
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
		case span.DryRun:
			return true, nil
		case l.cfg.policy.mode() == ModeLocal:
			l.trip(b, errResuming)
			return false, nil
		}
		err := sleep(ctx, minRetry)
		return err != nil, err
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
		case span.DryRun:
			span.Wait = g.Wait
			return true, nil
		}
		wait := max(g.Wait, minCrowded)
		err := control.Sleep(ctx, min(wait+rand.N(wait/2), maxWait), o.line.Wake())
		return err != nil, err
	}
	if g.Outcome == store.Paused {
		// Paused until a resume, which the Limiter had not heard of: it
		// reads the record, and waits for the pause as the callers after
		// it will. Should the record say otherwise, it takes again
		// minRetry later, not at once.
		switch {
		case o.noWait:
			return true, fmt.Errorf("%w: %q is paused until resumed", ErrWouldWait, name)
		case span.DryRun:
			return true, nil
		}
		if b.ctl != nil {
			sent, err := l.controls.ReadNow(ctx, b.ctl)
			if sent {
				span.Trips++
			}
			if err != nil {
				return true, l.classify(ctx, err)
			}
			if _, _, paused := b.ctl.Load().PausedAt(time.Now()); paused {
				return false, nil
			}
		}
		err := sleep(ctx, minRetry)
		return err != nil, err
	}
	switch {
	case o.noWait:
		return true, fmt.Errorf("%w: %q needs %v", ErrWouldWait, name, g.Wait)
	case deadline:
		return true, fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, name, g.Wait)
	case span.DryRun:
		// Enforced, the caller would sleep MaxWait and ask again: its wait
		// would be about what the script replied, at least that.
		span.Wait = g.Wait
		return true, nil
	}
	err = sleep(ctx, maxWait)
	return err != nil, err
}

// recordFailure records, under dry run, an acquisition that failed with
// err before it had a bucket to take from.
func (l *Limiter) recordFailure(ctx context.Context, err error) {
	_, span := l.obs.Start(ctx, "", 1)
	span.Mode, span.DryRun = l.mode().String(), l.cfg.dryRun
	span.End(err)
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
		l.obs.Refunded(ctx)
	}
}
