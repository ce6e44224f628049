package quota

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// The takes of one bucket in one process share script calls, as a group
// commit shares a log write. A take that finds no call for its bucket in
// flight is sent at once, alone: an uncontended caller pays nothing for the
// sharing. Takes that arrive while a call is in flight queue in arrival
// order, and when that call returns the first of them sends one call for
// all of them (at most maxBatch); the script serves them in that order,
// each granted or refused on its own. Nobody waits for a batch to fill: a
// batch is whoever arrived during the call before it.

// maxBatch bounds the takes one call serves, so that its arguments and its
// reply stay a few kilobytes; the takes beyond it go in the call after.
const maxBatch = 256

// batches are a store's buckets with a call in flight, by the bucket's key.
// A bucket has an entry only while a call for it is in flight, so however
// many names a process sees, the map holds no more entries than there are
// calls in flight.
type batches struct {
	mu      sync.Mutex
	flights map[string]flight
}

// flight is a bucket with a call in flight, and the takes queued for the
// next one.
type flight struct {
	b     bucket
	queue []*queuedTake
}

// queuedTake is one caller's take, queued behind a call in flight.
type queuedTake struct {
	ctx     context.Context
	n       float64
	maxWait time.Duration
	state   takeState     // guarded by batches.mu
	lead    []*queuedTake // the takes of the call it is to send, itself first
	done    chan struct{} // closed when it is to send a call, or its reply is in

	// Its reply.
	g     grant
	trips int // Redis round trips of the call it went in
	size  int // the takes that call served
	err   error
}

type takeState uint8

const (
	queued  takeState = iota // behind the call in flight
	batched                  // in the next call
	left                     // its context ended while it was queued
)

// take is store.take with the sharing: see batches.
func (bs *batches) take(s *store, ctx context.Context, b bucket, n float64, maxWait time.Duration) (grant, int, error) {
	key, q, alone := bs.join(ctx, b, n, maxWait)
	if q == nil {
		g, trips, err := s.takeOne(ctx, b, n, maxWait)
		batchSize(ctx, 1)
		if !alone {
			bs.landed(key, s.outage(ctx, err))
		}
		return g, trips, err
	}
	select {
	case <-q.done:
	case <-ctx.Done():
		if bs.leave(q) {
			return grant{}, 0, ctx.Err()
		}
		<-q.done // already in a call: its reply decides
	}
	if q.lead != nil {
		bs.send(s, key, b, q.lead)
	}
	if q.size > 0 {
		batchSize(ctx, q.size)
	}
	return q.g, q.trips, q.err
}

// join queues a take of b when a call for b is in flight and returns it.
// Otherwise it returns nil, and the caller sends its take at once: as b's
// call in flight, which it must land, or alone, for a bucket of the same
// key under other Limits, which goes beside the call in flight.
func (bs *batches) join(ctx context.Context, b bucket, n float64, maxWait time.Duration) (key string, q *queuedTake, alone bool) {
	key = b.keys[0]
	bs.mu.Lock()
	defer bs.mu.Unlock()
	f, busy := bs.flights[key]
	if !busy {
		if bs.flights == nil {
			bs.flights = make(map[string]flight)
		}
		bs.flights[key] = flight{b: b}
		return key, nil, false
	}
	if !f.b.same(b) {
		return key, nil, true
	}
	q = &queuedTake{ctx: ctx, n: n, maxWait: maxWait, done: make(chan struct{})}
	f.queue = append(f.queue, q)
	bs.flights[key] = f
	return key, q, false
}

// leave takes q out of its queue after its context ended, and reports
// whether it was still there: false when it is already in a call.
func (bs *batches) leave(q *queuedTake) bool {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	if q.state != queued {
		return false
	}
	q.state = left
	return true
}

// landed is told that the call in flight for the bucket under key has
// returned. The takes queued meanwhile go in the next call, which the
// first of them sends; with none queued the flight ends. When the call
// found Redis unavailable, the queued takes fail with it instead: sent,
// they would wait for the same timeout again, and the breaker that the
// failed call trips serves them at once.
func (bs *batches) landed(key string, outage error) {
	bs.mu.Lock()
	f := bs.flights[key]
	var next []*queuedTake
	i := 0
	for ; i < len(f.queue) && (outage != nil || len(next) < maxBatch); i++ {
		if q := f.queue[i]; q.state == queued {
			q.state = batched
			next = append(next, q)
		}
	}
	clear(f.queue[:i])
	f.queue = f.queue[i:]
	if len(f.queue) == 0 && (len(next) == 0 || outage != nil) {
		delete(bs.flights, key)
	} else {
		bs.flights[key] = f
	}
	bs.mu.Unlock()

	if outage != nil {
		for _, q := range next {
			q.err = outage
			close(q.done)
		}
		return
	}
	if len(next) > 0 {
		next[0].lead = next
		close(next[0].done)
	}
}

