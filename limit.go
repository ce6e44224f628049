package quota

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/ratelimit"
)

// A Limit is the rate a bucket refills at and the burst it can hold. The
// burst is at least one token: a bucket that holds less grants no request
// of one. A bucket must fill from empty within a year (Burst/Rate at most
// 366 days).
//
// The zero Burst is the default burst: three seconds of Rate, and at
// least one token, the capacity that absorbs ordinary jitter without a
// visible burst at the provider. PerSecond, PerMinute, PerHour and PerDay
// leave Burst zero. A Limit holds the same burst wherever it is given (to
// NewTransport, WithLimits, WithLayers, a Meter, Wait, SetLimit or
// quotactl limit), metered or not, and String prints it: PerMinute(60)
// holds 3. Set Burst for a bucket that must hold more, as a day's layer
// may, or an LLM API's minute of tokens (llm.PerMinute) does.
//
// A Limit a program builds a Transport with (NewTransport's, WithLimits',
// WithLayers', the Meters' of WithMetering) is checked when it is given:
// an invalid one panics, naming the option and the Limit, as the options'
// other invalid values do. A Limit passed to a call (Wait, WaitN, Allow,
// Reserve, SetLimit) is the call's input: an invalid one fails the call
// with ErrInvalidLimit. Validate tells which Limits are valid.
type Limit struct {
	Rate  float64        // tokens per second, > 0
	Burst float64        // bucket capacity in tokens, at least 1; 0 means the default burst
	Reset time.Duration  // a daily Limit's (see Daily): the time of day, in [0, 24h), its Burst refills at
	Zone  *time.Location // a daily Limit's time zone (Rate 0); nil for a rate
}

// maxFill bounds the time a bucket takes to fill from empty. A bucket is a
// count of microseconds on the server's clock: a bound keeps that count
// exact, and no provider meters over more than a year.
const maxFill = 366 * 24 * time.Hour

// PerSecond returns a Limit of n tokens per second with the default burst
// (see Limit).
func PerSecond(n float64) Limit { return Limit{Rate: n} }

// PerMinute returns a Limit of n tokens per minute with the default burst
// (see Limit).
func PerMinute(n float64) Limit { return Limit{Rate: n / 60} }

// PerHour returns a Limit of n tokens per hour with the default burst
// (see Limit).
func PerHour(n float64) Limit { return Limit{Rate: n / 3600} }

// PerDay returns a Limit of n tokens per day with the default burst
// (see Limit).
func PerDay(n float64) Limit { return Limit{Rate: n / 86400} }

// Daily returns a count of n tokens a day that refills at once at the time
// of day at in loc (see docs/design.md): Daily(1500, 0, pacific) resets at
// midnight Pacific time. It panics if loc is nil, as time.Date does.
func Daily(n float64, at time.Duration, loc *time.Location) Limit {
	return Limit{Burst: n, Reset: at, Zone: daily.Zone(loc)}
}

// String describes the Limit with the burst it holds, for example "5/s
// burst 15" for PerSecond(5), "1500 a day from 00:00 UTC" for a Daily.
func (l Limit) String() string {
	return daily.String(l.Rate, l.burst(), l.Reset, l.Zone)
}

// burst returns the bucket capacity with the zero value resolved.
func (l Limit) burst() float64 {
	if l.Burst == 0 {
		return ratelimit.DefaultBurst(l.Rate)
	}
	return l.Burst
}

// Validate reports, with an error matching ErrInvalidLimit, why no bucket
// can be refilled at l: a Rate that is not a finite number above zero, a
// Burst that is neither zero nor a finite number of 1 or more, a bucket
// that would take more than 366 days to fill from empty, or a daily Limit
// with a Rate, a count (Burst) below 1 or a Reset outside [0, 24h). A
// Limit it accepts grants a request of one token.
func (l Limit) Validate() error {
	_, err := l.resolve()
	return err
}

// mustValidate panics if l is invalid, saying what of where, the option
// that was given it: a Limit a program builds a Transport with is fixed
// when it is built, and a mistake in it fails every request.
func (l Limit) mustValidate(where string) {
	if err := l.Validate(); err != nil {
		why := strings.TrimPrefix(err.Error(), ErrInvalidLimit.Error()+": ")
		panic(fmt.Sprintf("quota: %s: invalid Limit{Rate: %v, Burst: %v}: %s", where, l.Rate, l.Burst, why))
	}
}

// resolve validates l and returns it with its burst resolved.
func (l Limit) resolve() (Limit, error) {
	rate, burst, why := daily.Resolve(l.Rate, l.Burst, l.Reset, l.Zone, maxFill)
	if why != "" {
		return Limit{}, fmt.Errorf("%w: %s", ErrInvalidLimit, why)
	}
	l.Rate, l.Burst = rate, burst
	return l, nil
}

// checkTokens reports whether n tokens can ever be granted from the bucket
// called name, of the resolved Limit l.
func (l Limit) checkTokens(name string, n float64) error {
	if !(n > 0) || math.IsInf(n, 0) {
		return fmt.Errorf("%w: bucket %q: %v tokens requested, want a finite number above zero", ErrInvalidTokens, name, n)
	}
	if n > l.Burst {
		return fmt.Errorf("%w: bucket %q: %v tokens requested of a Limit of %v, which holds %v at most "+
			"(a zero Burst is three seconds of Rate, at least 1): set the Limit's Burst to %v or more",
			ErrExceedsBurst, name, n, l, l.Burst, n)
	}
	return nil
}

// WithLimits gives the buckets named in m their own Limit; a Transport uses
// the Limit passed to NewTransport for every other bucket. The names are
// those the KeyFunc returns, for example "api.example.com" or
// "api.example.com/eu". The map is copied. It panics if a Limit is invalid
// (see Limit.Validate) or a name is empty, as no bucket's is.
func WithLimits(m map[string]Limit) TransportOption {
	cp := make(map[string]Limit, len(m))
	for _, k := range slices.Sorted(maps.Keys(m)) {
		if k == "" {
			panic("quota: WithLimits: a Limit for the empty name, which no bucket has")
		}
		m[k].mustValidate(fmt.Sprintf("WithLimits: bucket %q", k))
		cp[k] = m[k]
	}
	return transportOpt(func(c *transportConfig) { c.limits = cp })
}

// WithLayers makes every bucket of a Transport obey lims as well as its own
// Limit, as providers publish layered limits: PerSecond(10) for the bucket
// and WithLayers(PerMinute(300), PerDay(10000)). Each request takes its
// tokens from every layer in one script call, all or nothing. It panics if
// a Limit is invalid (see Limit.Validate).
func WithLayers(lims ...Limit) TransportOption {
	for i, lim := range lims {
		lim.mustValidate(fmt.Sprintf("WithLayers: layer %d of %d", i+1, len(lims)))
	}
	cp := append([]Limit(nil), lims...)
	return transportOpt(func(c *transportConfig) { c.layers = cp })
}
