package quota

import (
	"bytes"
	"fmt"
	"io"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// MeterRequests is the name of a metered Transport's first Meter: one a
// request (or WithCost's), refilled at the Limit the Transport is given
// (or WithLimits'), whose zero Burst is one minute of its Rate, as the
// LLM APIs' requests a minute hold. Its bucket's override (SetLimit) and
// pause apply to it.
const MeterRequests = "requests"

// A Metering tells a Transport how to meter an API whose requests count
// against several limits at once, each with an amount of its own, and
// whose real usage is known only from the response: an LLM API's input
// and output tokens. OpenAI and Anthropic return those APIs' Meterings.
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
// MeterRequests, if NoGiveBack names no Meter, or beside WithLayers or
// WithSettle (give further limits as Meters, and settle through m.Usage).
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
	return transportOpt(func(c *config) { c.metering = mt })
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
	body, sent, err := requestBody(req)
	if err != nil {
		return o, nil, err
	}
	use, err := m.Estimate(req, body)
	if err != nil {
		return o, nil, fmt.Errorf("%w: estimating %s %s: %w", ErrInvalidTokens, req.Method, req.URL.Redacted(), err)
	}
	meters := make([]Meter, 0, 1+len(m.Meters))
	meters = append(meters, Meter{Name: MeterRequests, Limit: minuteBurst(o.lims[0])})
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
	mo.slots, mo.noWait = o.slots, o.noWait
	return mo, sent, nil
}

// maxRequestBody bounds the body a metered Transport reads whole to
// estimate a request.
const maxRequestBody = 64 << 20

// requestBody returns req's body, read whole, and the request to send:
// req itself when its GetBody gives the body again, a clone that carries
// the body read otherwise.
func requestBody(req *http.Request) ([]byte, *http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, req, nil
	}
	if req.GetBody != nil {
		rc, err := req.GetBody()
		if err != nil {
			return nil, nil, err
		}
		defer rc.Close()
		body, err := readBody(rc)
		return body, req, err
	}
	body, err := readBody(req.Body)
	req.Body.Close()
	if err != nil {
		return nil, nil, err
	}
	sent := req.Clone(req.Context())
	sent.Body = io.NopCloser(bytes.NewReader(body))
	sent.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	sent.ContentLength = int64(len(body))
	return body, sent, nil
}

func readBody(r io.Reader) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r, maxRequestBody+1))
	if err != nil {
		return nil, err
	}
	if len(body) > maxRequestBody {
		return nil, fmt.Errorf("%w: a request body over %d MiB to estimate", ErrInvalidTokens, maxRequestBody>>20)
	}
	return body, nil
}

// checkPolicies logs, once for each bucket and Meter, a Meter whose Limit
// refills faster than the provider's RateLimit-Policy of the same name
// says it allows: a fleet held to it meets the provider's refusals.
func (t *Transport) checkPolicies(name string, o ask, h http.Header) {
	ps := policies(h)
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
	left := m.Remaining(h, now)
	if len(left) == 0 {
		return nil
	}
	each := make([]float64, len(o.meters))
	some := false
	for i, name := range o.meters {
		each[i] = -1
		if n, ok := left[name]; ok && n >= 0 && !math.IsInf(n, 0) && n < o.lims[i].burst() {
			each[i], some = n, true
		}
	}
	if !some {
		return nil
	}
	return each
}
