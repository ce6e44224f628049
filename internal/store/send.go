package store

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
)

// Sending the calls that the takes of one bucket share (see batches).

// send sends the call for takes, the next batch of bucket b under key,
// gives each take its reply, and lands the call. takes[0] sends it, and
// reads its own reply when send returns.
func (bs *batches) send(s *Store, key string, b Bucket, takes []*queuedTake) {
	live := make([]*queuedTake, 0, len(takes))
	for _, q := range takes {
		if err := q.ctx.Err(); err != nil {
			q.err = err // ended before the call: not sent
			continue
		}
		live = append(live, q)
	}
	var outage error
	var end horizonOf
	switch len(live) {
	case 0:
	case 1:
		// One take: the call of its own, in its own context.
		q := live[0]
		q.g, q.err = s.takeOne(q.ctx, b, q.n, q.acceptable())
		outage = s.outage(q.ctx, q.err)
		if q.err == nil {
			end = horizon(time.Now(), q.g)
		}
	default:
		// The script serves the takes from the highest priority class to
		// the lowest, each class in arrival order: the pushes of a class's
		// takes then come before the grants of the classes they push, and
		// so the push counts of the call's reply are those every grant is
		// to be moved from.
		slices.SortStableFunc(live, func(a, b *queuedTake) int { return b.n.Class - a.n.Class })
		ctx, cancel := callContext(live)
		err := s.takeAll(ctx, b, live)
		outage = s.outage(ctx, err)
		cancel()
		if err == nil {
			gs := make([]Grant, len(live))
			for i, q := range live {
				gs[i] = q.g
			}
			end = horizon(time.Now(), gs...)
		}
	}
	bs.landed(key, outage, end)
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
func (s *Store) takeAll(ctx context.Context, b Bucket, takes []*queuedTake) error {
	callers := make([]caller, len(takes))
	for i, q := range takes {
		callers[i] = caller{q.n, q.acceptable()}
	}
	cmd, trips := s.takeScript.Run(ctx, b.Call, s.takeArgs(b, callers...)...)
	err := cmd.Err()
	for _, q := range takes {
		q.g = Grant{Outcome: Granted, Trips: trips, Size: len(takes)} // as a reply of 0 has them
	}
	if z, ok := cmd.Val().(int64); err == nil && !(ok && z == 0) {
		var v []int64
		if v, err = cmd.Int64Slice(); err == nil {
			err = decode(len(b.Keys), len(takes), v, func(c int, g Grant) {
				g.Trips, g.Size = trips, len(takes)
				takes[c].g = g
			})
		} else {
			err = fmt.Errorf("%w: %v", redisx.ErrReply, cmd.Val())
		}
	}
	for _, q := range takes {
		if q.err = err; err != nil {
			q.g = Grant{Trips: trips, Size: len(takes)}
		}
	}
	return err
}

// outage returns err, the error of a call made in ctx, when it says that
// Redis is unavailable: a failure the takes queued behind the call share.
// It returns nil for any other (the caller's context, a script error).
func (s *Store) outage(ctx context.Context, err error) error {
	return redisx.Outage(ctx, err, s.cluster)
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
	ctx := context.WithValue(context.WithoutCancel(takes[0].ctx), CallersKey{}, callers)
	if bounded {
		return context.WithDeadline(ctx, latest)
	}
	return ctx, func() {}
}

// CallersKey marks the context of a call that serves several takes with
// their callers' contexts, in the order of the reply, for a hook that
// follows each caller's take.
type CallersKey struct{}
