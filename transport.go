package quota

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptrace"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/request"
	"github.com/sharedquota/quota/internal/store"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Transport is an http.RoundTripper that waits for a token from the
// request's bucket before handing the request to its base RoundTripper. Set
// it as an http.Client's Transport; under a retrying client every attempt
// takes its own token.
//
// What the provider answers flows back into the bucket: a 429 or 503 with
// Retry-After pauses the bucket for the whole fleet (see WithMaxPause), and
// on request its rate-limit headers lower it (WithProviderHeaders) and its
// real costs settle it (WithSettle).
//
// A Transport is safe for concurrent use and never modifies the request.
type Transport struct {
	limiter *Limiter
	cfg     config
	limit   Limit
	times   request.Times // of the responses whose requests held a slot
	warned  sync.Map      // "<bucket>\x00<meter>": a RateLimit-Policy below the Meter's Limit was logged
}

var _ http.RoundTripper = (*Transport)(nil)

// NewTransport returns a Transport that takes one token per request from
// buckets in rdb, each refilled at lim unless WithLimits names it, with a
// Limiter of its own, or WithLimiter's. By default it delegates to
// http.DefaultTransport and names the bucket after the request's host. It
// panics if rdb is nil without WithLimiter.
func NewTransport(rdb redis.Scripter, lim Limit, opts ...TransportOption) *Transport {
	cfg := newConfig(opts)
	if cfg.metering != nil && (len(cfg.layers) > 0 || cfg.settle != nil) {
		panic("quota: NewTransport with WithMetering and WithLayers or WithSettle: give further limits as Meters, and settle through the Metering's Usage")
	}
	l := cfg.limiter
	if l == nil {
		l = newLimiter(rdb, cfg)
		return &Transport{limiter: l, cfg: l.cfg, limit: lim}
	}
	if cfg.limiterOpts > 0 {
		panic("quota: NewTransport with WithLimiter and an Option of the Limiter's own (WithPrefix, WithPolicy, ...), which would have no effect: give it to NewLimiter")
	}
	// The Limiter's options are its own; the Transport's come from opts.
	shared := l.cfg
	shared.limiter, shared.base, shared.key, shared.limits, shared.layers = l, cfg.base, cfg.key, cfg.limits, cfg.layers
	shared.cost, shared.settle, shared.maxPause, shared.noWait = cfg.cost, cfg.settle, cfg.maxPause, cfg.noWait
	shared.providerHeaders, shared.concurrency, shared.slotLinger = cfg.providerHeaders, cfg.concurrency, cfg.slotLinger
	shared.metering, shared.priority, shared.tenant = cfg.metering, cfg.priority, cfg.tenant
	return &Transport{limiter: l, cfg: shared, limit: lim}
}

