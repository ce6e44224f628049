// Package ratelimit holds the rules of a provider's rate limits, each
// written once for the packages of the module that follow it: what a
// response's header fields say of the limit (Retry-After, the rate-limit
// fields and the RateLimit-Policy field) and, without Retry-After, a Google
// API's error body (its RetryInfo), the parameters of an item of such a
// field, and the default burst of a Limit.
package ratelimit

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"
)

// Params reads the numeric parameters of one item of a header field,
// separated by semicolons: `"default";r=50;t=30` gives r and t.
func Params(item string) map[string]float64 {
	out := map[string]float64{}
	for _, p := range strings.Split(item, ";") {
		k, v, found := strings.Cut(strings.TrimSpace(p), "=")
		if !found {
			continue
		}
		if f, err := strconv.ParseFloat(strings.Trim(strings.TrimSpace(v), `"`), 64); err == nil {
			out[strings.ToLower(strings.TrimSpace(k))] = f
		}
	}
	return out
}

// DefaultBurst is the burst of a Limit whose Burst is zero, refilled at
// rate tokens a second: three seconds of rate, and at least one token.
// Package quota's Limit documents it; quotactl prints it.
func DefaultBurst(rate float64) float64 {
	return math.Max(1, 3*rate)
}

// Check returns the burst of a Limit of rate and burst (0 for the
// default), or why no bucket can be refilled at it: a rate that is not a
// finite number above zero, a burst that is neither zero nor a finite
// number of 1 or more, or a bucket that would take longer than maxFill to
// fill from empty.
func Check(rate, burst float64, maxFill time.Duration) (float64, string) {
	switch {
	case !(rate > 0) || math.IsInf(rate, 0):
		return 0, fmt.Sprintf("rate %v must be a finite number above zero", rate)
	case !(burst >= 0) || math.IsInf(burst, 0):
		return 0, fmt.Sprintf("burst %v must be a finite number, zero or more", burst)
	case burst > 0 && burst < 1:
		return 0, fmt.Sprintf("burst %v holds less than one token, and would grant no request of one: "+
			"want 1 or more, or 0 for the default", burst)
	case burst == 0:
		burst = DefaultBurst(rate)
	}
	if math.IsInf(burst, 0) {
		return 0, fmt.Sprintf("rate %v gives no finite default burst", rate)
	}
	if fill := burst / rate; !(fill <= maxFill.Seconds()) {
		return 0, fmt.Sprintf("a burst of %v at %v/s takes longer than %d days to fill", burst, rate, int(maxFill.Hours()/24))
	}
	return burst, ""
}
