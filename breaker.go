package quota

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// The probe's timing while Redis is unavailable: it backs off from
// probeMinBackoff to probeMaxBackoff, so that Redis is found again within
// about half a second of answering, and it gives each try probeTimeout.
const (
	probeMinBackoff = 50 * time.Millisecond
	probeMaxBackoff = 500 * time.Millisecond
	probeTimeout    = 2 * time.Second
)

// remindEvery is how often, at most, a breaker repeats that Redis is
// unavailable. probeIdle is how long the probe goes on without a request
// before it stops, so that an abandoned Limiter leaves nothing running.
const (
	remindEvery = time.Minute
	probeIdle   = time.Minute
)

// A breaker stands in front of Redis for a Limiter. It is closed while
// Redis answers. After a call fails as unavailable it opens: requests go
// straight to the Policy, paying no Redis timeout, while one background
// probe at a time asks Redis with backoff. When Redis answers, the breaker
// closes and the shared bucket takes over again.
//
// A probe that has had no request to serve for probeIdle stops, and the
// breaker goes half-open: it reports no outage, since nobody has checked
// for one, and the next request asks Redis itself, tripping it again if
// Redis still does not answer.
//
// Every change of state is logged once, and a reminder at most once a
// minute while open.
type breaker struct {
	policy      Policy
	client      string // the Redis address(es), for the logs
	logger      *slog.Logger
	remindEvery time.Duration
	idle        time.Duration
	dryRun      bool // WithDryRun: the policy is measured, not enforced

	// ask asks Redis about bucket b; it returns nil when Redis answered,
	// even with an error that is not an outage.
	ask func(ctx context.Context, b bucket) error
	// resumeIn returns, once Redis answers, how long until the breaker
	// closes: the instant every Limiter of the fleet leaves its policy.
	resumeIn func(ctx context.Context) time.Duration
	// closing runs when the breaker is about to close after an outage: it
	// hands the shared bucket what the policy granted. The breaker stays
	// open when it fails. closed runs after the breaker closed.
	closing func() error
	closed  func()

	state   atomic.Int32 // a Mode: ModeShared while closed or half-open
	served  atomic.Int64 // requests the policy let through in this outage
	refused atomic.Int64 // requests the policy refused in this outage
	probing atomic.Bool  // a probe is running
	used    atomic.Int64 // when the policy last served a request, unix ns

	mu       sync.Mutex
	cause    error
	since    time.Time
	reminded time.Time
}

func (br *breaker) mode() Mode { return Mode(br.state.Load()) }

func (br *breaker) lastCause() error {
	br.mu.Lock()
	defer br.mu.Unlock()
	return br.cause
}

// trip records that a call on bucket b failed as unavailable. The first
// caller to trip opens the breaker, logs it and starts the probe; later
// callers find it open already.
func (br *breaker) trip(b bucket, cause error) {
	mode := br.policy.mode()
	if !br.state.CompareAndSwap(int32(ModeShared), int32(mode)) {
		return
	}
	now := time.Now()
	br.mu.Lock()
	br.cause, br.since, br.reminded = cause, now, now
	br.mu.Unlock()
	br.served.Store(0)
	br.refused.Store(0)
	br.touch(b)
	br.logger.LogAttrs(context.Background(), levelFor(mode), "quota: Redis unavailable, "+br.describe(mode),
		slog.String("redis", br.client),
		slog.String("bucket", b.name),
		slog.String("policy", br.policy.String()),
		slog.String("mode", mode.String()),
		slog.String("cause", cause.Error()),
	)
}

// touch notes that the policy is serving a request on bucket b and makes
// sure a probe is running.
func (br *breaker) touch(b bucket) {
	br.used.Store(time.Now().UnixNano())
	if br.probing.CompareAndSwap(false, true) {
		go br.probe(b)
	}
}

// probe asks Redis, with backoff, until it answers, then closes the
// breaker at the instant the fleet agrees on, once the shared bucket has
// been told what the policy granted. It stops early, leaving the breaker
// half-open, when no request has needed the policy for br.idle.
func (br *breaker) probe(b bucket) {
	defer br.probing.Store(false)
	backoff := probeMinBackoff
	for {
		time.Sleep(backoff)
		if time.Since(time.Unix(0, br.used.Load())) > br.idle {
			br.halfOpen()
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		err := br.ask(ctx, b)
		if err == nil && br.resumeIn != nil {
			time.Sleep(br.resumeIn(ctx)) // the policy serves meanwhile
		}
		cancel()
		if err == nil && br.closing != nil {
			err = br.closing() // Redis may have gone again
		}
		if err == nil {
			br.close()
			return
		}
		br.remind(err)
		backoff = min(2*backoff, probeMaxBackoff)
	}
}

func (br *breaker) remind(cause error) {
	br.mu.Lock()
	due := time.Since(br.reminded) >= br.remindEvery
	if due {
		br.reminded = time.Now()
		br.cause = cause
	}
	since := br.since
	br.mu.Unlock()
	if !due {
		return
	}
	mode := br.mode()
	br.logger.LogAttrs(context.Background(), levelFor(mode), "quota: Redis still unavailable, "+br.describe(mode),
		slog.String("redis", br.client),
		slog.String("policy", br.policy.String()),
		slog.String("mode", mode.String()),
		slog.Duration("for", time.Since(since).Round(time.Millisecond)),
		slog.Int64("served", br.served.Load()),
		slog.Int64("refused", br.refused.Load()),
		slog.String("cause", cause.Error()),
	)
}

// close ends the outage: Redis answered.
func (br *breaker) close() {
	br.reset(slog.LevelInfo, "quota: Redis available again, the shared bucket resumed")
}

// halfOpen stops reporting an outage that nobody has checked for br.idle:
// the next request asks Redis itself.
func (br *breaker) halfOpen() {
	br.reset(slog.LevelWarn, "quota: no request for "+br.idle.String()+"; the next one asks Redis again")
}

// reset returns the breaker to the shared bucket and logs why.
func (br *breaker) reset(level slog.Level, msg string) {
	br.mu.Lock()
	since := br.since
	br.mu.Unlock()
	br.state.Store(int32(ModeShared))
	if br.closed != nil {
		br.closed()
	}
	br.logger.LogAttrs(context.Background(), level, msg,
		slog.String("redis", br.client),
		slog.Duration("after", time.Since(since).Round(time.Millisecond)),
		slog.Int64("served", br.served.Load()),
		slog.Int64("refused", br.refused.Load()),
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

// describe says what the policy does to requests in mode m.
func (br *breaker) describe(m Mode) string {
	if br.dryRun {
		return describeMode(m) + " (dry run: measured, not enforced)"
	}
	return describeMode(m)
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
