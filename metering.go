package quota

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/ratelimit"
	"github.com/sharedquota/quota/internal/request"
	"github.com/sharedquota/quota/internal/store"
	"github.com/sharedquota/quota/internal/usage"
)

// A Metering tells a Transport how to meter an API whose requests count
// against several limits at once, each with an amount of its own, and
// whose real usage is known only from the response: an LLM API's input
// and output tokens. Package llm (github.com/sharedquota/quota/llm)
// returns the Meterings of Anthropic's and OpenAI's APIs.
type Metering struct {
	// Meters are the limits beside the requests' (MeterRequests), which
	// the Transport's Limit is.
	Meters []Meter

	// Estimate returns what a request reserves of each Meter, from the
	// request and its body, read whole (the request sent carries it
	// again; body is nil for a request without one). A Meter it leaves out
	// is reserved nothing. An error fails the request, wrapped in
	// ErrInvalidTokens, before anything is sent.
	Estimate func(req *http.Request, body []byte) (Usage, error)

	// Usage returns the UsageReader that learns from resp what its
	// request used, or nil when resp will not tell. When the usage is
	// known, the reservation is settled with it (see Reservation.Settle);
	// a response that ends before its usage is known keeps the whole
	// reservation. Nil: no response settles.
	Usage func(resp *http.Response) UsageReader

	// NoGiveBack names the Meters the provider never gives back, having
	// charged a request's reservation when it arrived: a settle takes more
	// of them when the usage exceeds the reservation, never less.
	NoGiveBack []string

	// Remaining reads from the response headers what the provider says
	// remains of each Meter, as WithProviderHeaders does for one limit:
	// each Meter's shared bucket is lowered to it, never raised. Nil: the
	// headers lower nothing.
	Remaining func(h http.Header, now time.Time) map[string]float64
}

// A UsageReader learns what a request used from its response body: it is
// written the body's bytes as the caller reads them, in order, and asked
// for the usage once the body ends (read to its end, failed or closed).
type UsageReader interface {
	io.Writer
	// Usage returns what the response says its request used, and false
	// when it did not say.
	Usage() (Usage, bool)
}

// WithMetering makes a Transport meter its requests on several limits at
// once, as m says: each request reserves one of the Transport's Limit
// (its requests) and m.Estimate's amounts of m.Meters, in one script
// call, and its reservation is settled from its response, headers, body
// or event stream, without the caller losing a byte of it. A request that
// fails before it was written hands its reservation back. It panics if
// m.Estimate is nil, if a Meter's name is invalid, repeated or
// MeterRequests, or its Limit invalid (see Limit.Validate), if NoGiveBack
// names no Meter, or beside WithLayers or WithSettle (give further limits
// as Meters, and settle through m.Usage).
func WithMetering(m Metering) TransportOption {
	if m.Estimate == nil {
		panic("quota: WithMetering with a nil Estimate")
	}
	mt := &metering{Metering: m}
	mt.Meters = append([]Meter(nil), m.Meters...)
	mt.NoGiveBack = append([]string(nil), m.NoGiveBack...)
	names := []string{MeterRequests}
	for _, meter := range mt.Meters {
		if err := store.CheckMeter(meter.Name); err != nil {
			panic("quota: WithMetering: " + err.Error())
		}
		if slices.Contains(names, meter.Name) {
			panic(fmt.Sprintf("quota: WithMetering: meter %q given twice, or named as the requests' meter", meter.Name))
		}
		meter.Limit.mustValidate(fmt.Sprintf("WithMetering: meter %q", meter.Name))
		names = append(names, meter.Name)
	}
	mt.kept = make([]bool, len(names))
	for _, kept := range mt.NoGiveBack {
		i := slices.Index(names, kept)
		if i < 0 {
			panic(fmt.Sprintf("quota: WithMetering: NoGiveBack names %q, which is no Meter", kept))
		}
		mt.kept[i] = true
	}
	return transportOpt(func(c *transportConfig) { c.metering = mt })
}

// metering is a Transport's Metering, checked, with what a request's
// Reservation needs of it worked out once.
type metering struct {
	Metering
	// kept[i]: the provider never gives back what the i-th meter of a
	// request reserves (MeterRequests, then Meters); nil when none.
	kept []bool
}

// meterAsk turns o, the ask of a request to a metered Transport, into the
// ask of its Meters, with the request it is to send.
func (t *Transport) meterAsk(req *http.Request, o ask) (ask, *http.Request, error) {
	m := t.cfg.metering
	body, sent, err := request.Read(req, maxRequestBody)
	if errors.Is(err, request.ErrTooLarge) {
		err = fmt.Errorf("%w: a request body over %d MiB to estimate", ErrInvalidTokens, maxRequestBody>>20)
	}
	if err != nil {
		return o, nil, err
	}
	use, err := m.Estimate(req, body)
	if err != nil {
		return o, nil, fmt.Errorf("%w: estimating %s %s: %w", ErrInvalidTokens, req.Method, req.URL.Redacted(), err)
	}
	meters := make([]Meter, 0, 1+len(m.Meters))
	meters = append(meters, Meter{Name: MeterRequests, Limit: o.lims[0]})
	meters = append(meters, m.Meters...)
	if use == nil {
		use = Usage{}
	}
	if _, ok := use[MeterRequests]; !ok {
		use[MeterRequests] = o.n
	}
	mo, err := meterAsk(meters, use)
	if err != nil {
		return o, nil, err
	}
	mo.slots, mo.noWait, mo.pool = o.slots, o.noWait, o.pool
	return mo, sent, nil
}

// maxRequestBody bounds the body a metered Transport reads whole to
// estimate a request.
const maxRequestBody = 64 << 20

// checkPolicies logs, once for each bucket and Meter, a Meter whose Limit
// refills faster than the provider's RateLimit-Policy of the same name
// says it allows: a fleet held to it meets the provider's refusals.
func (t *Transport) checkPolicies(name string, o ask, h http.Header) {
	ps := ratelimit.Policies(h)
	for i, meter := range o.meters {
		rate, ok := ps[meter]
		if !ok || o.lims[i].Rate <= rate*(1+1e-9) {
			continue
		}
		if _, warned := t.warned.LoadOrStore(name+"\x00"+meter, true); warned {
			continue
		}
		t.limiter.cfg.logger.Warn("quota: the provider's RateLimit-Policy allows a meter less than its Limit",
			slog.String("bucket", name), slog.String("meter", meter),
			slog.Float64("limit_per_second", o.lims[i].Rate), slog.Float64("policy_per_second", rate))
	}
}

// lows returns what the response headers h say remains of each Meter of
// o, below zero for a Meter they say nothing of, or nil when they say
// nothing, or nothing below a Meter's burst.
func (t *Transport) lows(o ask, h http.Header, now time.Time) []float64 {
	m := t.cfg.metering
	if m == nil || m.Remaining == nil {
		return nil
	}
	return usage.Lower(m.Remaining(h, now), o.meters, func(i int) float64 { return o.lims[i].burst() })
}
