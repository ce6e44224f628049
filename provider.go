package quota

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// DefaultMaxPause bounds the pause a provider's Retry-After puts on a whole
// bucket unless WithMaxPause says otherwise.
const DefaultMaxPause = 5 * time.Minute

// retryAfter returns the pause a 429 or 503 response asks for in its
// Retry-After field, in seconds or as an HTTP date, and whether it asks
// for one.
func retryAfter(resp *http.Response, now time.Time) (time.Duration, bool) {
	if resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		return 0, false
	}
	v := strings.TrimSpace(resp.Header.Get("Retry-After"))
	if v == "" {
		return 0, false
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		if !(s > 0) || s > math.MaxInt64/float64(time.Second) {
			return 0, false
		}
		return time.Duration(s * float64(time.Second)), true
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now), true
	}
	return 0, false
}

// rateLimitHeaders reads what the provider says remains of its limit: the
// IETF RateLimit field in its structured form (`"default";r=50;t=30`) and
// its earlier form (`limit=100, remaining=50, reset=30`),
// RateLimit-Remaining and RateLimit-Reset, and X-RateLimit-Remaining and
// X-RateLimit-Reset (seconds, or a Unix time). Of several policies it keeps
// the fewest remaining. ok is false when the response says nothing.
func rateLimitHeaders(h http.Header, now time.Time) (remaining float64, reset time.Duration, ok bool) {
	remaining = math.Inf(1)
	note := func(r float64, resetSecs float64) {
		if r < 0 || math.IsNaN(r) {
			return
		}
		if r < remaining {
			remaining, ok = r, true
			reset = 0
			if resetSecs > 0 && resetSecs <= math.MaxInt64/float64(time.Second) {
				reset = time.Duration(resetSecs * float64(time.Second))
			}
		}
	}
	for _, field := range h.Values("RateLimit") {
		for _, item := range strings.Split(field, ",") {
			params := parseParams(item)
			if r, found := params["r"]; found { // structured: "policy";r=50;t=30
				note(r, params["t"])
			}
		}
		params := parseParams(strings.ReplaceAll(field, ",", ";"))
		if r, found := params["remaining"]; found { // earlier draft: remaining=50, reset=30
			note(r, params["reset"])
		}
	}
	for _, prefix := range []string{"RateLimit-", "X-RateLimit-"} {
		v := strings.TrimSpace(h.Get(prefix + "Remaining"))
		if v == "" {
			continue
		}
		r, err := strconv.ParseFloat(v, 64)
		if err != nil {
			continue
		}
		resetSecs, _ := strconv.ParseFloat(strings.TrimSpace(h.Get(prefix+"Reset")), 64)
		if resetSecs > 1e9 { // a Unix time
			resetSecs -= float64(now.UnixNano()) / 1e9
		}
		note(r, resetSecs)
	}
	return remaining, reset, ok
}

// parseParams reads the numeric parameters of one item of a header field,
// separated by semicolons: `"default";r=50;t=30` gives r and t.
func parseParams(item string) map[string]float64 {
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
