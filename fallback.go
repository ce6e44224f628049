package quota

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/store"
	"golang.org/x/time/rate"
)

// localWait waits for n from this process's share of every layer, or
// takes it only if the shares have it now when noWait is set, and returns
// how long it waited, or under dry run would have.
func (l *Limiter) localWait(ctx context.Context, b bucket, n store.Cost, noWait bool) (time.Duration, error) {
	now := time.Now()
	var delay time.Duration
	var rs []*rate.Reservation
	cancel := func() {
		for _, r := range rs {
			r.CancelAt(now)
		}
	}
	for i, lim := range b.Lims {
		tokens := int(math.Ceil(n.Of(i)))
		if tokens == 0 {
			continue // a meter asked nothing
		}
		rl, err := l.locals.Get(b.Name, b.Keys[0], b.Keys[i], local.Limit(lim), l.workers.Divisor(l.cfg.policy.workers))
		if err != nil {
			cancel()
			l.breaker.Refused()
			return 0, fmt.Errorf("%w: %w", ErrUnavailable, err)
		}
		if tokens > rl.Burst() {
			cancel()
			l.breaker.Refused()
			return 0, fmt.Errorf("%w: %d tokens exceed this worker's local share of the burst, %d", ErrUnavailable, tokens, rl.Burst())
		}
		r := rl.ReserveN(now, tokens)
		rs = append(rs, r)
		delay = max(delay, r.DelayFrom(now))
	}
	maxWait, deadline := l.maxWait(ctx)
	if noWait {
		maxWait = 0
	}
	if delay > maxWait {
		cancel()
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
		for _, r := range rs {
			r.Cancel()
		}
		return 0, err
	}
	l.breaker.Served()
	return delay, nil
}

// settleLocal hands the shared bucket, when it resumes, the state of the
// local shares: it holds at most what this worker's share holds, times the
// workers, so that a bucket Redis forgot (or kept from before the outage,
// full by now) does not release a burst on top of what the local shares
// just sent; and it is charged the tokens this worker's share promised to
// callers still sleeping, so that their grants and the shared bucket's do
// not overlap. Every worker does so at the instant the fleet agreed on
// (resumeIn), so that no worker draws on the shared bucket while another
// still spends its local share.
//
// A failure that says Redis is unavailable again is returned: the outage
// goes on. Any other is counted and logged, and leaves that bucket as
// Redis has it.
func (l *Limiter) settleLocal() error {
	if err := l.registerSlots(); err != nil {
		return err
	}
	if !l.handOver {
		return nil
	}
	workers := float64(l.workers.Divisor(l.cfg.policy.workers))
	for _, s := range l.locals.Shares() {
		// One layer at a time, under the bucket's control record.
		b := store.Bucket{Name: s.Name, Keys: []string{s.Key}, Lims: []store.Limit{store.Limit(s.Limit)}, Call: []string{s.Key, s.First + control.Suffix}}
		ctx, cancel := context.WithTimeout(context.Background(), breaker.ProbeTimeout)
		err := l.store.Lower(ctx, b, max(s.Tokens, 0)*workers)
		if err == nil && s.Tokens < 0 {
			err = l.store.Adjust(ctx, b, store.Tokens(-s.Tokens), "")
		}
		cancel()
		if err != nil {
			if errors.Is(l.classify(context.Background(), err), ErrUnavailable) {
				return err
			}
			l.updates.failed(updateSettleLocal, err)
		}
	}
	return nil
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
	if l.cfg.policy.mode() != ModeLocal || !l.handOver {
		return 0
	}
	d, at, _ := l.resume.In(ctx, resumeDelay, l.store.Now())
	if d > 0 {
		l.holdShared(ctx, at)
	}
	return d
}

// holdShared has the buckets this Limiter's local shares served grant
// nothing before at (µs, the scripts' clock), when the fleet resumes them: a Limiter that did not
// see the outage, its callers asleep on their grants meanwhile, would
// otherwise take from the shared bucket while the others still spend
// their shares. Its takes find the instant in the bucket's control
// record, and it joins the hand-over (see granted). A failure leaves
// that bucket unheld.
func (l *Limiter) holdShared(ctx context.Context, at int64) {
	if l.noJoin {
		return
	}
	held := map[string]bool{}
	for _, s := range l.locals.Shares() {
		if held[s.First] {
			continue // one record for every layer of a bucket
		}
		held[s.First] = true
		b := store.Bucket{Name: s.Name, Keys: []string{s.First}, Lims: []store.Limit{store.Limit(s.Limit)}, Call: []string{s.First, s.First + control.Suffix}}
		if err := l.store.Resuming(ctx, b, at); err != nil {
			l.updates.failed(updateSettleLocal, err)
		}
	}
}

// errResuming is the cause of an outage a Limiter learns of from the
// script: the fleet has yet to leave its local shares.
var errResuming = errors.New("the fleet is still on its local shares after an outage, until the instant it resumes the shared bucket")

// readFailed tells the breaker of a read of e's record in the background
// that failed as unavailable: a Limiter whose callers sleep on their
// grants through an outage, taking nothing, learns of it so, and takes
// part in the hand-over when Redis is back.
func (l *Limiter) readFailed(e *control.Entry, err error) {
	if l.noJoin || !errors.Is(l.classify(context.Background(), err), ErrUnavailable) {
		return
	}
	l.breaker.Trip(e.Name(), func(ctx context.Context) error {
		redisx.ReloadCluster(ctx, l.store.Client())
		_, err := l.controls.ReadNow(ctx, e)
		if err != nil && errors.Is(l.classify(context.Background(), err), ErrUnavailable) {
			return err
		}
		return nil
	}, err)
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
	err := l.slots.Register(ctx)
	if err != nil && errors.Is(l.classify(context.Background(), err), ErrUnavailable) {
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
