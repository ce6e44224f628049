package quota

import (
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// DefaultPrefix is the prefix of every Redis key the package writes unless
// WithPrefix says otherwise.
const DefaultPrefix = "quota:"

// DefaultMaxWait is the longest single sleep of a Wait whose context has no
// deadline, unless WithMaxWait says otherwise.
const DefaultMaxWait = 5 * time.Second

// An Option configures a Limiter or a Transport. Options that only a
// Transport uses (WithBase, WithKey, WithLimits, WithLayers, WithCost,
// WithSettle, WithMaxPause, WithProviderHeaders) are ignored by NewLimiter.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	// Limiter
	prefix         string
	maxWait        time.Duration
	noBatching     bool
	clock          func() time.Time
	policy         Policy
	logger         *slog.Logger
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	metricKeys     bool
	name           string

	// Transport
	base            http.RoundTripper
	key             KeyFunc
	limits          map[string]Limit
	layers          []Limit
	cost            func(*http.Request) float64
	settle          func(*http.Response) (float64, bool)
	maxPause        time.Duration
	providerHeaders bool
}

func newConfig(opts []Option) config {
	c := config{
		prefix:   DefaultPrefix,
		maxWait:  DefaultMaxWait,
		policy:   FailClosed,
		logger:   slog.Default(),
		base:     http.DefaultTransport,
		key:      Host,
		maxPause: DefaultMaxPause,
	}
	for _, o := range opts {
		o.apply(&c)
	}
	return c
}

// WithPrefix sets the prefix of the Redis keys, DefaultPrefix ("quota:") by
// default. The bucket's name follows it inside a hash tag, so a bucket named
// api.example.com lives at quota:{api.example.com}.
func WithPrefix(prefix string) Option {
	return optionFunc(func(c *config) { c.prefix = prefix })
}

// WithMaxWait bounds a single sleep of Wait for callers whose context has
// no deadline, DefaultMaxWait (5s) by default. When their wait would be
// longer, Wait takes nothing, sleeps d and asks again; they keep no place in
// the queue meanwhile. A context with a deadline replaces the bound: its
// caller waits as long as the deadline allows, in its place. It panics if d
// is not positive.
func WithMaxWait(d time.Duration) Option {
	if d <= 0 {
		panic(fmt.Sprintf("quota: WithMaxWait(%v): the wait must be positive", d))
	}
	return optionFunc(func(c *config) { c.maxWait = d })
}

// WithBatching sets whether the callers of one bucket in one Limiter share
// script calls, true by default. A caller that finds no call for its bucket
// in flight goes at once, alone. Callers that arrive while one is in flight
// queue in arrival order, and all of them go in the next call when it
// returns (at most 256 a call): one Redis command serves them, each granted
// or refused on its own, in its place in the queue, its deadline counted
// from its own call. The shared call runs in the first caller's context, so
// a Redis tracing hook nests it under that caller's wait span; every wait
// span carries the size of its batch. WithBatching(false) makes every
// acquisition a call of its own.
func WithBatching(on bool) Option {
	return optionFunc(func(c *config) { c.noBatching = !on })
}

// WithClock makes the script use now, the callers' clock, instead of the
// Redis server's TIME. Use it only where the server refuses TIME in scripts.
// The bucket's state never moves backwards, but callers whose clocks
// disagree by up to S can together be granted up to S*Rate tokens more than
// the bucket allows in a window: a take stamped in one caller's past looks
// already refilled to a caller whose clock is ahead. It panics if now is nil.
func WithClock(now func() time.Time) Option {
	if now == nil {
		panic("quota: WithClock(nil)")
	}
	return optionFunc(func(c *config) { c.clock = now })
}

// WithPolicy sets what happens while Redis is unavailable, FailClosed by
// default.
func WithPolicy(p Policy) Option {
	return optionFunc(func(c *config) { c.policy = p })
}

// WithLogger sets the logger for changes of mode, slog.Default() by default.
// It panics if l is nil: a limiter that cannot say it has degraded must not
// start.
func WithLogger(l *slog.Logger) Option {
	if l == nil {
		panic("quota: WithLogger(nil)")
	}
	return optionFunc(func(c *config) { c.logger = l })
}

// WithTracerProvider sets the provider of the tracer for wait spans, the
// global provider by default.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) { c.tracerProvider = tp })
}

