package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/store"
)

// A Mode is how a Limiter grants tokens at the moment.
type Mode int

const (
	// ModeShared grants from the shared bucket in Redis: the normal mode.
	ModeShared Mode = iota
	// ModeLocal grants from a limiter in this process while Redis is
	// unavailable (FallbackLocal).
	ModeLocal
	// ModeOpen lets every request through while Redis is unavailable
	// (FailOpen).
	ModeOpen
	// ModeClosed refuses every request while Redis is unavailable
	// (FailClosed).
	ModeClosed
)

// String returns the mode's name as it appears in logs and telemetry.
func (m Mode) String() string {
	switch m {
	case ModeShared:
		return "shared"
	case ModeLocal:
		return "local"
	case ModeOpen:
		return "open"
	case ModeClosed:
		return "closed"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// A Policy decides what a Limiter does with requests while Redis is
// unavailable. The zero Policy is FailClosed.
type Policy struct {
	degraded     Mode // the mode while Redis is unavailable
	workers      int  // FallbackLocal's divisor, or its floor when counting
	countWorkers bool
}

var (
	// FailClosed refuses requests with an error wrapping ErrUnavailable
	// while Redis is unavailable. It is the default: without Redis a worker
	// cannot know what the rest of the fleet sends, and refusing is the only
	// choice that cannot breach the provider's limit.
	FailClosed = Policy{degraded: ModeClosed}

	// FailOpen lets requests through, unlimited, while Redis is unavailable.
	// A Redis outage then becomes a breach of the provider's limit unless
	// something else holds the rate down; choose it only where a breach
	// costs less than a stop.
	FailOpen = Policy{degraded: ModeOpen}
)

// FallbackLocal grants from a limiter in each process while Redis is
// unavailable, at each bucket's Rate and Burst divided by workers, the
// number of processes that share the buckets. It keeps the fleet moving at
// a reduced rate; the fleet stays within the limit as long as no more than
// workers processes run.
//
// A local share starts empty when the outage begins, and only after the
// last grant this process had from the shared bucket falls due, so the
// change of mode adds no burst of its own. A share of the burst below one
// token is rounded up to one. It panics if workers is less than 1.
func FallbackLocal(workers int) Policy {
	if workers < 1 {
		panic(fmt.Sprintf("quota: FallbackLocal(%d): want at least one worker", workers))
	}
	return Policy{degraded: ModeLocal, workers: workers}
}

// CountingWorkers returns a FallbackLocal policy that divides by the number
// of workers it saw alive while Redis was healthy, instead of a fixed guess,
// with p's worker count as the floor. Each Limiter announces itself in Redis
// every few seconds while it is in use; the divisor is the largest count
// seen in the last ten minutes, and it does not fall while Redis is down, so
// a count gone stale errs towards dividing by too many. A Limiter that never
// saw a count (Redis was down from its start) divides by the floor. Workers
// that start during an outage are not counted by the others: set the floor
// to the most workers that may run. It panics unless p is a FallbackLocal
// policy.
func (p Policy) CountingWorkers() Policy {
	if p.degraded != ModeLocal {
		panic("quota: CountingWorkers of a policy that is not FallbackLocal")
	}
	p.countWorkers = true
	return p
}

// String names the policy as it appears in logs.
func (p Policy) String() string {
	switch p.mode() {
	case ModeOpen:
		return "fail open"
	case ModeLocal:
		if p.countWorkers {
			return fmt.Sprintf("fallback local (counted workers, at least %d)", p.workers)
		}
		return fmt.Sprintf("fallback local (%d workers)", p.workers)
	}
	return "fail closed"
}

func (p Policy) mode() Mode {
	if p.degraded == ModeShared {
		return ModeClosed
	}
	return p.degraded
}

// The breaker's timing: it repeats that Redis is unavailable at most every
// remindEvery, and its probe goes on without a request for probeIdle
// before it stops, so that an abandoned Limiter leaves nothing running
// (variables for the tests).
var (
	remindEvery = time.Minute
	probeIdle   = time.Minute
)

// trip tells the breaker that a call on b failed with err, which says that
// Redis is unavailable.
func (l *Limiter) trip(b bucket, err error) { l.breaker.Trip(b.Name, l.prober(b), err) }

// degraded tells the breaker that the policy serves a request on b.
func (l *Limiter) degraded(b bucket) { l.breaker.Touch(l.prober(b)) }

// prober returns the breaker's probe of Redis about b (see asking).
func (l *Limiter) prober(b bucket) func(context.Context) error {
	return l.asking(func(ctx context.Context) error { return l.store.Probe(ctx, b.Bucket) })
}

// asking returns the breaker's probe that asks Redis with call, having
// it learn of a failover first. Redis answered when call returns nil, or
// an error that is not an outage (a script error, missing rights), which
// ends the outage too: the probe then waits for the instant the fleet
// resumes the shared bucket, the policy serving meanwhile, and hands the
// local shares over to it. The breaker stays open when the hand-over
// fails: Redis may have gone again.
func (l *Limiter) asking(call func(context.Context) error) func(context.Context) error {
	return func(ctx context.Context) error {
		redisx.ReloadCluster(ctx, l.store.Client()) // learn of a failover now
		if err := call(ctx); err != nil && l.unavailable(err) {
			return err
		}
		time.Sleep(l.resumeIn(ctx))
		return l.settleLocal()
	}
}

// unavailable reports whether err, the error of a call in the
// background, says that Redis is unavailable (see classify).
func (l *Limiter) unavailable(err error) bool {
	return errors.Is(l.classify(context.Background(), err), ErrUnavailable)
}

// changed logs a change of the breaker's state, idle being its probe's
// idle time; as the breaker closes, the shared bucket and slots serve
// again first (see closed).
func (l *Limiter) changed(c breaker.Change, idle time.Duration) {
	if c.Event != breaker.Tripped && c.Event != breaker.Reminded {
		l.closed()
	}
	mode := l.cfg.policy.mode()
	level, msg, attrs := breaker.Record(c, breaker.Policy{Name: l.cfg.policy.String(), Mode: mode.String(),
		Local: mode == ModeLocal, Open: mode == ModeOpen, DryRun: l.cfg.dryRun}, l.client, idle)
	l.cfg.logger.LogAttrs(context.Background(), level, msg, attrs...)
}

// degradedWait serves a request by the Policy while Redis is unavailable,
// taking only tokens available now when noWait is set, and returns how long
// the request waited, or under dry run would have.
func (l *Limiter) degradedWait(ctx context.Context, b bucket, n store.Cost, mode Mode, noWait bool) (time.Duration, error) {
	switch mode {
	case ModeOpen:
		l.breaker.Served()
		return 0, nil
	case ModeLocal:
		return l.localWait(ctx, b, n, noWait)
	}
	l.breaker.Refused()
	return 0, fmt.Errorf("%w: %w", ErrUnavailable, l.breaker.Cause())
}

// classify turns an error of a Redis call into the error a caller gets
// (see classify). It logs the first ErrNoPermission: no change of mode
// reports it, since the policy does not serve such calls.
func (l *Limiter) classify(ctx context.Context, err error) error {
	cerr := classify(ctx, err, l.store.Cluster())
	if errors.Is(cerr, ErrNoPermission) && l.deniedLogged.CompareAndSwap(false, true) {
		l.cfg.logger.LogAttrs(context.Background(), slog.LevelError,
			"quota: the Redis user lacks a permission or cannot log in; its calls fail with ErrNoPermission",
			slog.String("redis", l.client),
			slog.String("cause", err.Error()),
		)
	}
	return cerr
}

// mode is ModeShared while the breaker is closed, the policy's mode while
// it is open.
func (l *Limiter) mode() Mode {
	if l.breaker.Open() {
		return l.cfg.policy.mode()
	}
	return ModeShared
}
