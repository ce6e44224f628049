package quota

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// The probe's timing while Redis is unavailable: it backs off from
// probeMinBackoff to probeMaxBackoff, so that Redis is found again within
// about half a second of answering, and it gives each try probeTimeout.
const (
	probeMinBackoff = 50 * time.Millisecond
	probeMaxBackoff = 500 * time.Millisecond
	probeTimeout    = 2 * time.Second
)

// remindEvery is how often, at most, a Limiter repeats that it is degraded.
// probeIdle is how long the probe goes on without a request before it stops;
// the next request starts it again, so an abandoned Limiter leaves nothing
// running.
const (
	remindEvery = time.Minute
	probeIdle   = time.Minute
)

// health is a Limiter's breaker in front of Redis. After a Redis call fails
// as unavailable, requests go straight to the Policy, paying no Redis
// timeout, while one background probe at a time asks Redis with backoff;
// when Redis answers, the shared bucket takes over again. Every change of
// mode is logged once, and a reminder at most once a minute while degraded.
type health struct {
	l           *Limiter
	client      string // the Redis address(es), for the logs
	remindEvery time.Duration

	state   atomic.Int32 // a Mode
	served  atomic.Int64 // requests the policy let through in this outage
	refused atomic.Int64 // requests the policy refused in this outage
	probing atomic.Bool  // a probe is running
	used    atomic.Int64 // when the policy last served a request, unix ns

	mu       sync.Mutex
	cause    error
	since    time.Time
	reminded time.Time
}

func (h *health) init(l *Limiter, rdb redis.Scripter) {
	h.l = l
	h.client = describeClient(rdb)
	if l.cfg.name != "" {
		h.client = l.cfg.name + " (" + h.client + ")"
	}
	h.remindEvery = remindEvery
}

func (h *health) mode() Mode { return Mode(h.state.Load()) }

func (h *health) lastCause() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.cause
}

// trip records that a call on bucket b failed as unavailable. The first
// caller to trip switches the Limiter to its Policy's mode, logs it and
// starts the probe; later callers find the mode already switched.
func (h *health) trip(b bucket, cause error) {
	mode := h.l.cfg.policy.mode()
	if !h.state.CompareAndSwap(int32(ModeShared), int32(mode)) {
		return
	}
	now := time.Now()
	h.mu.Lock()
	h.cause, h.since, h.reminded = cause, now, now
	h.mu.Unlock()
	h.served.Store(0)
	h.refused.Store(0)
	h.touch(b)
	h.l.cfg.logger.LogAttrs(context.Background(), levelFor(mode), "quota: Redis unavailable, "+describeMode(mode),
		slog.String("redis", h.client),
		slog.String("key", b.name),
		slog.String("policy", h.l.cfg.policy.String()),
		slog.String("mode", mode.String()),
		slog.String("cause", cause.Error()),
	)
}

// touch notes that the policy is serving a request on bucket b and makes
// sure a probe is running.
func (h *health) touch(b bucket) {
	h.used.Store(time.Now().UnixNano())
	if h.probing.CompareAndSwap(false, true) {
		go h.probe(b)
	}
}

// probe asks Redis, with backoff, until it answers, then hands the Limiter
// back to the shared bucket. It stops early when no request has needed the
// policy for probeIdle.
func (h *health) probe(b bucket) {
	defer h.probing.Store(false)
	backoff := probeMinBackoff
	for {
		time.Sleep(backoff)
		if time.Since(time.Unix(0, h.used.Load())) > probeIdle {
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		if cc, ok := h.l.bucketScript.rdb.(*redis.ClusterClient); ok {
			cc.ReloadState(ctx) // learn of a failover without waiting for the periodic reload
		}
		_, _, err := h.l.call(ctx, b, opProbe, 0, 0, nil)
		cancel()
		// Redis answering at all, even with an error that is not an outage
		// (a script error, missing rights), ends the outage.
		if err == nil || !errors.Is(h.l.classify(context.Background(), err), ErrUnavailable) {
			h.recover()
			return
		}
		h.remind(err)
		backoff = min(2*backoff, probeMaxBackoff)
	}
}

func (h *health) remind(cause error) {
	h.mu.Lock()
	due := time.Since(h.reminded) >= h.remindEvery
	if due {
		h.reminded = time.Now()
		h.cause = cause
	}
	since := h.since
	h.mu.Unlock()
	if !due {
		return
	}
	mode := h.mode()
	h.l.cfg.logger.LogAttrs(context.Background(), levelFor(mode), "quota: Redis still unavailable, "+describeMode(mode),
		slog.String("redis", h.client),
		slog.String("policy", h.l.cfg.policy.String()),
		slog.String("mode", mode.String()),
		slog.Duration("for", time.Since(since).Round(time.Millisecond)),
		slog.Int64("served", h.served.Load()),
		slog.Int64("refused", h.refused.Load()),
		slog.String("cause", cause.Error()),
	)
}

func (h *health) recover() {
	h.mu.Lock()
	since := h.since
	h.mu.Unlock()
	h.l.settleLocal()
	h.state.Store(int32(ModeShared))
	h.l.locals.reset()
	h.l.cfg.logger.LogAttrs(context.Background(), slog.LevelInfo, "quota: Redis available again, the shared bucket resumed",
		slog.String("redis", h.client),
		slog.Duration("after", time.Since(since).Round(time.Millisecond)),
		slog.Int64("served", h.served.Load()),
		slog.Int64("refused", h.refused.Load()),
	)
}

// levelFor is ERROR where the outage stops or unlimits traffic, WARN where
// the local fallback keeps it moving within the limit.
func levelFor(m Mode) slog.Level {
	if m == ModeLocal {
		return slog.LevelWarn
	}
	return slog.LevelError
}

func describeMode(m Mode) string {
	switch m {
	case ModeLocal:
		return "requests now use this process's local share of each limit"
	case ModeOpen:
		return "requests now pass UNLIMITED"
	}
	return "requests now fail"
}

// describeClient names the Redis servers of rdb for the logs.
func describeClient(rdb redis.Scripter) string {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().Addr
	case *redis.ClusterClient:
		return strings.Join(c.Options().Addrs, ",")
	case *redis.Ring:
		return "ring"
	}
	return "redis"
}
