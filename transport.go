package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptrace"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/pool"
	"github.com/sharedquota/quota/internal/ratelimit"
	"github.com/sharedquota/quota/internal/request"
	"github.com/sharedquota/quota/internal/updates"
	"github.com/sharedquota/quota/internal/usage"
)

// Transport is an http.RoundTripper that waits for a token from the
// request's bucket before handing the request to its base RoundTripper. Set
// it as an http.Client's Transport; under a retrying client every attempt
// takes its own token.
//
// What the provider answers flows back into the bucket: a 429 or 503 with
// Retry-After, or a Google API's RetryInfo, pauses the bucket for the whole
// fleet (see WithMaxPause), and on request its rate-limit headers lower it
// (WithProviderHeaders) and its real costs settle it (WithSettle).
//
// A Transport is safe for concurrent use and never modifies the request.
type Transport struct {
	limiter *Limiter
	cfg     transportConfig
	limit   Limit
	times   request.Times // of the responses whose requests held a slot
	warned  sync.Map      // "<bucket>\x00<meter>": a RateLimit-Policy below the Meter's Limit was logged
}

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport that takes one token per request from
// buckets in rdb, each refilled at lim unless WithLimits names it, with a
// Limiter of its own, or WithLimiter's. By default it delegates to
// http.DefaultTransport and names the bucket after the request's host. It
// panics if lim is invalid (see Limit.Validate), or rdb is nil without
// WithLimiter.
func NewTransport(rdb redis.Scripter, lim Limit, opts ...TransportOption) *Transport {
	lim.mustValidate("NewTransport")
	cfg := newConfig(opts)
	if cfg.tr.metering != nil && (len(cfg.tr.layers) > 0 || cfg.tr.settle != nil) {
		panic("quota: NewTransport with WithMetering and WithLayers or WithSettle: give further limits as Meters, and settle through the Metering's Usage")
	}
	l := cfg.tr.limiter
	switch {
	case l == nil:
		l = newLimiter(rdb, cfg)
	case cfg.limiterOpts > 0:
		panic("quota: NewTransport with WithLimiter and an Option of the Limiter's own (WithPrefix, WithPolicy, ...), which would have no effect: give it to NewLimiter")
	}
	if p := cfg.tr.pool; p != nil {
		if m := cfg.tr.metering; m != nil {
			p.Fit(1 + len(m.Meters))
		} else {
			p.Fit(1 + len(cfg.tr.layers))
		}
	}
	return &Transport{limiter: l, cfg: cfg.tr, limit: lim}
}

// RoundTrip waits for a token, then sends req with the base RoundTripper.
// When no token can be had (an invalid cost or key, the request's
// context ending, Redis unavailable under FailClosed, none available now
// WithNoWait) it closes the request body and returns the Limiter's error
// without sending anything. WithDryRun, it sends every request at once
// unless its context has ended.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	name, err := t.cfg.key(req)
	if err != nil {
		err = fmt.Errorf("%w: %w", ErrInvalidKey, err)
		if t.limiter.cfg.dryRun {
			t.limiter.recordFailure(req.Context(), err)
			return t.cfg.base.RoundTrip(req)
		}
		closeBody(req)
		return nil, err
	}
	lims := t.limitsFor(name)
	cost := 1.0
	if t.cfg.cost != nil {
		cost = t.cfg.cost(req)
	}
	o := ask{n: cost, lims: lims, slots: t.cfg.concurrency, noWait: t.cfg.noWait, class: -1, pool: t.cfg.pool.Take()}
	sent := req
	if t.cfg.metering != nil {
		if o, sent, err = t.meterAsk(req, o); err != nil {
			closeBody(req)
			return nil, err
		}
	}
	if t.cfg.priority != nil {
		o.class = t.cfg.priority(req)
	}
	if t.cfg.tenant != nil {
		o.tenant, o.tenantSet = t.cfg.tenant(req), true
	}
	slot, err := t.limiter.acquire(req.Context(), name, o)
	if err != nil {
		closeBody(sent)
		return nil, err
	}
	if p := o.pool; p != nil { // sent to the deployment chosen, as its bucket
		name, sent = p.Send(name, sent)
		for i, lim := range p.Lims[p.Chosen] {
			o.lims[i] = Limit(lim)
		}
		req = sent
	}
	if slot == nil && t.cfg.metering == nil {
		start := time.Now()
		resp, err := t.cfg.base.RoundTrip(req)
		if err == nil {
			t.learn(req.Context(), name, o, resp, nil, start)
		}
		return resp, err
	}
	return t.send(sent, name, o, slot)
}

