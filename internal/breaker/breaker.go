// Package breaker stands in front of Redis for a Limiter: closed while
// Redis answers, open while it does not, with one background probe that
// finds out when it answers again, and a log record for every change.
//
// It knows nothing of buckets or policies: the Limiter says which mode the
// breaker opens in and how each mode is described, and gives it the probe
// to run.
package breaker

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// The probe's timing while Redis is unavailable: it backs off from
// MinBackoff to MaxBackoff, so that Redis is found again within about half
// a second of answering, and it gives each try ProbeTimeout.
const (
	MinBackoff   = 50 * time.Millisecond
	MaxBackoff   = 500 * time.Millisecond
	ProbeTimeout = 2 * time.Second
)

// Closed is the mode of a closed (or half-open) breaker. Any other mode is
// one the breaker was opened in (see Config.Open).
const Closed int32 = 0

// Config is what a Breaker is told once, at its start.
type Config struct {
	Client      string // the Redis address(es), for the logs
	Policy      string // the policy's name, for the logs
	Logger      *slog.Logger
	RemindEvery time.Duration // how often, at most, it repeats that Redis is unavailable
	Idle        time.Duration // the probe stops after this long without a request

	// Open is the mode the breaker opens in, not Closed. Name names a
	// mode; Describe says what requests do in it; Level is the level at
	// which a change to it is logged.
	Open     int32
	Name     func(mode int32) string
	Describe func(mode int32) string
	Level    func(mode int32) slog.Level

	// ResumeIn returns, once Redis answers, how long until the breaker
	// closes: the instant every Limiter of the fleet leaves its policy.
	// Closing runs when the breaker is about to close after an outage; the
	// breaker stays open when it fails. Closed runs after it closed. Any of
	// them may be nil.
	ResumeIn func(ctx context.Context) time.Duration
	Closing  func() error
	Closed   func()
}

// A Breaker is closed while Redis answers. After a call fails as
// unavailable it opens: requests go straight to the policy, paying no
// Redis timeout, while one background probe at a time asks Redis with
// backoff. When Redis answers, the breaker closes and the shared bucket
// takes over again.
//
// A probe that has had no request to serve for Idle stops, and the breaker
// goes half-open: it reports no outage, since nobody has checked for one,
// and the next request asks Redis itself, tripping it again if Redis still
// does not answer.
//
// Every change of state is logged once, and a reminder at most once every
// RemindEvery while open.
type Breaker struct {
	cfg Config

	state   atomic.Int32 // a mode: Closed while closed or half-open
	served  atomic.Int64 // requests the policy let through in this outage
	refused atomic.Int64 // requests the policy refused in this outage
	probing atomic.Bool  // a probe is running
	used    atomic.Int64 // when the policy last served a request, unix ns

	mu       sync.Mutex
	cause    error
	since    time.Time
	reminded time.Time
}

// New returns a closed Breaker.
func New(cfg Config) *Breaker { return &Breaker{cfg: cfg} }

// Mode returns Closed, or the mode the breaker is open in.
func (br *Breaker) Mode() int32 { return br.state.Load() }

// Cause returns the error that opened the breaker, or the latest the probe
// met.
func (br *Breaker) Cause() error {
	br.mu.Lock()
	defer br.mu.Unlock()
	return br.cause
}

// Served and Refused count a request the policy served or refused.
func (br *Breaker) Served()  { br.served.Add(1) }
func (br *Breaker) Refused() { br.refused.Add(1) }

// Trip records that a call on the bucket called bucket failed as
// unavailable with cause; probe asks Redis whether it answers again. The
// first caller to trip opens the breaker, logs it and starts the probe;
// later callers find it open already.
func (br *Breaker) Trip(bucket string, probe func(context.Context) error, cause error) {
	mode := br.cfg.Open
	if !br.state.CompareAndSwap(Closed, mode) {
		return
	}
	now := time.Now()
	br.mu.Lock()
	br.cause, br.since, br.reminded = cause, now, now
	br.mu.Unlock()
	br.served.Store(0)
	br.refused.Store(0)
	br.Touch(probe)
	br.cfg.Logger.LogAttrs(context.Background(), br.cfg.Level(mode), "quota: Redis unavailable, "+br.cfg.Describe(mode),
		slog.String("redis", br.cfg.Client),
		slog.String("bucket", bucket),
		slog.String("policy", br.cfg.Policy),
		slog.String("mode", br.cfg.Name(mode)),
		slog.String("cause", cause.Error()),
	)
}

// Touch notes that the policy is serving a request and makes sure a probe
// is running, with probe.
func (br *Breaker) Touch(probe func(context.Context) error) {
	br.used.Store(time.Now().UnixNano())
	if br.probing.CompareAndSwap(false, true) {
		go br.probe(probe)
	}
}

// probe asks Redis, with backoff, until it answers, then closes the
// breaker at the instant the fleet agrees on, once Closing has succeeded.
// It stops early, leaving the breaker half-open, when no request has
// needed the policy for Idle.
func (br *Breaker) probe(ask func(context.Context) error) {
	defer br.probing.Store(false)
	backoff := MinBackoff
	for {
		time.Sleep(backoff)
		if time.Since(time.Unix(0, br.used.Load())) > br.cfg.Idle {
			br.halfOpen()
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), ProbeTimeout)
		err := ask(ctx)
		if err == nil && br.cfg.ResumeIn != nil {
			time.Sleep(br.cfg.ResumeIn(ctx)) // the policy serves meanwhile
		}
		cancel()
		if err == nil && br.cfg.Closing != nil {
			err = br.cfg.Closing() // Redis may have gone again
		}
		if err == nil {
			br.close()
			return
		}
		br.remind(err)
		backoff = min(2*backoff, MaxBackoff)
	}
}

func (br *Breaker) remind(cause error) {
	br.mu.Lock()
	due := time.Since(br.reminded) >= br.cfg.RemindEvery
	if due {
		br.reminded = time.Now()
		br.cause = cause
	}
	since := br.since
	br.mu.Unlock()
	if !due {
		return
	}
	mode := br.Mode()
	br.cfg.Logger.LogAttrs(context.Background(), br.cfg.Level(mode), "quota: Redis still unavailable, "+br.cfg.Describe(mode),
		slog.String("redis", br.cfg.Client),
		slog.String("policy", br.cfg.Policy),
		slog.String("mode", br.cfg.Name(mode)),
		slog.Duration("for", time.Since(since).Round(time.Millisecond)),
		slog.Int64("served", br.served.Load()),
		slog.Int64("refused", br.refused.Load()),
		slog.String("cause", cause.Error()),
	)
}

// close ends the outage: Redis answered.
func (br *Breaker) close() {
	br.reset(slog.LevelInfo, "quota: Redis available again, the shared bucket resumed")
}

// halfOpen stops reporting an outage that nobody has checked for Idle: the
// next request asks Redis itself.
func (br *Breaker) halfOpen() {
	br.reset(slog.LevelWarn, "quota: no request for "+br.cfg.Idle.String()+"; the next one asks Redis again")
}

// reset closes the breaker and logs why.
func (br *Breaker) reset(level slog.Level, msg string) {
	br.mu.Lock()
	since := br.since
	br.mu.Unlock()
	br.state.Store(Closed)
	if br.cfg.Closed != nil {
		br.cfg.Closed()
	}
	br.cfg.Logger.LogAttrs(context.Background(), level, msg,
		slog.String("redis", br.cfg.Client),
		slog.Duration("after", time.Since(since).Round(time.Millisecond)),
		slog.Int64("served", br.served.Load()),
		slog.Int64("refused", br.refused.Load()),
	)
}
