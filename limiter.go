package quota

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/lines"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
	"github.com/sharedquota/quota/internal/updates"
)

// A Limiter takes tokens from buckets kept in Redis and shared by every
// Limiter that uses the same Redis and prefix, across goroutines, processes
// and hosts. Each bucket has a name and is a key in Redis; its Limit
// travels with each call, so all callers of one bucket must pass the same
// Limit. While Redis is unavailable its Policy serves requests (see Mode).
//
// A Limiter is safe for concurrent use. Most callers want a Transport, which
// waits for a token before each HTTP request; Wait serves everything else,
// and Allow takes a token only if there is one now.
type Limiter struct {
	cfg      config
	store    *store.Store
	obs      *obs.Obs
	breaker  *breaker.Breaker
	locals   local.Shares
	workers  local.Workers
	updates  *updates.Runner
	slots    *slots.Slots
	resume   *local.Resume
	events   *redisx.Listener
	controls *control.Controls
	lines    lines.Lines // the callers that wait for their tenants' turns
	client   string      // the Redis address(es), and the Limiter's name, for the logs

	deniedLogged atomic.Bool // an ErrNoPermission was logged (see classify)
}

// A mechanism is one that a test's negative control turns off in a
// Limiter, to show what it prevents.
type mechanism uint8

const (
	handOver mechanism = iota // FallbackLocal's coordinated resume
	joins                     // a part in a hand-over the Limiter did not see
	pushes                    // the pushes of higher priorities, heeded by sleepers
	charges                   // settles charging tenants for what they used
)

// turnedOff is set by the tests alone: in a program, every mechanism is on.
var turnedOff func(*Limiter, mechanism) bool

func (l *Limiter) off(m mechanism) bool { return turnedOff != nil && turnedOff(l, m) }

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
	o, meter := newObs(cfg)
	l := &Limiter{
		cfg: cfg,
		store: store.NewStore(rdb, store.Options{
			Channel:  cfg.prefix + control.Channel,
			Clock:    cfg.clock,
			MaxWait:  cfg.maxWait,
			Batching: !cfg.noBatching,
			Hold:     !cfg.dryRun, // a dry run never delays
		}),
		obs:    o,
		resume: local.NewResume(rdb, cfg.prefix),
		events: redisx.NewListener(rdb, cfg.prefix+control.Channel, controlIdle),
	}
	l.slots = slots.New(rdb, l.events, slots.Options{
		Channel: cfg.prefix + control.Channel,
		Clock:   cfg.clock,
		Lease:   cfg.slotLease,
		Rejoin:  resumeDelay,
		Logger:  cfg.logger,
		Obs:     o,
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
	l.client = client
	l.controls.OnFailure(l.readFailed)
	l.controls.OnRead(l.slots.Lingering, func() bool { return l.mode() == ModeShared })
	l.controls.OnLearned(cfg.logger, l.obs.Learned)
	l.slots.OnLinger(l.controls.Tell)
	idle := probeIdle
	l.breaker = breaker.New(breaker.Config{
		RemindEvery: remindEvery,
		Idle:        idle,
		OnChange:    func(c breaker.Change) { l.changed(c, idle) },
	})
	if cfg.policy.countWorkers {
		l.workers.Count(rdb, cfg.prefix, cfg.clock)
	}
	l.updates = updates.New(o, cfg.logger, client)
	name := cfg.name
	if name == "" {
		name = client
	}
	observeMode(l, meter, name)
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
	_, err := l.acquire(ctx, name, ask{n: n, lims: append([]Limit{lim}, layers...), class: -1})
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
	_, err := l.acquire(ctx, name, ask{n: n, lims: append([]Limit{lim}, layers...), noWait: true, class: -1})
	if errors.Is(err, ErrWouldWait) {
		return false, nil
	}
	return err == nil, err
}

// announced hands on an announcement on the prefix's control channel
// (see control.Parse), on which a Limiter listens while it is in use (see
// redisx.Listener).
func (l *Limiter) announced(payload string) {
	switch a := control.Parse(payload); a.Kind {
	case control.Changed:
		l.controls.Announced(a.Key)
	case control.Handed:
		l.slots.Handed(a.Key, strings.Fields(a.Body))
	case control.GaveBack:
		l.controls.GaveBack(a.Key, a.Body)
		l.lines.GaveBack(a.Key)
	case control.Pushed:
		l.controls.Pushed(a.Key, a.Body)
	}
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
// ride on the process's next call for their bucket, the grants Status
// counts, told within half a second, and the updates that responses
// cause (pauses, lowered buckets, settles), which run in the background. Call it before the process exits: a release it never sends
// leaves its slot held until the slot's lease ends (WithSlotLease).
//
// It returns nil once nothing is left to send, or ctx's error. Lingering
// slots (WithSlotLinger) are not ended early. The Limiter stays usable,
// and what callers do meanwhile is waited for too.
func (l *Limiter) Flush(ctx context.Context) error {
	if err := l.slots.Flush(ctx); err != nil {
		return err
	}
	if err := l.controls.Report(ctx); err != nil {
		return err
	}
	return l.updates.Wait(ctx)
}

// bucket returns the bucket called name with layers lims (each metering
// a thing of its own, with meters), validated and resolved, without
// asking Redis anything.
func (l *Limiter) bucket(name string, lims []Limit, meters ...string) (bucket, error) {
	return newBucket(l.cfg.prefix, name, lims, meters...)
}