// send sends req on slot, when not nil, which it holds until the provider
// is done with the request: to the end of the response body, or for a
// linger after the request ended while the provider may still work on it.
// A metered request's reservation is settled from its response, or handed
// back when the request failed before it was written.
func (t *Transport) send(req *http.Request, name string, o ask, slot *Slot) (*http.Response, error) {
	ctx := req.Context()
	var res *Reservation
	if t.cfg.metering != nil {
		res = &Reservation{l: t.limiter, ctx: context.WithoutCancel(ctx), name: name, o: o, maxPause: t.cfg.maxPause,
			kept: t.cfg.metering.kept}
	}
	for slot != nil {
		ok, err := slot.confirm(ctx)
		if ok {
			break
		}
		if err != nil {
			if cerr := t.limiter.classify(ctx, err); !errors.Is(cerr, ErrUnavailable) {
				closeBody(req)
				return nil, cerr
			}
			b, _ := t.limiter.bucket(name, o.lims, o.meters...)
			t.limiter.trip(b, err)
		}
		// The slot's lease ended before the request went: it queues again,
		// for a slot alone when its tokens are a deployment's of a pool.
		if p := o.pool; p != nil {
			slot, err = t.limiter.acquireSlotSpan(ctx, p.Name, o.slots)
		} else {
			slot, err = t.limiter.acquire(ctx, name, o)
		}
		if err != nil {
			closeBody(req)
			return nil, err
		}
	}
	var wrote atomic.Bool
	sent := req.WithContext(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
		WroteHeaders: func() { wrote.Store(true) },
	}))
	start := time.Now()
	resp, err := t.cfg.base.RoundTrip(sent)
	if err != nil {
		if wrote.Load() {
			slot.linger(t.linger(name))
		} else {
			slot.Release()
			res.Cancel() // the provider never saw it
		}
		return nil, err
	}
	var ur *usage.Locked[Usage]
	if res != nil && t.cfg.metering.Usage != nil {
		if r := t.cfg.metering.Usage(resp); r != nil {
			ur = &usage.Locked[Usage]{R: r}
		}
	}
	var lows []float64
	if res != nil {
		t.checkPolicies(name, o, resp.Header)
		if t.limiter.Mode() == ModeShared {
			lows = t.lows(o, resp.Header, time.Now())
		}
	}
	if ur != nil {
		res.lows, res.lowsAt, lows = lows, time.Now(), nil // they ride on the settle
	}
	t.learn(ctx, name, o, resp, lows, start)
	if slot == nil && ur == nil {
		return resp, nil
	}
	var seen io.Writer
	if ur != nil {
		seen = ur
	}
	request.Watch(resp, seen, func(end request.End) {
		if ur != nil {
			// Settled only with the usage the response told: a body that
			// ended before it keeps the whole reservation.
			if u, ok := ur.Usage(); ok {
				res.Settle(u)
			} else {
				t.limiter.obs.Unknown(ctx)
				res.lower()
			}
		}
		if slot == nil {
			return
		}
		switch {
		case end == request.Done:
			t.times.Add(name, time.Since(start))
			slot.Release()
		case end == request.Closed && ctx.Err() == nil:
			slot.Release() // the caller is done with it
		default:
			slot.linger(t.linger(name))
		}
	})
	return resp, nil
}

// linger returns how long a slot of the bucket called name stays held
// after its request ended while the provider may still work on it.
func (t *Transport) linger(name string) time.Duration {
	if t.cfg.slotLinger >= 0 {
		return t.cfg.slotLinger
	}
	if d, ok := t.times.Quantile(name, 0.99); ok {
		return d
	}
	return t.limiter.cfg.slotLease
}

