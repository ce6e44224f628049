package quota

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
	"go.opentelemetry.io/otel"
)

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
	cfg      config
	store    *store.Store
	obs      observer
	breaker  *breaker.Breaker
	handOver bool // FallbackLocal's coordinated resume (off only in tests)
	noJoin   bool // tests only: takes no part in a hand-over it did not see (see joins)
	noPushes bool // tests only: its sleepers ignore the pushes of higher priorities (see pushedBack)
	noCharge bool // tests only: its settles leave the tenants' shares as reserved (see charge)
	locals   local.Shares
	workers  local.Workers
	updates  updates
	slots    *slots.Slots
	resume   *local.Resume
	events   *redisx.Listener
	controls *control.Controls
	lines    lines // the callers that wait for their tenants' turns

	deniedLogged atomic.Bool // an ErrNoPermission was logged (see classify)
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
	l.slots = slots.New(rdb, l.events, slots.Options{
		Channel: cfg.prefix + control.Channel,
		Clock:   cfg.clock,
		Lease:   cfg.slotLease,
		Rejoin:  resumeDelay,
		Logger:  cfg.logger,
		Bucket:  store.TakeSource(),
		Told: slots.Events{
			Handed: func(name string, n int) { l.obs.slotEvent(name, slotHanded, n) },
			Checked: func(name string, kept bool) {
				if kept {
					l.obs.slotEvent(name, slotRenewed, 1)
				} else {
					l.obs.slotEvent(name, slotLapsed, 1)
				}
			},
			Registered: func(name string, n int) { l.obs.slotEvent(name, slotRegistered, n) },
		},
	})
	l.controls = control.New(l.store, l.events)
	l.events.Handle(redisx.Handlers{
		Message: l.announced,
		Started: l.listening,
		Stopped: l.controls.Forget,
	})
	client := redisx.Describe(rdb)
	if cfg.name != "" {
		client = cfg.name + " (" + client + ")"
	}
	l.controls.OnFailure(l.readFailed)
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
		Closed:      l.closed,
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
	_, err := l.acquire(ctx, name, ask{n: n, lims: limits(lim, layers), class: -1})
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
	_, err := l.acquire(ctx, name, ask{n: n, lims: limits(lim, layers), noWait: true, class: -1})
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

// announced hands on an announcement on the prefix's control channel: a
// bucket's key, whose control record changed; "s <id>[=<grant>]...", a
// newline and a bucket's key: the concurrency slots of that bucket handed
// to those waiters, with the grants of their tokens; or "b" and each
// layer's "<suffix>=<µs>", a newline and a bucket's key: how far settles
// have moved its layers' queues back (see Controls.GaveBack); or "p", when,
// and each class's "<class>:<suffix>=<µs>", a newline and a bucket's key:
// how far takes of higher classes have pushed its lower classes' queues
// (see Controls.Pushed). A Limiter listens on that one channel while it
// is in use (see redisx.Listener).
func (l *Limiter) announced(payload string) {
	if rest, ok := strings.CutPrefix(payload, "s "); ok {
		if ids, key, ok := strings.Cut(rest, "\n"); ok {
			l.slots.Handed(key, strings.Fields(ids))
		}
		return
	}
	if rest, ok := strings.CutPrefix(payload, "b "); ok {
		if backs, key, ok := strings.Cut(rest, "\n"); ok {
			l.controls.GaveBack(key, backs)
			l.lines.gaveBack(key)
		}
		return
	}
	if rest, ok := strings.CutPrefix(payload, "p "); ok {
		if pushes, key, ok := strings.Cut(rest, "\n"); ok {
			l.controls.Pushed(key, pushes)
		}
		return
	}
	l.controls.Announced(payload)
}

// listening runs when the Limiter listens on the control channel, from
// its start or again after its connection broke: the announcements made
// meanwhile are lost. The records its callers wait on are read again, and
// its slot waiters renew (see Slots.Missed).
func (l *Limiter) listening() {
	l.controls.Resync()
	l.slots.Missed()
}

// Mode returns how the Limiter grants tokens now: ModeShared while Redis is
// healthy, the Policy's mode while it is not. A service can report it on its
// health endpoint.
func (l *Limiter) Mode() Mode { return l.mode() }

// Flush sends what the Limiter still has to tell Redis and waits for it:
// the releases of concurrency slots, which wait up to a millisecond to
// ride on the process's next call for their bucket, and the updates that
// responses cause (pauses, lowered buckets, settles), which run in the
// background. Call it before the process exits: a release it never sends
// leaves its slot held until the slot's lease ends (WithSlotLease).
//
// It returns nil once nothing is left to send, or ctx's error. Lingering
// slots (WithSlotLinger) are not ended early. The Limiter stays usable,
// and what callers do meanwhile is waited for too.
func (l *Limiter) Flush(ctx context.Context) error {
	if err := l.slots.Flush(ctx); err != nil {
		return err
	}
	return l.updates.running.Wait(ctx)
}

// bucket returns the bucket called name with layers lims (each metering
// a thing of its own, with meters), validated and resolved, without
// asking Redis anything.
func (l *Limiter) bucket(name string, lims []Limit, meters ...string) (bucket, error) {
	return newBucket(l.cfg.prefix, name, lims, meters...)
}
