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
// the Limiter knows of each bucket's queue from before the outage.
type localLimiters struct {
	// queues maps a bucket name to what this Limiter last saw of its queue
	// (*queue). A take joins the end of the bucket's queue, so its wait is
	// how far the fleet's grants then reached beyond now.
	queues sync.Map

	mu sync.Mutex
	m  map[string]*localLimiter // by the layer's Redis key
}

// queue is the end of a bucket's queue as a Limiter last saw it.
type queue struct {
	due  atomic.Int64 // when the latest grant it had falls due, unix ns
	wait atomic.Int64 // the wait of its latest take, ns
}

type localLimiter struct {
	lim     Limit
	workers int
	*rate.Limiter
}

// share is one layer's local limiter at the end of an outage: the tokens
// it holds, below zero when it has promised more to callers still sleeping.
type share struct {
	rkey   string
	lim    Limit
	tokens float64
}

// granted notes that the shared bucket granted key's tokens after wait.
func (ls *localLimiters) granted(key string, wait time.Duration) {
	v, ok := ls.queues.Load(key)
	if !ok {
		v, _ = ls.queues.LoadOrStore(key, new(queue))
	}
	q, due := v.(*queue), time.Now().Add(wait).UnixNano()
	q.wait.Store(int64(wait))
	for {
		old := q.due.Load()
		if old >= due || q.due.CompareAndSwap(old, due) {
			return
		}
	}
}

// ahead returns how far beyond now the fleet's shared grants of key may
// still fall due: at least as far as this Limiter's own, and, as other
// workers kept joining the queue after this one's last take, as far as the
// queue then reached.
func (ls *localLimiters) ahead(key string) time.Duration {
	v, ok := ls.queues.Load(key)
	if !ok {
		return 0
	}
	q := v.(*queue)
	return max(time.Until(time.Unix(0, q.due.Load())), time.Duration(q.wait.Load()), 0)
}

// get returns the local limiter for the layer rkey of the bucket named key
// at lim divided by workers. A new one starts empty and owes the tokens that
// accrue until the fleet's shared grants have fallen due.
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
	owed := burst + int(math.Ceil(ls.ahead(key).Seconds()*r))
	for owed > 0 { // a reservation may take at most the burst at a time
		k := min(owed, burst)
		rl.ReserveN(now, k)
		owed -= k
	}
	ls.m[rkey] = &localLimiter{lim: lim, workers: workers, Limiter: rl}
	return rl
}

// shares returns every local limiter's tokens now.
func (ls *localLimiters) shares() []share {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []share
	now := time.Now()
	for rkey, l := range ls.m {
		out = append(out, share{rkey: rkey, lim: l.lim, tokens: l.TokensAt(now)})
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
