package quota

import (
	"fmt"
	"net/http"

	"github.com/redis/go-redis/v9"
)

// Transport is an http.RoundTripper that waits for a token from the
// request's bucket before handing the request to its base RoundTripper. Set
// it as an http.Client's Transport; under a retrying client every attempt
// takes its own token.
//
// A Transport is safe for concurrent use and never modifies the request.
type Transport struct {
	limiter *Limiter
	base    http.RoundTripper
	key     KeyFunc
	limit   Limit
	limits  map[string]Limit
}

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport that takes one token per request from
// buckets in rdb, each refilled at lim unless WithLimits names it. By
// default it delegates to http.DefaultTransport and names the bucket after
// the request's host. It panics if rdb is nil.
func NewTransport(rdb redis.Scripter, lim Limit, opts ...Option) *Transport {
	l := NewLimiter(rdb, opts...)
	return &Transport{
		limiter: l,
		base:    l.cfg.base,
		key:     l.cfg.key,
		limit:   lim,
		limits:  l.cfg.limits,
	}
}

// RoundTrip waits for a token, then sends req with the base RoundTripper.
// When no token can be had (an invalid Limit or key, the request's context
// ending, Redis unavailable under FailClosed) it closes the request body
// and returns the Limiter's error without sending anything.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	name, err := t.key(req)
	if err != nil {
		closeBody(req)
		return nil, fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	if err := t.limiter.Wait(req.Context(), name, t.limitFor(name)); err != nil {
		closeBody(req)
		return nil, err
	}
	return t.base.RoundTrip(req)
}

// Limiter returns the Limiter the Transport takes its tokens from.
func (t *Transport) Limiter() *Limiter { return t.limiter }

// CloseIdleConnections closes the idle connections of the base
// RoundTripper, if it has any.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

func (t *Transport) limitFor(name string) Limit {
	if l, ok := t.limits[name]; ok {
		return l
	}
	return t.limit
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}
