package quota

import (
	"context"
	"fmt"
	"net/http"
)

// WithPriority sets each request's priority, 0 (the default) to
// MaxPriority: on a bucket that has a queue, a request of a higher
// priority is granted before every request of a lower one whose grant is
// not yet due, in every process that shares the bucket; requests of one
// priority keep their first-come-first-served order. The lower
// priorities use whatever the higher ones leave of the rate, and the
// provider still never sees more than the Limit allows. A grant due
// within 100 ms stands, so that the processes hear of the push in time:
// a request of a higher priority waits that long, and its own token,
// behind a queue of lower ones. A priority outside 0 to MaxPriority fails
// the request with ErrInvalidPriority.
//
// Without WithPriority, a request has the priority of its context (see
// ContextWithPriority). A pause holds every priority, and a change of the
// Limit rescales every priority's queue. While Redis is unavailable, a
// local share (FallbackLocal) serves its callers first come, first
// served. It panics if f is nil.
func WithPriority(f func(*http.Request) int) TransportOption {
	if f == nil {
		panic("quota: WithPriority(nil)")
	}
	return transportOpt(func(c *transportConfig) { c.priority = f })
}

// WithMinShare gives priority p a minimum share of the rate, between 0
// and 1: while p has a queue, the higher priorities push its grants back
// by at most 1 - share of the time that passes, so that p's requests,
// together, are granted at least share of the rate, however many requests
// of higher priorities arrive. A request of a higher priority that would
// push p past that takes nothing and asks again when the share has room
// (a few milliseconds later, as a rule), so that such requests are not
// served in arrival order among themselves. Without WithMinShare, a
// priority uses what those above it leave, and may wait for as long as
// they keep the bucket busy.
//
// The share is the Limiter's: give every Limiter of the fleet the same.
// Several priorities may have one each. It panics if p is not below
// MaxPriority (no priority is above MaxPriority to push it) or share is
// not above 0 and below 1.
func WithMinShare(p int, share float64) Option {
	if p < 0 || p >= MaxPriority {
		panic(fmt.Sprintf("quota: WithMinShare(%d, ...): a minimum share is for a priority from 0 to %d", p, MaxPriority-1))
	}
	if !(share > 0 && share < 1) {
		panic(fmt.Sprintf("quota: WithMinShare(%d, %v): the share must be above 0 and below 1", p, share))
	}
	return limiterOpt(func(c *config) {
		shares := make([]float64, MaxPriority)
		copy(shares, c.minShares)
		shares[p] = share
		c.minShares = shares
	})
}

type priorityKey struct{}

// ContextWithPriority returns a copy of ctx that asks for tokens at
// priority p (see WithPriority): for a Limiter's Wait, WaitN, Allow,
// AllowN and Reserve, and for a Transport's requests without
// WithPriority.
func ContextWithPriority(ctx context.Context, p int) context.Context {
	return context.WithValue(ctx, priorityKey{}, p)
}

// priorityOf returns the priority ctx asks for: 0 unless it was given one.
func priorityOf(ctx context.Context) int {
	p, _ := ctx.Value(priorityKey{}).(int)
	return p
}