// RoundTrip waits for a token, then sends req with the base RoundTripper.
// When no token can be had (an invalid Limit, cost or key, the request's
// context ending, Redis unavailable under FailClosed, none available now
// WithNoWait) it closes the request body and returns the Limiter's error
// without sending anything. WithDryRun, it sends every request at once
// unless its context has ended.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	name, err := t.cfg.key(req)
	if err != nil {
		err = fmt.Errorf("%w: %w", ErrInvalidKey, err)
		if t.cfg.dryRun {
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
	o := ask{n: cost, lims: lims, slots: t.cfg.concurrency, noWait: t.cfg.noWait, class: -1}
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
	if slot == nil && t.cfg.metering == nil {
		resp, err := t.cfg.base.RoundTrip(req)
		if err == nil {
			t.learn(req.Context(), name, o, resp, nil)
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
		// The slot's lease ended before the request went: it queues again.
		if slot, err = t.limiter.acquire(ctx, name, o); err != nil {
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
	var usage *watchedUsage
	if res != nil && t.cfg.metering.Usage != nil {
		if ur := t.cfg.metering.Usage(resp); ur != nil {
			usage = &watchedUsage{r: ur}
		}
	}
	var lows []float64
	if res != nil {
		t.checkPolicies(name, o, resp.Header)
		if t.limiter.Mode() == ModeShared {
			lows = t.lows(o, resp.Header, time.Now())
		}
	}
	if usage != nil {
		res.lows, res.lowsAt, lows = lows, time.Now(), nil // they ride on the settle
	}
	t.learn(ctx, name, o, resp, lows)
	if slot == nil && usage == nil {
		return resp, nil
	}
	var seen io.Writer
	if usage != nil {
		seen = usage
	}
	request.Watch(resp, seen, func(end request.End) {
		if usage != nil {
			// Settled only with the usage the response told: a body that
			// ended before it keeps the whole reservation.
			if u, ok := usage.Usage(); ok {
				res.Settle(u)
			} else {
				t.limiter.updates.unknown.Add(ctx, 1)
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

// watchedUsage serialises a UsageReader's calls: a body may be closed
// while another goroutine reads it.
type watchedUsage struct {
	mu sync.Mutex
	r  UsageReader
}

func (w *watchedUsage) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.r.Write(p)
}

func (w *watchedUsage) Usage() (Usage, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.r.Usage()
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

// learn passes on to the bucket what the response says of the provider's
// limit. The updates run in the background, so the response goes back to
// the caller at once. It does nothing while Redis is unavailable. The
// script computes each with the Limit in force and within the bucket's
// pause; learn bounds what a settle may take (see settleBound).
func (t *Transport) learn(ctx context.Context, name string, o ask, resp *http.Response, lows []float64) {
	if t.limiter.Mode() != ModeShared {
		return
	}
	cost := o.n
	b, err := t.limiter.inForce(name, o.lims, o.meters)
	if err != nil {
		return // cannot be: the take resolved the same bucket
	}
	var us []update
	st := t.limiter.store
	now := time.Now()
	pause := func(d time.Duration) update {
		return update{updatePause, func(ctx context.Context) error {
			d := min(d, t.cfg.maxPause)
			trace.SpanFromContext(ctx).SetAttributes(attrPause.Float64(d.Seconds()))
			return st.Pause(ctx, b.Bucket, d)
		}}
	}
	if d, ok := retryAfter(resp, now); ok && t.cfg.maxPause > 0 {
		us = append(us, pause(d))
	}
	if t.cfg.providerHeaders && o.meters == nil { // a Metering reads its own (Remaining)
		if remaining, reset, ok := rateLimitHeaders(resp.Header, now); ok {
			if remaining < 1 && reset > 0 && t.cfg.maxPause > 0 {
				us = append(us, pause(reset))
			} else {
				us = append(us, update{updateLower, func(ctx context.Context) error {
					return st.Lower(ctx, b.Bucket, remaining)
				}})
			}
		}
	}
	if lows != nil {
		us = append(us, update{updateLower, func(ctx context.Context) error { return st.LowerEach(ctx, b.Bucket, lows) }})
	}
	if t.cfg.settle != nil {
		if real, ok := t.cfg.settle(resp); ok && real >= 0 && !math.IsInf(real, 0) && real != cost {
			extra := real - cost
			slowest := math.Inf(1)
			for _, lim := range b.Lims {
				slowest = min(slowest, lim.Rate)
			}
			if bound := settleBound(slowest, t.cfg.maxPause); extra > bound {
				t.limiter.updates.cut.Add(ctx, extra-bound, metric.WithAttributes(attrKey.String(b.Name)))
				extra = bound
			}
			c := store.Tokens(extra)
			t.limiter.charge(ctx, b, o, store.Tokens(cost+extra), &c)
			id := settleID()
			us = append(us, update{updateSettle, func(ctx context.Context) error {
				return st.Adjust(ctx, b.Bucket, c, id)
			}})
		}
	}
	if len(us) > 0 {
		t.limiter.startUpdates(ctx, b, us)
	}
}

// settleID returns an id that makes a settle count once, however often
// the client sends it.
func settleID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
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
