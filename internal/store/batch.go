package store

import (
	"context"
	"sync"
	"time"
)

// The takes of one bucket in one process share script calls, as a group
// commit shares a log write. A take that finds no call for its bucket in
// flight is sent at once, alone: an uncontended caller pays nothing for the
// sharing. Takes that arrive while a call is in flight queue in arrival
// order, and when that call returns the first of them sends one call for
// all of them (at most MaxBatch); the script serves them in that order,
// each granted or refused on its own. Nobody waits for a batch to fill: a
// batch is whoever arrived during the call before it.
//
// Under a queue that alone shares little: each caller asks again as its
// grant falls due, one interval of the queue after the one before, far
// longer than a round trip, so most find no call in flight. So a take that
// finds no call in flight on a bucket whose queue, as the last reply told,
// ends ahead of now holds its call for a moment (at most MaxHold, and never
// past the end of that queue, before which its own grant cannot fall due)
// while the takes that arrive meanwhile queue behind it; then it sends one
// call for all of them, itself first. A bucket that never makes anyone wait
// has no queue, and its takes never hold.

// MaxBatch bounds the takes one call serves, so that its arguments and its
// reply stay a few kilobytes; the takes beyond it go in the call after.
const MaxBatch = 256

// MaxHold bounds how long a take on a bucket with a queue holds its call
// for the takes that arrive after it; 0 turns holding off. A variable for
// the tests.
var MaxHold = 50 * time.Millisecond

// minHold is the shortest hold worth making: a shorter one gathers nobody.
const minHold = time.Millisecond

// MaxHorizons bounds the buckets whose queue's end a store remembers. An
// end that has passed is forgotten when next seen, and a store that has
// MaxHorizons of them forgets the ones past, or else an arbitrary one, to
// make room: however many names a process sees, the map stays small.
const MaxHorizons = 1024

// batches are a store's buckets with a call in flight, by the bucket's key.
// A bucket has an entry only while a call for it is in flight, so however
// many names a process sees, the map holds no more entries than there are
// calls in flight.
type batches struct {
	hold bool // takes on a bucket with a queue hold their calls

	mu      sync.Mutex
	flights map[string]flight

	// horizons are when the queues of buckets end, on this machine's
	// clock, as the latest reply for each told: when its last grant falls
	// due. A bucket whose last take was granted at once has none.
	horizons map[string]time.Time
}

// flight is a bucket with a call in flight, and the takes queued for the
// next one.
type flight struct {
	b     Bucket
	queue []*queuedTake
	held  *queuedTake // the take that holds its call (see holdFor); nil once sent
}

// queuedTake is one caller's take, queued behind a call in flight.
type queuedTake struct {
	ctx     context.Context
	n       Cost
	maxWait time.Duration
	state   takeState     // guarded by batches.mu
	lead    []*queuedTake // the takes of the call it is to send, itself first
	done    chan struct{} // closed when it is to send a call, or its reply is in

	// Its reply, with the round trips and size of the call it went in.
	g   Grant
	err error
}

type takeState uint8

const (
	queued  takeState = iota // behind the call in flight
	batched                  // in the next call
	left                     // its context ended while it was queued
)

// take is Store.Take with the sharing: see batches.
func (bs *batches) take(s *Store, ctx context.Context, b Bucket, n Cost, maxWait time.Duration) (Grant, error) {
	key, q, alone, hold := bs.join(ctx, b, n, maxWait)
	if q == nil {
		g, err := s.takeOne(ctx, b, n, maxWait)
		if !alone {
			bs.landed(key, s.outage(ctx, err), horizon(time.Now(), g))
		}
		return g, err
	}
	if hold > 0 {
		// q holds the bucket's flight: the takes that arrive meanwhile
		// queue behind it, and go in its call. A caller gone meanwhile is
		// not sent (see send).
		holdCall(ctx, hold)
		bs.send(s, key, b, bs.gather(key, q))
	} else {
		select {
		case <-q.done:
		case <-ctx.Done():
			if bs.leave(q) {
				return Grant{}, ctx.Err()
			}
			<-q.done // already in a call: its reply decides
		}
		if q.lead != nil {
			bs.send(s, key, b, q.lead)
		}
	}
	return q.g, q.err
}