// send sends the call for takes, the next batch of bucket b under key,
// gives each take its reply, and lands the call. takes[0] sends it, and
// reads its own reply when send returns.
func (bs *batches) send(s *store, key string, b bucket, takes []*queuedTake) {
	live := make([]*queuedTake, 0, len(takes))
	for _, q := range takes {
		if err := q.ctx.Err(); err != nil {
			q.err = err // ended before the call: not sent
			continue
		}
		live = append(live, q)
	}
	var outage error
	switch len(live) {
	case 0:
	case 1:
		// One take: the call of its own, in its own context.
		q := live[0]
		q.g, q.trips, q.err = s.takeOne(q.ctx, b, q.n, q.acceptable())
		q.size = 1
		outage = s.outage(q.ctx, q.err)
	default:
		ctx, cancel := callContext(live)
		outage = s.outage(ctx, s.takeAll(ctx, b, live))
		cancel()
	}
	bs.landed(key, outage)
	for _, q := range takes[1:] {
		close(q.done)
	}
}

// acceptable returns the longest wait q accepts now: its maxWait, or less
// when its context's deadline comes sooner, so that the time it spent
// queued counts.
func (q *queuedTake) acceptable() time.Duration {
	w := q.maxWait
	if d, ok := q.ctx.Deadline(); ok {
		w = min(w, time.Until(d))
	}
	return max(w, 0)
}

// takeAll takes the tokens of every one of takes from b in one call, in
// their order, and sets each one's reply; it returns the call's error.
func (s *store) takeAll(ctx context.Context, b bucket, takes []*queuedTake) error {
	first := takes[0]
	args := s.args(b, "take", s.argv.tokens(first.n), s.argv.micros(first.acceptable().Microseconds()), nil, 2*(len(takes)-1))
	for _, q := range takes[1:] {
		args = append(args, s.argv.tokens(q.n), s.argv.micros(q.acceptable().Microseconds()))
	}
	cmd, trips := s.script.run(ctx, b.keys, args...)
	err := cmd.Err()
	var v []int64 // nil: every take granted without a wait
	stride := 2 + len(b.keys)
	if z, ok := cmd.Val().(int64); err == nil && !(ok && z == 0) {
		if v, err = cmd.Int64Slice(); err != nil || len(v) != stride*len(takes) {
			err = fmt.Errorf("%w: unexpected reply %v", ErrScript, cmd.Val())
		}
	}
	for i, q := range takes {
		q.trips, q.size, q.err = trips, len(takes), err
		if err != nil || v == nil {
			q.g = grant{granted: err == nil}
			continue
		}
		r := v[i*stride : (i+1)*stride : (i+1)*stride]
		q.g = grant{granted: r[0] == 1, wait: time.Duration(r[1]) * time.Microsecond}
		if r[0] == 0 || r[1] != 0 {
			q.g.tats = r[2:]
		}
	}
	return err
}

// outage returns err, the error of a call made in ctx, when it says that
// Redis is unavailable: a failure the takes queued behind the call share.
// It returns nil for any other (the caller's context, a script error).
func (s *store) outage(ctx context.Context, err error) error {
	if err != nil && errors.Is(classify(ctx, err, s.cluster), ErrUnavailable) {
		return err
	}
	return nil
}

// callContext returns the context of the call that serves takes: the
// values of the first caller's (so that a tracing hook nests the Redis call
// under its wait span), the cancellation of none, and when every caller has
// a deadline the latest of them, which bounds the call on a client with
// ContextTimeoutEnabled. It also carries the callers' contexts in the
// order of the reply, for a hook that follows each caller's take.
func callContext(takes []*queuedTake) (context.Context, context.CancelFunc) {
	callers := make([]context.Context, len(takes))
	var latest time.Time
	bounded := true
	for i, q := range takes {
		callers[i] = q.ctx
		d, ok := q.ctx.Deadline()
		bounded = bounded && ok
		if d.After(latest) {
			latest = d
		}
	}
	ctx := context.WithValue(context.WithoutCancel(takes[0].ctx), callersKey{}, callers)
	if bounded {
		return context.WithDeadline(ctx, latest)
	}
	return ctx, func() {}
}

// callersKey marks the context of a call that serves several takes with
// their callers' contexts, in the order of the reply.
type callersKey struct{}

// same reports whether b and o are the same bucket: the same keys under
// the same Limits.
func (b bucket) same(o bucket) bool {
	return slices.Equal(b.keys, o.keys) && slices.Equal(b.lims, o.lims)
}
