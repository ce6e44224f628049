package quota

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
)

// localLimiters holds the in-process limiters of FallbackLocal, one per
// layer of each bucket, created when an outage first needs them, and what
// the Limiter knows of each bucket's schedule from before the outage.
type localLimiters struct {
	// due maps a bucket name to when the latest grant this Limiter had from
	// the shared bucket falls due (*atomic.Int64, unix ns). A take joins the
	// end of the bucket's queue, so that is also where the fleet's schedule
	// ended when this Limiter last looked.
	due sync.Map

	mu sync.Mutex
	m  map[string]*localLimiter // by the layer's Redis key
}

type localLimiter struct {
	lim     Limit
	workers int
	*rate.Limiter
}

// owed is one layer's tokens that its local limiter has promised beyond
// now, which the shared bucket must be charged when it resumes.
type owed struct {
	rkey   string
	lim    Limit
	tokens float64
}

// granted notes that the shared bucket granted key's tokens, due at at.
func (ls *localLimiters) granted(key string, at time.Time) {
	v, ok := ls.due.Load(key)
	if !ok {
		v, _ = ls.due.LoadOrStore(key, new(atomic.Int64))
	}
	due, t := v.(*atomic.Int64), at.UnixNano()
	for {
		old := due.Load()
		if old >= t || due.CompareAndSwap(old, t) {
			return
		}
	}
}

// get returns the local limiter for the layer rkey of the bucket named key
// at lim divided by workers. A new one starts empty and owes the tokens that
// accrue until the shared bucket's last known grant falls due.
func (ls *localLimiters) get(key, rkey string, lim Limit, workers int) *rate.Limiter {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l, ok := ls.m[rkey]; ok && l.lim == lim && l.workers == workers {
		return l.Limiter
	}
	if ls.m == nil {
		ls.m = make(map[string]*localLimiter)
	}
	w := float64(workers)
	r, burst := lim.Rate/w, int(math.Max(1, math.Floor(lim.Burst/w)))
	rl := rate.NewLimiter(rate.Limit(r), burst)
	now := time.Now()
	owed := burst
	if v, ok := ls.due.Load(key); ok {
		if ahead := time.Unix(0, v.(*atomic.Int64).Load()).Sub(now); ahead > 0 {
			owed += int(math.Ceil(ahead.Seconds() * r))
		}
	}
	for owed > 0 { // a reservation may take at most the burst at a time
		k := min(owed, burst)
		rl.ReserveN(now, k)
		owed -= k
	}
	ls.m[rkey] = &localLimiter{lim: lim, workers: workers, Limiter: rl}
	return rl
}

// owing returns the tokens each local limiter has promised to callers that
// are still sleeping.
func (ls *localLimiters) owing() []owed {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []owed
	now := time.Now()
	for rkey, l := range ls.m {
		if t := l.TokensAt(now); t < 0 {
			out = append(out, owed{rkey: rkey, lim: l.lim, tokens: -t})
		}
	}
	return out
}

// reset forgets every local limiter, so that the next outage starts them
// afresh with the divisor and the schedule of its time.
func (ls *localLimiters) reset() {
	ls.mu.Lock()
	ls.m = nil
	ls.mu.Unlock()
}
