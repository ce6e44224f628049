package quota

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/store"
	"github.com/sharedquota/quota/internal/updates"
)

// localWait waits for n from this process's share of every layer, or
// takes it only if the shares have it now when noWait is set, and returns
// how long it waited, or under dry run would have.
func (l *Limiter) localWait(ctx context.Context, b bucket, n store.Cost, noWait bool) (time.Duration, error) {
	r, err := l.locals.Reserve(b.Bucket, n, l.workers.Divisor(l.cfg.policy.workers))
	if err != nil {
		l.breaker.Refused()
		return 0, fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	delay := r.Delay
	maxWait, deadline := l.maxWait(ctx, noWait)
	if delay > maxWait {
		r.Undo()
		switch {
		case noWait:
			return 0, fmt.Errorf("%w: %q needs %v", ErrWouldWait, b.Name, delay)
		case deadline:
			return 0, fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, b.Name, delay)
		case l.cfg.dryRun:
			return delay, nil // enforced, it would sleep MaxWait and ask again
		}
		if err := sleep(ctx, maxWait); err != nil {
			return 0, err
		}
		return 0, errAskAgain
	}
	if l.cfg.dryRun {
		l.breaker.Served()
		return delay, nil // the share keeps the reservation, as if slept on
	}
	if err := sleep(ctx, delay); err != nil {
		r.Cancel()
		return 0, err
	}
	l.breaker.Served()
	return delay, nil
}

// settleLocal hands the shared bucket, when it resumes, the state of the
// local shares (see local.Shares.Settle), once the slots in use are held
// in Redis again. A failure that says Redis is unavailable again is
// returned: the outage goes on. Any other is counted and logged, and
// leaves that bucket as Redis has it.
func (l *Limiter) settleLocal() error {
	if err := l.registerSlots(); err != nil {
		return err
	}
	if l.off(handOver) {
		return nil
	}
	return l.locals.Settle(l.store, l.workers.Divisor(l.cfg.policy.workers), func(err error) bool {
		if l.unavailable(err) {
			return true
		}
		l.updates.Failed(updates.SettleLocal, err)
		return false
	})
}

// resumeDelay is how long after the first Limiter finds Redis again the
// fleet resumes the shared bucket: longer than the probe's longest
// backoff, so that every Limiter still probing has found Redis by then.
const resumeDelay = breaker.MaxBackoff + 250*time.Millisecond

// resumeIn returns how long until the fleet resumes the shared bucket
// after an outage: every Limiter of the fleet reads the instant the first
// one to find Redis again recorded. It is zero for a policy without local
// shares, and when Redis cannot say.
func (l *Limiter) resumeIn(ctx context.Context) time.Duration {
	_ = l.registerSlots() // again at the resume: settleLocal
	if l.cfg.policy.mode() != ModeLocal || l.off(handOver) {
		return 0
	}
	d, at, _ := l.resume.In(ctx, resumeDelay, l.store.Now())
	if d > 0 && !l.off(joins) {
		// The buckets the local shares served grant nothing before the
		// fleet resumes them (see local.Shares.Hold); a failure leaves
		// that bucket unheld.
		l.locals.Hold(ctx, l.store, at, func(err error) { l.updates.Failed(updates.SettleLocal, err) })
	}
	return d
}

// errResuming is the cause of an outage a Limiter learns of from the
// script: the fleet has yet to leave its local shares.
var errResuming = errors.New("the fleet is still on its local shares after an outage, until the instant it resumes the shared bucket")

// readFailed tells the breaker of a read of e's record in the background
// that failed as unavailable: a Limiter whose callers sleep on their
// grants through an outage, taking nothing, learns of it so, and takes
// part in the hand-over when Redis is back.
func (l *Limiter) readFailed(e *control.Entry, err error) {
	if l.off(joins) || !l.unavailable(err) {
		return
	}
	l.breaker.Trip(e.Name(), l.asking(func(ctx context.Context) error {
		_, err := l.controls.ReadNow(ctx, e)
		return err
	}), err)
}

// registerSlots holds in Redis the concurrency slots in use here that it
// does not hold: those the policy granted, and those Redis lost during the
// outage. It runs once Redis answers, and again as the breaker closes, so
// that the slots in use across the fleet are counted before any is granted
// from Redis.
func (l *Limiter) registerSlots() error {
	if !registerAtResume {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), breaker.ProbeTimeout)
	defer cancel()
	if err := l.slots.Register(ctx); err != nil && l.unavailable(err) {
		return err
	}
	return nil
}

// registerAtResume is off only in tests: the slots in use are held in
// Redis again only as their renewals come.
var registerAtResume = true

// closed runs as the breaker closes: the shared bucket and slots serve
// again, and the callers waiting for a slot of the local share ask Redis.
func (l *Limiter) closed() {
	l.locals.Reset()
	l.slots.Shared()
}
