package quota

import (
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/sharedquota/quota/internal/adapt"
	"github.com/sharedquota/quota/internal/pool"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// An Option configures a Limiter: NewLimiter takes it, and so does
// NewTransport for the Limiter it makes. Every Option is a
// TransportOption.
type Option interface {
	TransportOption
	limiterOption()
}

// A TransportOption configures a Transport. The options that only a
// Transport uses (WithBase, WithKey, WithLimits, WithLayers, WithCost,
// WithSettle, WithMaxPause, WithProviderHeaders, WithConcurrency,
// WithNoWait, WithLimiter) are TransportOptions and not Options, so that
// NewLimiter refuses them at compile time.
type TransportOption interface {
	apply(*config)
}

// limiterOpt is an Option; transportOpt only a TransportOption.
type (
	limiterOpt   func(*config)
	transportOpt func(*transportConfig)
)

func (f limiterOpt) apply(c *config) {
	f(c)
	c.limiterOpts++
}
func (limiterOpt) limiterOption()      {}
func (f transportOpt) apply(c *config) { f(&c.tr) }

// config is a Limiter's configuration, and beside it the Transport's.
type config struct {
	prefix         string
	maxWait        time.Duration
	noBatching     bool
	clock          func() time.Time
	policy         Policy
	dryRun         bool
	logger         *slog.Logger
	tracerProvider trace.TracerProvider
	meterProvider  metric.MeterProvider
	metricKeys     bool
	name           string
	slotLease      time.Duration
	minShares      []float64 // by priority; nil: none
	tenants        *Tenants  // nil: none (see WithTenants)

	tr          transportConfig // the TransportOptions given
	limiterOpts int             // Options given, which WithLimiter refuses beside it
}

// transportConfig is a Transport's configuration, beside its Limiter's.
type transportConfig struct {
	limiter         *Limiter // shared; nil: the Transport's own
	base            http.RoundTripper
	key             KeyFunc
	limits          map[string]Limit
	layers          []Limit
	cost            func(*http.Request) float64
	settle          func(*http.Response) (float64, bool)
	maxPause        time.Duration
	noWait          bool
	providerHeaders bool
	concurrency     int
	slotLinger      time.Duration // below zero: the bucket's observed p99
	metering        *metering
	priority        func(*http.Request) int
	tenant          func(*http.Request) string
	adapt           *adapt.Learner
	pool            *pool.Pool // nil: none (see WithPool)
}

func newConfig(opts []TransportOption) config {
	c := config{
		prefix:    DefaultPrefix,
		maxWait:   DefaultMaxWait,
		policy:    FailClosed,
		logger:    slog.Default(),
		slotLease: DefaultSlotLease,
		tr: transportConfig{
			base:       http.DefaultTransport,
			key:        Host,
			maxPause:   DefaultMaxPause,
			slotLinger: -1,
		},
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
	return limiterOpt(func(c *config) { c.prefix = prefix })
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
	return limiterOpt(func(c *config) { c.maxWait = d })
}

// WithNoWait makes a Transport refuse a request at once, when its tokens
// are not available now, instead of waiting for them: RoundTrip then takes
// nothing, sends nothing, closes the request body and returns an error
// matching ErrWouldWait that names the bucket and how long the wait would
// have been. Under a retrying client the refusal is retried after the
// client's backoff (it is not Permanent). A Limiter's callers who must not
// wait use Limiter.Allow.
func WithNoWait() TransportOption {
	return transportOpt(func(c *transportConfig) { c.noWait = true })
}

// WithLimiter makes a Transport take its tokens from l, shared with the
// other Transports and callers that use l, instead of from a Limiter of
// its own: stacked or per-endpoint Transports then share one subscription
// to Redis, one view of each bucket's pause and Limit, and one breaker.
// NewTransport's rdb is then unused and may be nil, and the options that
// configure a Limiter (WithPrefix, WithPolicy, WithMaxWait, WithDryRun,
// ...) are l's own: NewTransport panics when one is given beside
// WithLimiter, as it would have no effect. It panics if l is nil.
func WithLimiter(l *Limiter) TransportOption {
	if l == nil {
		panic("quota: WithLimiter(nil)")
	}
	return transportOpt(func(c *transportConfig) { c.limiter = l })
}

// WithNoBatching makes every acquisition a script call of its own.
//
// By default the callers of one bucket in one Limiter share script calls.
// A caller that finds no call for its bucket in flight goes at once, alone.
// Callers that arrive while one is in flight queue in arrival order, and all
// of them go in the next call when it returns (at most 256 a call): one
// Redis command serves them, each granted or refused on its own, in its
// place in the queue, its deadline counted from its own call. On a bucket
// with a queue, where callers ask again one interval apart, a caller that
// finds no call in flight holds its call for up to 50 ms, never past the
// end of the queue (before which its own grant cannot fall due), so that
// the callers arriving meanwhile go in it; a bucket that never makes anyone
// wait never holds. The shared call runs in the first caller's context, so
// a Redis tracing hook nests it under that caller's wait span; every wait
// span carries the size of its batch.
func WithNoBatching() Option {
	return limiterOpt(func(c *config) { c.noBatching = true })
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
	return limiterOpt(func(c *config) { c.clock = now })
}

// WithPolicy sets what happens while Redis is unavailable, FailClosed by
// default.
func WithPolicy(p Policy) Option {
	return limiterOpt(func(c *config) { c.policy = p })
}

// WithDryRun makes a Limiter, or a Transport, take tokens and measure as
// usual but never delay or refuse anything: for rolling quota out on a
// running fleet, to see what it would do before it does it. Wait returns
// at once where it would have slept (on a queue or on a provider's pause)
// or refused, Limiter.Allow reports true, and a Transport sends every
// request.
//
// The buckets are charged as when enforced: a take whose wait would pass
// the context's deadline, or MaxWait without one, takes nothing, and a
// provider's Retry-After still pauses the bucket. While Redis is
// unavailable the Policy is measured the same way: FallbackLocal's local
// share is charged, FailClosed's refusals are counted.
//
// Spans and metrics record what would have happened, with the attribute
// quota.dry_run=true: the outcome and error.type enforcement would have
// given (refused as would_exceed_deadline, unavailable, would_wait...),
// and as quota.wait.seconds and quota.wait.duration the wait the caller
// would have had, not the time it took (zero for a refusal; for a wait
// past MaxWait without a deadline, the wait the script replied). Invalid
// input, a Redis error and a KeyFunc's failure are recorded the same way
// and fail nothing; only the caller's own context ending still returns its
// error, since that is not quota refusing. Nothing is logged per request.
func WithDryRun() Option {
	return limiterOpt(func(c *config) { c.dryRun = true })
}

// WithLogger sets the logger for changes of mode, slog.Default() by default.
// It panics if l is nil: a limiter that cannot say it has degraded must not
// start.
func WithLogger(l *slog.Logger) Option {
	if l == nil {
		panic("quota: WithLogger(nil)")
	}
	return limiterOpt(func(c *config) { c.logger = l })
}

// WithTracerProvider sets the provider of the tracer for wait spans, the
// global provider by default.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return limiterOpt(func(c *config) { c.tracerProvider = tp })
}

// WithMeterProvider sets the provider of the meter for the package's
// metrics, the global provider by default.
func WithMeterProvider(mp metric.MeterProvider) Option {
	return limiterOpt(func(c *config) { c.meterProvider = mp })
}

// WithMetricKeys adds the bucket's name (quota.key) to the attributes of
// the acquisition metrics. Leave it off where names come from untrusted
// input or are many: each name is a time series. Spans always carry it.
func WithMetricKeys() Option {
	return limiterOpt(func(c *config) { c.metricKeys = true })
}

// WithName names the Limiter in its logs and in the quota.limiter attribute
// of the quota.limiter.mode gauge, the Redis address by default.
func WithName(name string) Option {
	return limiterOpt(func(c *config) { c.name = name })
}

// WithBase sets the RoundTripper a Transport delegates to,
// http.DefaultTransport by default or when rt is nil.
func WithBase(rt http.RoundTripper) TransportOption {
	return transportOpt(func(c *transportConfig) {
		if rt == nil {
			rt = http.DefaultTransport
		}
		c.base = rt
	})
}

// WithKey sets how a Transport names the bucket of a request, Host by
// default. It panics if f is nil.
func WithKey(f KeyFunc) TransportOption {
	if f == nil {
		panic("quota: WithKey(nil)")
	}
	return transportOpt(func(c *transportConfig) { c.key = f })
}

// WithCost sets how many tokens a request takes, 1 by default: a batch
// endpoint, or an LLM call priced by its size. A cost that is not a finite
// number above zero fails the request with ErrInvalidTokens, and one larger
// than the burst with ErrExceedsBurst, before anything is sent. It panics
// if f is nil.
func WithCost(f func(*http.Request) float64) TransportOption {
	if f == nil {
		panic("quota: WithCost(nil)")
	}
	return transportOpt(func(c *transportConfig) { c.cost = f })
}

// WithSettle makes a Transport settle each request's cost once its response
// arrives: f reads what the request really cost (from a usage header, say)
// and reports false when the response does not say. Tokens the cost of
// WithCost missed are then taken from the bucket, without waiting, so that
// the next callers wait for them; tokens it overcounted are given back. It
// panics if f is nil.
func WithSettle(f func(*http.Response) (float64, bool)) TransportOption {
	if f == nil {
		panic("quota: WithSettle(nil)")
	}
	return transportOpt(func(c *transportConfig) { c.settle = f })
}

// WithMaxPause bounds the pause that a provider's 429 or 503 response with
// Retry-After puts on the whole bucket, DefaultMaxPause (5 minutes) by
// default, so that a hostile or broken header cannot stop the fleet for a
// day. Zero turns the pause off: each worker then finds the 429 on its own.
// It panics if d is negative.
func WithMaxPause(d time.Duration) TransportOption {
	if d < 0 {
		panic(fmt.Sprintf("quota: WithMaxPause(%v): the pause must not be negative", d))
	}
	return transportOpt(func(c *transportConfig) { c.maxPause = d })
}

// WithConcurrency makes a Transport hold one of n concurrency slots of the
// request's bucket while the request is in flight, so that at most n
// requests of a bucket are in flight at once across every process that
// shares the Redis, as providers limit concurrent requests beside their
// rate. The request waits out a pause, then for its slot, then for its
// tokens, so that it never goes on tokens taken before it waited for a
// slot. Just before it is sent, a slot whose lease has less than a quarter
// left is renewed, and one whose lease ended (its process stalled longer
// than the lease, and the slot may have gone to another) is given up: the
// request queues again.
//
// A request holds its slot from its grant until the first of: its
// response body is read to the end, its response body is closed, or
// RoundTrip returns an error. An error before the request was written (a
// dial that failed, a refused grant) releases the slot at once. A request
// whose context ends after it was written, or whose response body fails,
// may still be at work at the provider, which counts it: its slot lingers
// (see WithSlotLinger). A response without a body (http.NoBody) releases it
// at once. A response whose body is never closed holds its slot until the
// body is garbage collected, so close bodies as net/http asks. Waiting for
// a slot is by priority (see WithPriority), then first come, first served,
// across the fleet, and lasts until the request's context ends (see Limiter.AcquireSlot). It panics if n is less
// than 1.
func WithConcurrency(n int) TransportOption {
	if n < 1 {
		panic(fmt.Sprintf("quota: WithConcurrency(%d): want at least one slot", n))
	}
	return transportOpt(func(c *transportConfig) { c.concurrency = n })
}

// WithSlotLinger sets how long a concurrency slot stays held after its
// request ended while the provider may still work on it: RoundTrip failed
// after the request was written (its context ended, the connection broke),
// a response body failed, or one was closed before its end as its
// request's context ended. By default a slot lingers for the 99th
// percentile of the bucket's response times measured by this Transport
// (from the request sent to its body read to the end, the latest 128),
// and for the slot lease until 16 are known. Zero releases at once. It
// panics if d is negative.
func WithSlotLinger(d time.Duration) TransportOption {
	if d < 0 {
		panic(fmt.Sprintf("quota: WithSlotLinger(%v): the linger must not be negative", d))
	}
	return transportOpt(func(c *transportConfig) { c.slotLinger = d })
}

// WithSlotLease sets the lease of a concurrency slot, DefaultSlotLease
// (10s) by default: the Limiter renews the leases of the slots it holds, and
// of its callers waiting for one, every quarter lease, so that the slots of
// a process that dies come back to the fleet at most d after its last
// renewal. A shorter lease brings them back sooner and costs more renewals;
// a lease shorter than the process's longest stall (a GC pause, a host
// suspended) lets the fleet exceed its slots while it stalls. It panics if d
// is below a millisecond.
func WithSlotLease(d time.Duration) Option {
	if d < time.Millisecond {
		panic(fmt.Sprintf("quota: WithSlotLease(%v): want at least a millisecond", d))
	}
	return limiterOpt(func(c *config) { c.slotLease = d })
}

// WithProviderHeaders makes a Transport read the provider's rate-limit
// header fields (RateLimit, RateLimit-Remaining, X-RateLimit-Remaining and
// their resets): when the provider says fewer requests remain than the
// bucket holds, the bucket is lowered to match, never raised. The fleet then
// follows the provider's own count, for example when another system shares
// the account. It costs one more Redis call for responses that report fewer
// remaining than the burst.
func WithProviderHeaders() TransportOption {
	return transportOpt(func(c *transportConfig) { c.providerHeaders = true })
}
