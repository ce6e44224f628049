package quota

import (
	"context"
	"net/http"

	"github.com/sharedquota/quota/internal/store"
)

// MaxPriority is the highest priority: priorities run from 0, the
// default, to MaxPriority.
const MaxPriority = store.MaxClass

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
	return transportOpt(func(c *config) { c.priority = f })
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
