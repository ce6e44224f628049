// Package breaker stands in front of Redis for a Limiter: closed while
// Redis answers, open while it does not, with one background probe that
// finds out when it answers again, and a hook told of every change.
//
// It knows nothing of buckets, policies or logs: the Limiter gives it the
// probe to run, and formats and logs the changes it is told of.
package breaker

import (
	"context"
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

// Config is what a Breaker is told once, at its start.
type Config struct {
	RemindEvery time.Duration // how often, at most, it repeats that Redis is unavailable
	Idle        time.Duration // the probe stops after this long without a request

	// OnChange is told of every change of state, and of the reminders
	// while the breaker is open. It runs on the goroutine that made the
	// change: a caller's that tripped the breaker, or the probe's.
	OnChange func(Change)
}

// An Event is what a Change tells.
type Event int

const (
	Tripped   Event = iota // a call failed as unavailable: the breaker opened
	Reminded               // still open, RemindEvery after the last record
	Recovered              // Redis answered: the breaker closed
	Idled                  // no request for Idle: the breaker went half-open
)

// A Change is a change of a Breaker's state, or a reminder that it is
// still open.
type Change struct {
	Event  Event
	Bucket string        // Tripped: the bucket whose call failed
	Cause  error         // Tripped and Reminded: the error that opened it, or the latest the probe met
	For    time.Duration // Reminded, Recovered and Idled: how long it had been open

	// Reminded, Recovered and Idled: the requests the policy served and
	// refused in this outage.
	Served, Refused int64
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
// Every change of state is told to Config.OnChange once, and a reminder
// at most once every RemindEvery while open.
type Breaker struct {
	cfg Config

	open    atomic.Bool  // false while closed or half-open
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

// Open reports whether the breaker is open.
func (br *Breaker) Open() bool { return br.open.Load() }

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
// unavailable with cause; probe asks Redis whether it answers again, and
// the breaker closes once it returns nil. The first caller to trip opens
// the breaker, tells OnChange and starts the probe; later callers find it
// open already.
func (br *Breaker) Trip(bucket string, probe func(context.Context) error, cause error) {
	if !br.open.CompareAndSwap(false, true) {
		return
	}
	now := time.Now()
	br.mu.Lock()
	br.cause, br.since, br.reminded = cause, now, now
	br.mu.Unlock()
	br.served.Store(0)
	br.refused.Store(0)
	br.Touch(probe)
	br.cfg.OnChange(Change{Event: Tripped, Bucket: bucket, Cause: cause})
}

// Touch notes that the policy is serving a request and makes sure a probe
// is running, with probe.
func (br *Breaker) Touch(probe func(context.Context) error) {
	br.used.Store(time.Now().UnixNano())
	if br.probing.CompareAndSwap(false, true) {
		go br.probe(probe)
	}
}

// probe asks Redis, with backoff, until ask returns nil, then closes the
// breaker. It stops early, leaving the breaker half-open, when no request
// has needed the policy for Idle.
func (br *Breaker) probe(ask func(context.Context) error) {
	defer br.probing.Store(false)
	backoff := MinBackoff
	for {
		time.Sleep(backoff)
		if time.Since(time.Unix(0, br.used.Load())) > br.cfg.Idle {
			br.reset(Idled)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), ProbeTimeout)
		err := ask(ctx)
		cancel()
		if err == nil {
			br.reset(Recovered)
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
	br.cfg.OnChange(Change{Event: Reminded, Cause: cause, For: time.Since(since),
		Served: br.served.Load(), Refused: br.refused.Load()})
}

// reset closes the breaker, for event: Recovered, or Idled, when the
// probe stops reporting an outage that nobody has checked for Idle: the
// next request asks Redis itself.
func (br *Breaker) reset(event Event) {
	br.mu.Lock()
	since := br.since
	br.mu.Unlock()
	br.open.Store(false)
	br.cfg.OnChange(Change{Event: event, For: time.Since(since),
		Served: br.served.Load(), Refused: br.refused.Load()})
}
