package quota

import (
	"fmt"
	"math"
	"strconv"
	"time"
)

// A Limit is the rate a bucket refills at and the burst it can hold. A
// bucket must fill from empty within a year (Burst/Rate at most 366 days).
//
// The zero Burst means three seconds of Rate (and at least one token), the
// capacity that absorbs ordinary jitter without a visible burst at the
// provider.
type Limit struct {
	Rate  float64 // tokens per second, > 0
	Burst float64 // bucket capacity in tokens; 0 means three seconds of Rate
}

// maxFill bounds the time a bucket takes to fill from empty. A bucket is a
// count of microseconds on the server's clock: a bound keeps that count
// exact, and no provider meters over more than a year.
const maxFill = 366 * 24 * time.Hour

// PerSecond returns a Limit of n tokens per second with the default burst.
func PerSecond(n float64) Limit { return Limit{Rate: n} }

// PerMinute returns a Limit of n tokens per minute with the default burst.
func PerMinute(n float64) Limit { return Limit{Rate: n / 60} }

// PerHour returns a Limit of n tokens per hour with the default burst.
func PerHour(n float64) Limit { return Limit{Rate: n / 3600} }

// PerDay returns a Limit of n tokens per day with the default burst.
func PerDay(n float64) Limit { return Limit{Rate: n / 86400} }

// String describes the Limit, for example "5/s burst 15".
func (l Limit) String() string {
	return strconv.FormatFloat(l.Rate, 'g', -1, 64) + "/s burst " +
		strconv.FormatFloat(l.burst(), 'g', -1, 64)
}

// burst returns the bucket capacity with the zero value resolved.
func (l Limit) burst() float64 {
	if l.Burst == 0 {
		return math.Max(1, 3*l.Rate)
	}
	return l.Burst
}

// resolve validates l and returns it with its burst resolved.
func (l Limit) resolve() (Limit, error) {
	if !(l.Rate > 0) || math.IsInf(l.Rate, 0) {
		return Limit{}, fmt.Errorf("%w: rate %v must be a finite number above zero", ErrInvalidLimit, l.Rate)
	}
	if !(l.Burst >= 0) || math.IsInf(l.Burst, 0) {
		return Limit{}, fmt.Errorf("%w: burst %v must be a finite number, zero or more", ErrInvalidLimit, l.Burst)
	}
	l.Burst = l.burst()
	if math.IsInf(l.Burst, 0) {
		return Limit{}, fmt.Errorf("%w: rate %v gives no finite default burst", ErrInvalidLimit, l.Rate)
	}
	if fill := l.Burst / l.Rate; !(fill <= maxFill.Seconds()) {
		return Limit{}, fmt.Errorf("%w: a burst of %v at %v/s takes longer than %v to fill", ErrInvalidLimit, l.Burst, l.Rate, maxFill)
	}
	return l, nil
}

// checkTokens reports whether n tokens can ever be granted from a bucket of
// the resolved Limit l.
func (l Limit) checkTokens(n float64) error {
	if !(n > 0) || math.IsInf(n, 0) {
		return fmt.Errorf("%w: %v tokens requested, want a finite number above zero", ErrInvalidTokens, n)
	}
	if n > l.Burst {
		return fmt.Errorf("%w: %v tokens requested from a bucket that holds %v", ErrExceedsBurst, n, l.Burst)
	}
	return nil
}
