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

// Validate reports, with an error matching ErrInvalidLimit, why no bucket
// can be refilled at l: a Rate that is not a finite number above zero, a
// Burst that is negative or not finite, or a bucket that would take more
// than 366 days to fill from empty.
func (l Limit) Validate() error {
	_, err := l.resolve()
	return err
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
		return Limit{}, fmt.Errorf("%w: a burst of %v at %v/s takes longer than %d days to fill", ErrInvalidLimit, l.Burst, l.Rate, int(maxFill.Hours()/24))
	}
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
