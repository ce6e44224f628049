package quota

import (
	"fmt"
	"math"
	"sync"

	"golang.org/x/time/rate"
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
// workers processes run. It panics if workers is less than 1.
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

// localLimiters holds the in-process limiters of FallbackLocal, one per
// bucket, created when first needed.
type localLimiters struct {
	mu sync.Mutex
	m  map[string]*localLimiter
}

type localLimiter struct {
	lim     Limit
	workers int
	*rate.Limiter
}

// get returns the local limiter for the bucket named key at lim divided by
// workers.
func (ls *localLimiters) get(key string, lim Limit, workers int) *rate.Limiter {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l, ok := ls.m[key]; ok && l.lim == lim && l.workers == workers {
		return l.Limiter
	}
	if ls.m == nil {
		ls.m = make(map[string]*localLimiter)
	}
	w := float64(workers)
	// rate.Limiter counts whole tokens: a share of the burst below one
	// token would refuse every request, so round it up to one.
	l := &localLimiter{lim: lim, workers: workers, Limiter: rate.NewLimiter(rate.Limit(lim.Rate/w), int(math.Max(1, math.Floor(lim.Burst/w))))}
	ls.m[key] = l
	return l.Limiter
}

// reset forgets every local limiter, so that the next outage starts them
// afresh with the divisor of its time.
func (ls *localLimiters) reset() {
	ls.mu.Lock()
	ls.m = nil
	ls.mu.Unlock()
}