// WithMeterProvider sets the provider of the meter for the package's
// metrics, the global provider by default.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) { c.meterProvider = mp })
}

// WithMetricKeys adds the bucket's name (quota.key) to the attributes of
// the acquisition metrics. Leave it off where names come from untrusted
// input or are many: each name is a time series. Spans always carry it.
func WithMetricKeys() Option {
	return optionFunc(func(c *config) { c.metricKeys = true })
}

// WithName names the Limiter in its logs and in the quota.limiter attribute
// of the quota.limiter.mode gauge, the Redis address by default.
func WithName(name string) Option {
	return optionFunc(func(c *config) { c.name = name })
}

// WithBase sets the RoundTripper a Transport delegates to,
// http.DefaultTransport by default or when rt is nil.
func WithBase(rt http.RoundTripper) Option {
	return optionFunc(func(c *config) {
		if rt == nil {
			rt = http.DefaultTransport
		}
		c.base = rt
	})
}

// WithKey sets how a Transport names the bucket of a request, Host by
// default. It panics if f is nil.
func WithKey(f KeyFunc) Option {
	if f == nil {
		panic("quota: WithKey(nil)")
	}
	return optionFunc(func(c *config) { c.key = f })
}

// WithLimits gives the buckets named in m their own Limit; a Transport uses
// the Limit passed to NewTransport for every other bucket. The names are
// those the KeyFunc returns, for example "api.example.com" or
// "api.example.com/eu". The map is copied.
func WithLimits(m map[string]Limit) Option {
	cp := make(map[string]Limit, len(m))
	for k, v := range m {
		cp[k] = v
	}
	return optionFunc(func(c *config) { c.limits = cp })
}

// WithLayers makes every bucket of a Transport obey lims as well as its own
// Limit, as providers publish layered limits: PerSecond(10) for the bucket
// and WithLayers(PerMinute(300), PerDay(10000)). Each request takes its
// tokens from every layer in one script call, all or nothing.
func WithLayers(lims ...Limit) Option {
	cp := append([]Limit(nil), lims...)
	return optionFunc(func(c *config) { c.layers = cp })
}

// WithCost sets how many tokens a request takes, 1 by default: a batch
// endpoint, or an LLM call priced by its size. A cost that is not a finite
// number above zero fails the request with ErrInvalidTokens, and one larger
// than the burst with ErrExceedsBurst, before anything is sent. It panics
// if f is nil.
func WithCost(f func(*http.Request) float64) Option {
	if f == nil {
		panic("quota: WithCost(nil)")
	}
	return optionFunc(func(c *config) { c.cost = f })
}

// WithSettle makes a Transport settle each request's cost once its response
// arrives: f reads what the request really cost (from a usage header, say)
// and reports false when the response does not say. Tokens the cost of
// WithCost missed are then taken from the bucket, without waiting, so that
// the next callers wait for them; tokens it overcounted are given back. It
// panics if f is nil.
func WithSettle(f func(*http.Response) (float64, bool)) Option {
	if f == nil {
		panic("quota: WithSettle(nil)")
	}
	return optionFunc(func(c *config) { c.settle = f })
}

// WithMaxPause bounds the pause that a provider's 429 or 503 response with
// Retry-After puts on the whole bucket, DefaultMaxPause (5 minutes) by
// default, so that a hostile or broken header cannot stop the fleet for a
// day. Zero turns the pause off: each worker then finds the 429 on its own.
// It panics if d is negative.
func WithMaxPause(d time.Duration) Option {
	if d < 0 {
		panic(fmt.Sprintf("quota: WithMaxPause(%v): the pause must not be negative", d))
	}
	return optionFunc(func(c *config) { c.maxPause = d })
}

// WithProviderHeaders makes a Transport read the provider's rate-limit
// header fields (RateLimit, RateLimit-Remaining, X-RateLimit-Remaining and
// their resets): when the provider says fewer requests remain than the
// bucket holds, the bucket is lowered to match, never raised. The fleet then
// follows the provider's own count, for example when another system shares
// the account. It costs one more Redis call for responses that report fewer
// remaining than the burst.
func WithProviderHeaders() Option {
	return optionFunc(func(c *config) { c.providerHeaders = true })
}
