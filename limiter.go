package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
	"go.opentelemetry.io/otel"
)

// refundTimeout bounds the Redis call that hands tokens back after a
// cancelled wait; the caller does not wait for it.
const refundTimeout = time.Second

// A Limiter takes tokens from buckets kept in Redis and shared by every
// Limiter that uses the same Redis and prefix, across goroutines, processes
// and hosts. Each bucket has a name and is a key in Redis; its Limit
// travels with each call, so all callers of one bucket must pass the same
// Limit.
//
// While Redis is unavailable the Limiter's Policy serves requests, and a
// background probe finds out when Redis answers again; Mode tells which is
// the case.
//
// A Limiter is safe for concurrent use. Most callers want a Transport, which
// waits for a token before each HTTP request; Wait serves everything else,
// and Allow takes a token only if there is one now.
type Limiter struct {
	cfg        config
	store      *store.Store
	obs        observer
	breaker    *breaker.Breaker
	handOver   bool // FallbackLocal's coordinated resume (off only in tests)
	locals     local.Shares
	workers    local.Workers
	updates    updates
	slots      *slots.Slots
	localSlots local.Slots
	resume     *local.Resume
	events     *redisx.Listener
	controls   *control.Controls
}

// NewLimiter returns a Limiter that keeps its buckets in rdb, which may be a
// *redis.Client, *redis.ClusterClient, *redis.Ring or a failover client.
// It panics if rdb is nil.
func NewLimiter(rdb redis.Scripter, opts ...Option) *Limiter {
	all := make([]TransportOption, len(opts))
	for i, o := range opts {
		all[i] = o
	}
	return newLimiter(rdb, newConfig(all))
}

func newLimiter(rdb redis.Scripter, cfg config) *Limiter {
	if rdb == nil {
		panic("quota: NewLimiter with a nil Redis client")
	}
	l := &Limiter{
		cfg: cfg,
		store: store.NewStore(rdb, store.Options{
			Channel:  cfg.prefix + control.Channel,
			Clock:    cfg.clock,
			MaxWait:  cfg.maxWait,
			Batching: !cfg.noBatching,
			Hold:     !cfg.dryRun, // a dry run never delays
		}),
		obs:    newObserver(cfg),
		resume: local.NewResume(rdb, cfg.prefix),
		events: redisx.NewListener(rdb, cfg.prefix+control.Channel, controlIdle),
	}
	l.slots = slots.New(rdb, l.events, cfg.prefix+control.Channel, cfg.clock, cfg.slotLease, cfg.logger)
	l.controls = control.New(l.store.Script(), cfg.prefix+control.Channel, cfg.clock, l.events)
	l.events.Handle(redisx.Handlers{
		Message: l.announced,
		Started: l.controls.Resync,
		Stopped: l.controls.Forget,
	})
	client := redisx.Describe(rdb)
	if cfg.name != "" {
		client = cfg.name + " (" + client + ")"
	}
	l.handOver = true
	l.breaker = breaker.New(breaker.Config{
		Client:      client,
		Policy:      cfg.policy.String(),
		Logger:      cfg.logger,
		RemindEvery: remindEvery,
		Idle:        probeIdle,
		Open:        int32(cfg.policy.mode()),
		Name:        func(m int32) string { return Mode(m).String() },
		Describe:    func(m int32) string { return describeMode(Mode(m), cfg.dryRun) },
		Level:       func(m int32) slog.Level { return levelFor(Mode(m)) },
		ResumeIn:    l.resumeIn,
		Closing:     l.settleLocal,
		Closed:      l.locals.Reset,
	})
	if cfg.policy.countWorkers {
		l.workers.Count(rdb, cfg.prefix, cfg.clock)
	}
	mp := cfg.meterProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	l.updates.init(cfg, client, mp.Meter(ScopeName))
	name := cfg.name
	if name == "" {
		name = client
	}
	observeMode(l, mp, name)
	return l
}

// Wait is shorthand for WaitN(ctx, name, 1, lim).
func (l *Limiter) Wait(ctx context.Context, name string, lim Limit) error {
	return l.WaitN(ctx, name, 1, lim)
}

