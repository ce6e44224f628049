// Package local keeps what a Limiter does in its own process under
// FallbackLocal: each bucket's local share of the rate and of the
// concurrency slots while Redis is unavailable, the reservations its
// callers make of them, what the process last saw of each bucket's
// queue, the fleet's roll call of workers, the instant the fleet returns
// to the shared bucket, and the hand-over of the shares to it then.
package local

import (
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota/internal/store"
	"golang.org/x/time/rate"
)

// A Limit is a bucket's rate, tokens a second, and burst.
type Limit = store.Limit

// ErrFull reports that a process serves as many local buckets as it may.
var ErrFull = errors.New("too many buckets use their local share")

// maxLocalBuckets bounds the buckets that FallbackLocal serves at once in
// one process, and maxQueues the buckets whose queue it remembers, so that
// untrusted bucket names cannot grow a process without bound. Entries that
// hold nothing any more are dropped long before either bound is reached.
const (
	maxLocalBuckets = 10000
	maxQueues       = 10000
)

// Shares holds the in-process limiters of FallbackLocal, one per
// layer of each bucket, created when an outage first needs them, and what
// the Limiter knows of each bucket's queue from before the outage.
type Shares struct {
	// queues maps a bucket's key to what this Limiter last saw of its
	// queue (*queue): the key, which is bounded, not the name, which is
	// not. A take joins the end of the bucket's queue, so its
	// wait is how far the fleet's grants then reached beyond now. Only
	// buckets with a queue have an entry, and an entry goes once the queue
	// it saw has drained.
	queues     sync.Map
	nQueues    atomic.Int64
	queueSweep sync.Mutex

	mu    sync.Mutex
	m     map[string]*localLimiter // by the layer's Redis key
	sweep int                      // sweep m when it grows past this
	days  map[string]*day          // the daily layers', by key, kept across outages
}

// queue is the end of a bucket's queue as a Limiter last saw it.
type queue struct {
	due  atomic.Int64 // when the latest grant it had falls due, unix ns
	wait atomic.Int64 // the wait of its latest take, ns
}

// drained is when the queue as last seen has run out even if the fleet
// kept it as long as it was: after that it says nothing.
func (q *queue) drained() int64 { return q.due.Load() + q.wait.Load() }

type localLimiter struct {
	name    string // the bucket's
	first   string // the bucket's key
	lim     Limit
	workers int
	*rate.Limiter
}

// A Share is one layer's local limiter at the end of an outage: the tokens
// it holds, below zero when it has promised more to callers still sleeping.
type Share struct {
	Name   string // the bucket's
	First  string // the bucket's key
	Key    string // the layer's Redis key
	Limit  Limit
	Tokens float64
}