// learn passes on to the bucket what the response to a request sent at
// start says of the provider's limit, in the background: the response
// goes back to the caller at once. It does nothing while Redis is
// unavailable. The script computes each update with the Limit in force
// and within the pause; learn bounds a settle (see usage.Bound).
func (t *Transport) learn(ctx context.Context, name string, o ask, resp *http.Response, lows []float64, start time.Time) {
	if t.limiter.Mode() != ModeShared {
		return
	}
	cost := o.n
	b, err := t.limiter.inForce(name, o.lims, o.meters)
	if err != nil {
		return // cannot be: the take resolved the same bucket
	}
	var us []updates.Update
	st := t.limiter.store
	now := time.Now()
	pause := func(d time.Duration) updates.Update {
		return updates.Update{Kind: updates.Pause, Run: func(ctx context.Context) error {
			d := min(d, t.cfg.maxPause)
			obs.Pause(ctx, d)
			return st.Pause(ctx, b.Bucket, d)
		}}
	}
	if d, ok := ratelimit.RetryAfter(resp, now); ok && t.cfg.maxPause > 0 {
		us = append(us, pause(d))
	}
	if r, ok := t.cfg.adapt.Response(name, resp.StatusCode, resp.Header, o.meters, now.Sub(start), lows, now); ok {
		us = append(us, updates.Update{Kind: updates.Refuse, Run: func(ctx context.Context) error { return st.Refuse(ctx, b.Bucket, r) }})
	}
	if t.cfg.providerHeaders && o.meters == nil { // a Metering reads its own (Remaining)
		if remaining, reset, ok := ratelimit.Remaining(resp.Header, now); ok {
			if remaining < 1 && reset > 0 && t.cfg.maxPause > 0 {
				us = append(us, pause(reset))
			} else {
				us = append(us, updates.Update{Kind: updates.Lower, Run: func(ctx context.Context) error {
					return st.Lower(ctx, b.Bucket, remaining)
				}})
			}
		}
	}
	if lows != nil {
		us = append(us, updates.Update{Kind: updates.Lower, Run: func(ctx context.Context) error { return st.LowerEach(ctx, b.Bucket, lows) }})
	}
	if t.cfg.settle != nil {
		if real, ok := t.cfg.settle(resp); ok && real >= 0 && !math.IsInf(real, 0) && real != cost {
			extra := make([]float64, len(b.Lims))
			for i := range extra {
				extra[i] = real - cost
			}
			if u, ok := t.limiter.settle(ctx, b, o, extra, nil, t.cfg.maxPause); ok {
				us = append(us, u)
			}
		}
	}
	if len(us) > 0 {
		t.limiter.startUpdates(ctx, b, us)
	}
}

// WithPool makes a Transport send each request to one of a pool of
// deployments, each its own bucket (named "pool}{deployment", the pool
// named by the KeyFunc) whose first layers are limits[deployment] in place
// of NewTransport's Limit and the layers of WithLayers, or of the Meters'
// Limits under WithMetering (requests first, then the Meters in order).
// One script call takes the request's tokens from the deployment that
// grants them soonest; among those that grant at once, the one with the
// most room relative to its Limits; a last resort only when no other
// grants at once. route returns the request for that deployment (its URL,
// its credentials), leaving req as it is. A Retry-After, a settle and the
// provider's headers go to the deployment that answered. Tenants share
// each deployment by weight; WithConcurrency's slots are the pool's (see
// docs/pools.md). It panics on a pool it cannot serve, saying why.
func WithPool(route func(req *http.Request, deployment string) *http.Request, limits map[string][]Limit, lastResort ...string) TransportOption {
	p, err := pool.New(slices.Collect(maps.Keys(limits)), lastResort, route)
	for _, d := range p.Names {
		lims, lerr := resolveAll(limits[d])
		if p.Lims = append(p.Lims, lims); err == nil && lerr != nil {
			err = fmt.Errorf("deployment %q: %w", d, lerr)
		}
	}
	if err != nil {
		panic("quota: WithPool: " + err.Error())
	}
	return transportOpt(func(c *transportConfig) { c.pool = &p })
}

// Limiter returns the Limiter the Transport takes its tokens from.
func (t *Transport) Limiter() *Limiter { return t.limiter }

// CloseIdleConnections closes the idle connections of the base
// RoundTripper, if it has any.
func (t *Transport) CloseIdleConnections() {
	if c, ok := t.cfg.base.(interface{ CloseIdleConnections() }); ok {
		c.CloseIdleConnections()
	}
}

// limitsFor returns the layers of the bucket named name: its own Limit,
// then those of WithLayers.
func (t *Transport) limitsFor(name string) []Limit {
	lim, ok := t.cfg.limits[name]
	if !ok {
		lim = t.limit
	}
	if len(t.cfg.layers) == 0 {
		return []Limit{lim}
	}
	return append([]Limit{lim}, t.cfg.layers...)
}

func closeBody(req *http.Request) {
	if req.Body != nil {
		req.Body.Close()
	}
}