// WaitN blocks until n tokens of the bucket called name, refilled at lim,
// are the caller's. It asks Redis once: the script takes the tokens at
// once, possibly into debt, and replies how long until they accrue; WaitN
// sleeps that long and returns. Callers of one bucket are served in the
// order their calls reached Redis, across the whole fleet.
//
// A bucket can obey further Limits at once, its layers, as providers
// publish them: PerSecond(10) and PerMinute(300) and PerDay(10000). One
// script call checks every layer and takes n tokens from all of them or
// from none; the wait is the longest of the layers'. The first Limit lives
// under the bucket's key and each layer under a key of its own in the same
// Redis Cluster slot.
//
// A caller whose ctx has a deadline gets its place in the queue however
// long the wait, as long as it ends before the deadline; when it would end
// after, WaitN takes nothing and returns at once an error matching
// ErrWouldExceedDeadline and context.DeadlineExceeded. A caller without a
// deadline is bounded by the MaxWait option (5s by default) instead: when
// its wait would be longer, WaitN takes nothing, sleeps MaxWait and asks
// again, so callers that came later may be served first. Give ctx a
// deadline to keep a place in a long queue. When ctx ends during the
// sleep, the tokens are handed back to the bucket and WaitN returns ctx's
// error.
//
// An invalid lim, n or name fails at once, without a Redis call, with an
// error matching ErrInvalidLimit, ErrInvalidTokens, ErrExceedsBurst or
// ErrInvalidKey. While Redis is unavailable, the Limiter's Policy decides.
func (l *Limiter) WaitN(ctx context.Context, name string, n float64, lim Limit, layers ...Limit) error {
	_, err := l.acquire(ctx, name, ask{n: n, lims: limits(lim, layers)})
	return err
}

// Allow is shorthand for AllowN(ctx, name, 1, lim).
func (l *Limiter) Allow(ctx context.Context, name string, lim Limit) (bool, error) {
	return l.AllowN(ctx, name, 1, lim)
}

// AllowN reports whether n tokens of the bucket called name, refilled at
// lim and obeying its layers (see WaitN), are available now, and takes
// them if they are. It never waits: it asks Redis once, and a take that
// would have to wait takes nothing and reports false. A bucket that a
// provider's Retry-After paused has no tokens available.
//
// Invalid input fails as in WaitN, without a Redis call. While Redis is
// unavailable the Policy decides: FailOpen reports true, FailClosed false
// with an error matching ErrUnavailable, and FallbackLocal whether this
// process's local share has the tokens now.
func (l *Limiter) AllowN(ctx context.Context, name string, n float64, lim Limit, layers ...Limit) (bool, error) {
	_, err := l.acquire(ctx, name, ask{n: n, lims: limits(lim, layers), noWait: true})
	if errors.Is(err, ErrWouldWait) {
		return false, nil
	}
	return err == nil, err
}

// limits is lim followed by its layers.
func limits(lim Limit, layers []Limit) []Limit {
	if len(layers) == 0 {
		return []Limit{lim}
	}
	return append([]Limit{lim}, layers...)
}

// ask is what one acquisition asks for: n tokens from each of the layers
// lims, and, when slots is above zero, one of the bucket's slots; at once
// or not at all when noWait is set (AllowN, WithNoWait), failing with
// ErrWouldWait otherwise.
type ask struct {
	n      float64
	lims   []Limit
	slots  int
	noWait bool
}