// Granted notes that the shared bucket granted tokens of the bucket whose
// key is key after wait.
func (ls *Shares) Granted(key string, wait time.Duration) {
	v, ok := ls.queues.Load(key)
	if !ok {
		if wait <= 0 {
			return // no queue, nothing to remember
		}
		if ls.nQueues.Load() >= maxQueues && ls.sweepQueues() >= maxQueues {
			return
		}
		var loaded bool
		if v, loaded = ls.queues.LoadOrStore(key, new(queue)); !loaded {
			ls.nQueues.Add(1)
		}
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

// sweepQueues drops the queues that have drained and returns how many are
// left.
func (ls *Shares) sweepQueues() int64 {
	ls.queueSweep.Lock()
	defer ls.queueSweep.Unlock()
	now := time.Now().UnixNano()
	ls.queues.Range(func(k, v any) bool {
		if v.(*queue).drained() < now {
			ls.queues.Delete(k)
			ls.nQueues.Add(-1)
		}
		return true
	})
	return ls.nQueues.Load()
}

// Ahead returns how far beyond now the fleet's shared grants of the bucket
// whose key is key may still fall due: at least as far as this Limiter's own,
// and, as other workers kept joining the queue after this one's last take,
// as far as the queue then reached.
func (ls *Shares) Ahead(key string) time.Duration {
	v, ok := ls.queues.Load(key)
	if !ok {
		return 0
	}
	q := v.(*queue)
	now := time.Now()
	if q.drained() < now.UnixNano() {
		return 0
	}
	return max(time.Unix(0, q.due.Load()).Sub(now), time.Duration(q.wait.Load()), 0)
}

// get returns the local limiter for the layer under key of the bucket
// named name, whose first key is first, at lim divided by workers. A new
// one starts empty and owes the tokens that accrue until the fleet's
// shared grants have fallen due. It fails with ErrFull when
// maxLocalBuckets limiters hold tokens.
func (ls *Shares) get(name, first, key string, lim Limit, workers int) (*rate.Limiter, error) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if l, ok := ls.m[key]; ok && l.lim == lim && l.workers == workers {
		return l.Limiter, nil
	}
	if ls.m == nil {
		ls.m = make(map[string]*localLimiter)
	}
	now := time.Now()
	if len(ls.m) >= max(ls.sweep, 1024) {
		// A full limiter is worth no more than a new one, which starts
		// empty: drop them.
		for k, l := range ls.m {
			if l.TokensAt(now) >= float64(l.Burst()) {
				delete(ls.m, k)
			}
		}
		ls.sweep = 2 * len(ls.m)
		if len(ls.m) >= maxLocalBuckets {
			return nil, fmt.Errorf("%w: %d buckets already use their local share in this process", ErrFull, len(ls.m))
		}
	}
	w := float64(workers)
	r, burst := lim.Rate/w, int(math.Max(1, math.Floor(lim.Burst/w)))
	rl := rate.NewLimiter(rate.Limit(r), burst)
	owed := burst + int(math.Ceil(ls.Ahead(first).Seconds()*r))
	for owed > 0 { // a reservation may take at most the burst at a time
		k := min(owed, burst)
		rl.ReserveN(now, k)
		owed -= k
	}
	ls.m[key] = &localLimiter{name: name, first: first, lim: lim, workers: workers, Limiter: rl}
	return rl, nil
}

// A Reservation is what one request reserved of its bucket's local
// shares, a layer each.
type Reservation struct {
	ls    *Shares
	rs    []*rate.Reservation
	days  []dayTake
	at    time.Time
	Delay time.Duration // until the last of them falls due
}

// Reserve reserves n of bucket b, rounded up to whole tokens, from this
// process's local share of each of its layers, at the layer's Limit
// divided by workers, or of its day's count (see day); a layer asked
// nothing is left alone. It reserves nothing and fails with ErrFull, or
// when a layer's share of the burst is less than asked.
func (ls *Shares) Reserve(b store.Bucket, n store.Cost, workers int) (*Reservation, error) {
	r := &Reservation{ls: ls, at: time.Now()}
	for i, lim := range b.Lims {
		tokens := int(math.Ceil(n.Of(i)))
		if tokens == 0 {
			continue // a meter asked nothing
		}
		if lim.Zone != nil {
			t, delay, err := ls.reserveDay(b.Name, b.Keys[0], b.Keys[i], lim, float64(tokens), workers, r.at)
			if err != nil {
				r.Undo()
				return nil, err
			}
			r.days, r.Delay = append(r.days, t), max(r.Delay, delay)
			continue
		}
		rl, err := ls.get(b.Name, b.Keys[0], b.Keys[i], lim, workers)
		if err != nil {
			r.Undo()
			return nil, err
		}
		if tokens > rl.Burst() {
			r.Undo()
			return nil, fmt.Errorf("%d tokens exceed this worker's local share of the burst, %d", tokens, rl.Burst())
		}
		rr := rl.ReserveN(r.at, tokens)
		r.rs = append(r.rs, rr)
		r.Delay = max(r.Delay, rr.DelayFrom(r.at))
	}
	return r, nil
}

// Undo hands the reservation back as if it had never been made: its
// caller does not wait for it.
func (r *Reservation) Undo() {
	for _, rr := range r.rs {
		rr.CancelAt(r.at)
	}
	for _, t := range r.days {
		r.ls.undo(t)
	}
}

// Cancel hands back what the reservation holds that is not yet due: its
// caller stopped waiting.
func (r *Reservation) Cancel() {
	for _, rr := range r.rs {
		rr.Cancel()
	}
	for _, t := range r.days {
		r.ls.undo(t)
	}
}

// Shares returns every local limiter's tokens now.
func (ls *Shares) Shares() []Share {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []Share
	now := time.Now()
	for key, l := range ls.m {
		out = append(out, Share{Name: l.name, First: l.first, Key: key, Limit: l.lim, Tokens: l.TokensAt(now)})
	}
	return out
}

// Reset forgets every local limiter, so that the next outage starts them
// afresh with the divisor and the schedule of its time.
func (ls *Shares) Reset() {
	ls.mu.Lock()
	ls.m, ls.sweep = nil, 0
	ls.mu.Unlock()
}

// Len returns how many local limiters and how many queues ls keeps.
func (ls *Shares) Len() (limiters, queues int) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return len(ls.m), int(ls.nQueues.Load())
}

// QueueKeys returns the keys of the queues ls remembers.
func (ls *Shares) QueueKeys() []string {
	var keys []string
	ls.queues.Range(func(k, _ any) bool {
		keys = append(keys, k.(string))
		return true
	})
	return keys
}
