package quota

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota/internal/breaker"
	"golang.org/x/time/rate"
)

//go:embed resume.lua
var resumeSource string

// maxLocalBuckets bounds the buckets that FallbackLocal serves at once in
// one process, and maxQueues the buckets whose queue it remembers, so that
// untrusted bucket names cannot grow a process without bound. Entries that
// hold nothing any more are dropped long before either bound is reached.
const (
	maxLocalBuckets = 10000
	maxQueues       = 10000
)

// localLimiters holds the in-process limiters of FallbackLocal, one per
// layer of each bucket, created when an outage first needs them, and what
// the Limiter knows of each bucket's queue from before the outage.
type localLimiters struct {
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

// share is one layer's local limiter at the end of an outage: the tokens
// it holds, below zero when it has promised more to callers still sleeping.
type share struct {
	name   string // the bucket's
	first  string // the bucket's key
	key    string // the layer's Redis key
	lim    Limit
	tokens float64
}

// granted notes that the shared bucket granted tokens of the bucket whose
// key is key after wait.
func (ls *localLimiters) granted(key string, wait time.Duration) {
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
func (ls *localLimiters) sweepQueues() int64 {
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

// ahead returns how far beyond now the fleet's shared grants of the bucket
// whose key is key may still fall due: at least as far as this Limiter's own,
// and, as other workers kept joining the queue after this one's last take,
// as far as the queue then reached.
func (ls *localLimiters) ahead(key string) time.Duration {
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
// named name, at lim divided by workers. A new one starts empty and owes
// the tokens that accrue until the fleet's shared grants have fallen due.
// It fails when maxLocalBuckets limiters hold tokens.
func (ls *localLimiters) get(name, first, key string, lim Limit, workers int) (*rate.Limiter, error) {
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
			return nil, fmt.Errorf("%w: %d buckets already use their local share in this process", ErrUnavailable, len(ls.m))
		}
	}
	w := float64(workers)
	r, burst := lim.Rate/w, int(math.Max(1, math.Floor(lim.Burst/w)))
	rl := rate.NewLimiter(rate.Limit(r), burst)
	owed := burst + int(math.Ceil(ls.ahead(first).Seconds()*r))
	for owed > 0 { // a reservation may take at most the burst at a time
		k := min(owed, burst)
		rl.ReserveN(now, k)
		owed -= k
	}
	ls.m[key] = &localLimiter{name: name, first: first, lim: lim, workers: workers, Limiter: rl}
	return rl, nil
}

// shares returns every local limiter's tokens now.
func (ls *localLimiters) shares() []share {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	var out []share
	now := time.Now()
	for key, l := range ls.m {
		out = append(out, share{name: l.name, first: l.first, key: key, lim: l.lim, tokens: l.TokensAt(now)})
	}
	return out
}

// reset forgets every local limiter, so that the next outage starts them
// afresh with the divisor and the schedule of its time.
func (ls *localLimiters) reset() {
	ls.mu.Lock()
	ls.m, ls.sweep = nil, 0
	ls.mu.Unlock()
}

// localWait waits for n tokens from this process's share of every layer,
// or takes them only if the share has them now when noWait is set, and
// returns how long it waited, or under dry run would have.
func (l *Limiter) localWait(ctx context.Context, b bucket, n float64, noWait bool) (time.Duration, error) {
	tokens := int(math.Ceil(n))
	now := time.Now()
	var delay time.Duration
	var rs []*rate.Reservation
	cancel := func() {
		for _, r := range rs {
			r.CancelAt(now)
		}
	}
	for i, lim := range b.lims {
		rl, err := l.locals.get(b.name, b.keys[0], b.keys[i], lim, l.workers.divisor(l.cfg.policy))
		if err != nil {
			cancel()
			l.breaker.Refused()
			return 0, err
		}
		if tokens > rl.Burst() {
			cancel()
			l.breaker.Refused()
			return 0, fmt.Errorf("%w: %v tokens exceed this worker's local share of the burst, %d", ErrUnavailable, n, rl.Burst())
		}
		r := rl.ReserveN(now, tokens)
		rs = append(rs, r)
		delay = max(delay, r.DelayFrom(now))
	}
	maxWait, deadline := l.maxWait(ctx)
	if noWait {
		maxWait = 0
	}
	if delay > maxWait {
		cancel()
		switch {
		case noWait:
			return 0, fmt.Errorf("%w: %q needs %v", ErrWouldWait, b.name, delay)
		case deadline:
			return 0, fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, b.name, delay)
		case l.cfg.dryRun:
			return delay, nil // enforced, it would sleep MaxWait and ask again
		}
		if err := sleep(ctx, maxWait); err != nil {
			return 0, err
		}
		return 0, errAskAgain
	}
	if l.cfg.dryRun {
		l.breaker.Served()
		return delay, nil // the share keeps the reservation, as if slept on
	}
	if err := sleep(ctx, delay); err != nil {
		for _, r := range rs {
			r.Cancel()
		}
		return 0, err
	}
	l.breaker.Served()
	return delay, nil
}

// settleLocal hands the shared bucket, when it resumes, the state of the
// local shares: it holds at most what this worker's share holds, times the
// workers, so that a bucket Redis forgot (or kept from before the outage,
// full by now) does not release a burst on top of what the local shares
// just sent; and it is charged the tokens this worker's share promised to
// callers still sleeping, so that their grants and the shared bucket's do
// not overlap. Every worker does so at the instant the fleet agreed on
// (resumeIn), so that no worker draws on the shared bucket while another
// still spends its local share.
//
// A failure that says Redis is unavailable again is returned: the outage
// goes on. Any other is counted and logged, and leaves that bucket as
// Redis has it.
func (l *Limiter) settleLocal() error {
	if !l.handOver {
		return nil
	}
	workers := float64(l.workers.divisor(l.cfg.policy))
	for _, s := range l.locals.shares() {
		// One layer at a time, under the bucket's control record.
		b := bucket{name: s.name, keys: []string{s.key}, lims: []Limit{s.lim}, call: []string{s.key, s.first + controlSuffix}}
		ctx, cancel := context.WithTimeout(context.Background(), breaker.ProbeTimeout)
		err := l.store.lower(ctx, b, max(s.tokens, 0)*workers)
		if err == nil && s.tokens < 0 {
			err = l.store.adjust(ctx, b, -s.tokens, "")
		}
		cancel()
		if err != nil {
			if errors.Is(l.classify(context.Background(), err), ErrUnavailable) {
				return err
			}
			l.updates.failed(updateSettleLocal, err)
		}
	}
	return nil
}

// resumeDelay is how long after the first Limiter finds Redis again the
// fleet resumes the shared bucket: longer than the probe's longest
// backoff, so that every Limiter still probing has found Redis by then.
const resumeDelay = breaker.MaxBackoff + 250*time.Millisecond

// resumeIn returns how long until the fleet resumes the shared bucket
// after an outage: every Limiter of the fleet reads the instant the first
// one to find Redis again recorded (resume.lua). It is zero for a policy
// without local shares, and when Redis cannot say.
func (l *Limiter) resumeIn(ctx context.Context) time.Duration {
	if l.cfg.policy.mode() != ModeLocal || !l.handOver {
		return 0
	}
	cmd, _ := l.resume.Run(ctx, []string{l.cfg.prefix + "resume"}, resumeDelay.Microseconds(), l.store.now())
	us, err := cmd.Int64()
	if err != nil {
		return 0
	}
	return min(max(time.Duration(us)*time.Microsecond, 0), resumeDelay)
}