// join queues a take of b when a call for b is in flight and returns it.
// Otherwise the take is to hold b's flight: when b has a queue that ends
// after now but within the take's maxWait, join returns it with how long
// to hold its call (see holdFor), and it must gather and send the call;
// with no queue it returns nil, and the caller sends its take at once and
// must land it. A take of a bucket of the same key under other Limits goes
// alone, beside the call in flight, and returns nil with alone set.
func (bs *batches) join(ctx context.Context, b Bucket, n Cost, maxWait time.Duration) (key string, q *queuedTake, alone bool, hold time.Duration) {
	key = b.Keys[0]
	bs.mu.Lock()
	defer bs.mu.Unlock()
	f, busy := bs.flights[key]
	if !busy {
		if bs.flights == nil {
			bs.flights = make(map[string]flight)
		}
		if hold = bs.holdFor(key, maxWait); hold > 0 {
			q = &queuedTake{ctx: ctx, n: n, maxWait: maxWait, state: batched}
		}
		bs.flights[key] = flight{b: b, held: q}
		return key, q, false, hold
	}
	if !f.b.Same(b) || (f.held != nil && maxWait < time.Until(bs.horizons[key])) {
		// Beside the call in flight: b under other Limits, or a take that
		// cannot wait for the queue of the held call's bucket to end,
		// which is refused at once instead of after the hold.
		return key, nil, true, 0
	}
	q = &queuedTake{ctx: ctx, n: n, maxWait: maxWait, done: make(chan struct{})}
	f.queue = append(f.queue, q)
	bs.flights[key] = f
	return key, q, false, 0
}

// holdFor returns how long a take that accepts maxWait holds the call of
// the bucket under key: until the bucket's queue ends, or for MaxHold if
// that is sooner. Its own grant falls due after the queue's end however
// soon it is sent, so the hold delays nothing. It returns 0 (send at once)
// when the bucket has no queue, when the hold would be too short to gather
// anyone, and when the queue ends past maxWait: that take is refused, and
// at once. It runs with bs.mu held.
func (bs *batches) holdFor(key string, maxWait time.Duration) time.Duration {
	if !bs.hold || MaxHold <= 0 {
		return 0
	}
	end, ok := bs.horizons[key]
	if !ok {
		return 0
	}
	ahead := time.Until(end)
	if ahead <= 0 {
		delete(bs.horizons, key)
		return 0
	}
	if hold := min(ahead, MaxHold); hold >= minHold && ahead <= maxWait {
		return hold
	}
	return 0
}

// holdCall holds the call of a take for hold, or until the take's context
// ends. What changed meanwhile (a pause, another Limit in force) the script
// finds in the bucket's control record when the call goes.
func holdCall(ctx context.Context, hold time.Duration) {
	t := time.NewTimer(hold)
	defer t.Stop()
	select {
	case <-t.C:
	case <-ctx.Done():
	}
}

// gather ends the hold of lead, the take holding the flight of the bucket
// under key, and returns the takes of its call: lead, then those queued
// behind it, at most MaxBatch in all.
func (bs *batches) gather(key string, lead *queuedTake) []*queuedTake {
	bs.mu.Lock()
	defer bs.mu.Unlock()
	f := bs.flights[key]
	f.held = nil
	takes := []*queuedTake{lead}
	i := 0
	for ; i < len(f.queue) && len(takes) < MaxBatch; i++ {
		if q := f.queue[i]; q.state == queued {
			q.state = batched
			takes = append(takes, q)
		}
	}
	clear(f.queue[:i])
	f.queue = f.queue[i:]
	bs.flights[key] = f
	return takes
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
// returned, and where its reply put the end of the bucket's queue (see
// horizon). The takes queued meanwhile go in the next call, which the
// first of them sends; with none queued the flight ends. When the call
// found Redis unavailable, the queued takes fail with it instead: sent,
// they would wait for the same timeout again, and the breaker that the
// failed call trips serves them at once.
func (bs *batches) landed(key string, outage error, end horizonOf) {
	bs.mu.Lock()
	bs.learn(key, end)
	f := bs.flights[key]
	var next []*queuedTake
	i := 0
	for ; i < len(f.queue) && (outage != nil || len(next) < MaxBatch); i++ {
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

// horizonOf is what a reply tells of the end of its bucket's queue: when
// the last take it granted falls due, zero when that take was granted at
// once, and nothing (known false) when it granted none.
type horizonOf struct {
	end   time.Time
	known bool
}

// horizon returns what the grants of one reply, received at at, in their
// order, tell of the end of the bucket's queue.
func horizon(at time.Time, gs ...Grant) horizonOf {
	for i := len(gs) - 1; i >= 0; i-- {
		if g := gs[i]; g.Outcome == Granted {
			if g.Wait <= 0 {
				return horizonOf{known: true}
			}
			return horizonOf{end: at.Add(g.Wait), known: true}
		}
	}
	return horizonOf{}
}

// learn records the end of the queue of the bucket under key, keeping at
// most MaxHorizons. It runs with bs.mu held.
func (bs *batches) learn(key string, h horizonOf) {
	switch {
	case !h.known:
		return
	case h.end.IsZero():
		delete(bs.horizons, key) // (a no-op on a bucket that never queues)
		return
	}
	if _, ok := bs.horizons[key]; !ok && len(bs.horizons) >= MaxHorizons {
		now := time.Now()
		for k, end := range bs.horizons {
			if !end.After(now) {
				delete(bs.horizons, k)
			}
		}
		for k := range bs.horizons {
			if len(bs.horizons) < MaxHorizons {
				break
			}
			delete(bs.horizons, k)
		}
	}
	if bs.horizons == nil {
		bs.horizons = make(map[string]time.Time)
	}
	bs.horizons[key] = h.end
}