// acquire serves an ask on the bucket called name: the one acquisition
// path. It takes the slot first and then the tokens, so that the grant is
// fresh when the request goes: a caller never sends on tokens taken before
// it waited for a slot, and so never on a grant that a pause or a change
// of the Limit overtook meanwhile. Under WithDryRun it records what it
// would have done and returns at once, with an error only when ctx has
// ended, holding a slot only if one was free.
func (l *Limiter) acquire(ctx context.Context, name string, o ask) (_ *Slot, err error) {
	ctx, span := l.obs.start(ctx, name, o.n)
	span.mode, span.dryRun = l.mode(), l.cfg.dryRun
	defer func() {
		span.end(err)
		if span.dryRun && err != nil && outcome(err) != outcomeCancelled {
			err = nil // measured, not enforced
		}
	}()

	b, err := l.bucket(name, o.lims)
	if err != nil {
		return nil, err
	}
	if b, err = l.controlled(ctx, &span, b); err != nil {
		return nil, err
	}
	span.limit(b.limit(0))
	if err := b.checkTokens(o.n); err != nil {
		return nil, err
	}
	if o.slots == 0 {
		return nil, l.waitTokens(ctx, &span, b, o)
	}
	if err := checkSlots(o.slots); err != nil {
		return nil, err
	}
	// A pause the caller is to wait out, it waits out before it queues for
	// a slot, so as not to hold one idle meanwhile.
	if err := l.awaitPause(ctx, &span, b, &o); err != nil {
		return nil, err
	}
	slot, err := l.acquireSlot(ctx, &span, b, o.slots, o.noWait || span.dryRun)
	switch {
	case err == slots.ErrNone && span.dryRun:
		slot = nil // measured: it would have waited for a slot
	case err == slots.ErrNone:
		return nil, fmt.Errorf("%w: every one of %q's %d slots is in use", ErrWouldWait, name, o.slots)
	case err != nil:
		return nil, err
	}
	if err := l.waitTokens(ctx, &span, b, o); err != nil {
		slot.Release()
		return nil, err
	}
	return slot, nil
}

// waitTokens waits for o.n tokens of bucket b, under its control record as
// the Limiter knows it when it asks. Every way back into its loop either
// sleeps or changes mode: it never calls Redis twice without a pause.
func (l *Limiter) waitTokens(ctx context.Context, span *waitSpan, b bucket, o ask) error {
	name := b.Name
	for {
		if b.ctl != nil {
			b = b.under(b.ctl)
			span.limit(b.limit(0))
		}
		if err := b.checkTokens(o.n); err != nil {
			return err
		}
		if err := l.awaitPause(ctx, span, b, &o); err != nil {
			return err
		}
		if mode := l.mode(); mode != ModeShared {
			span.mode = mode
			l.degraded(b)
			wait, err := l.degradedWait(ctx, b, o.n, mode, o.noWait)
			span.wait = wait
			if err == errAskAgain {
				continue // slept MaxWait: Redis may be back by now
			}
			return err
		}
		maxWait, deadline := l.maxWait(ctx)
		if o.noWait {
			maxWait = 0
		}
		g, err := l.store.Take(ctx, b.Bucket, o.n, maxWait)
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
		l.workers.Heartbeat()
		if g.Granted {
			if l.cfg.policy.mode() == ModeLocal {
				l.locals.Granted(b.Keys[0], g.Wait)
			}
			if span.dryRun {
				span.wait = g.Wait
				return nil
			}
			moved, err := l.sleepOn(ctx, b, g)
			if err != nil {
				tats := g.Tats
				if moved != 0 && tats != nil {
					tats = slices.Clone(tats)
					for i := range tats {
						tats[i] += moved.Microseconds()
					}
				}
				go l.refund(context.WithoutCancel(ctx), b, o.n, tats)
				if err == ErrWouldExceedDeadline {
					return fmt.Errorf("%w: a pause moved %q's grant by %v", ErrWouldExceedDeadline, name, moved)
				}
				return err
			}
			return nil
		}
		if g.Wait < 0 {
			// Paused until a resume, which the Limiter had not heard of:
			// it reads the record, and waits for the pause as the callers
			// after it will. Should the record say otherwise, it takes
			// again minRetry later, not at once.
			switch {
			case o.noWait:
				return fmt.Errorf("%w: %q is paused until resumed", ErrWouldWait, name)
			case span.dryRun:
				return nil
			}
			if b.ctl != nil {
				sent, err := l.controls.ReadNow(ctx, b.ctl)
				if sent {
					span.trips++
				}
				if err != nil {
					return l.classify(ctx, err)
				}
				if _, _, paused := b.ctl.Load().PausedAt(time.Now()); paused {
					continue
				}
			}
			if err := sleep(ctx, minRetry); err != nil {
				return err
			}
			continue
		}
		switch {
		case o.noWait:
			return fmt.Errorf("%w: %q needs %v", ErrWouldWait, name, g.Wait)
		case deadline:
			return fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, name, g.Wait)
		case span.dryRun:
			// Enforced, the caller would sleep MaxWait and ask again: its
			// wait would be about what the script replied, at least that.
			span.wait = g.Wait
			return nil
		}
		if err := sleep(ctx, maxWait); err != nil {
			return err
		}
	}
}

// recordFailure records, under dry run, an acquisition that failed with
// err before it had a bucket to take from.
func (l *Limiter) recordFailure(ctx context.Context, err error) {
	_, span := l.obs.start(ctx, "", 1)
	span.mode, span.dryRun = l.mode(), l.cfg.dryRun
	span.end(err)
}

// announced hands on an announcement on the prefix's control channel: a
// bucket's key, whose control record changed, or "s <key> <id>...", the
// concurrency slots handed to those waiters. A Limiter listens on that one
// channel while it is in use (see redisx.Listener).
func (l *Limiter) announced(payload string) {
	if rest, ok := strings.CutPrefix(payload, "s "); ok {
		if fields := strings.Fields(rest); len(fields) > 1 {
			l.slots.Handed(fields[0], fields[1:])
		}
		return
	}
	l.controls.Announced(payload)
}

// Mode returns how the Limiter grants tokens now: ModeShared while Redis is
// healthy, the Policy's mode while it is not. A service can report it on its
// health endpoint.
func (l *Limiter) Mode() Mode { return l.mode() }

func (l *Limiter) mode() Mode { return Mode(l.breaker.Mode()) }

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

// prober returns the breaker's question to Redis about b (see ask).
func (l *Limiter) prober(b bucket) func(context.Context) error {
	return func(ctx context.Context) error { return l.ask(ctx, b) }
}

// levelFor is ERROR where the outage stops or unlimits traffic, WARN where
// the local fallback keeps it moving within the limit.
func levelFor(m Mode) slog.Level {
	if m == ModeLocal {
		return slog.LevelWarn
	}
	return slog.LevelError
}

// describeMode says what the policy does to requests in mode m.
func describeMode(m Mode, dryRun bool) string {
	var s string
	switch m {
	case ModeLocal:
		s = "requests now use this process's local share of each limit"
	case ModeOpen:
		s = "requests now pass UNLIMITED"
	default:
		s = "requests now fail"
	}
	if dryRun {
		s += " (dry run: measured, not enforced)"
	}
	return s
}

// bucket returns the bucket called name with layers lims, validated and
// resolved, without asking Redis anything.
func (l *Limiter) bucket(name string, lims []Limit) (bucket, error) {
	return newBucket(l.cfg.prefix, name, lims)
}

// errAskAgain tells acquire that the policy slept MaxWait without granting.
var errAskAgain = errors.New("quota: ask again")

// degradedWait serves a request by the Policy while Redis is unavailable,
// taking only tokens available now when noWait is set, and returns how long
// the request waited, or under dry run would have.
func (l *Limiter) degradedWait(ctx context.Context, b bucket, n float64, mode Mode, noWait bool) (time.Duration, error) {
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

// ask is the breaker's question to Redis: it returns nil when Redis
// answered, even with an error that is not an outage (a script error,
// missing rights), since that ends the outage too.
func (l *Limiter) ask(ctx context.Context, b bucket) error {
	redisx.ReloadCluster(ctx, l.store.Script().Client()) // learn of a failover now
	err := l.store.Probe(ctx, b.Bucket)
	if err != nil && errors.Is(l.classify(context.Background(), err), ErrUnavailable) {
		return err
	}
	return nil
}

// refund hands n tokens taken at tats back to the bucket after the caller
// gave up waiting for them.
func (l *Limiter) refund(ctx context.Context, b bucket, n float64, tats []int64) {
	ctx, cancel := context.WithTimeout(ctx, refundTimeout)
	defer cancel()
	if err := l.store.Refund(ctx, b.Bucket, n, tats); err == nil {
		l.obs.refunds.Add(ctx, 1)
	}
}

// maxWait returns how long the caller accepts to wait: until ctx's
// deadline when it has one, however far, so that the caller keeps its
// place in the queue; MaxWait otherwise. deadline tells which.
func (l *Limiter) maxWait(ctx context.Context) (wait time.Duration, deadline bool) {
	if d, ok := ctx.Deadline(); ok {
		return max(time.Until(d), 0), true
	}
	return l.cfg.maxWait, false
}

// classify turns an error of a Redis call into the error a caller gets
// (see classify).
func (l *Limiter) classify(ctx context.Context, err error) error {
	return classify(ctx, err, l.store.Cluster())
}

// sleep waits for d or until ctx ends, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
