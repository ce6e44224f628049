package ratelimit

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// RetryAfter returns the pause a 429 or 503 response asks for, and
// whether it asks for one: in its retry-after-ms field, milliseconds, when
// that holds one (Azure OpenAI and OpenAI send it beside Retry-After, which
// holds whole seconds), else in its Retry-After field, in seconds or as an
// HTTP date. Without either, a Google API's JSON error body tells the
// pause in its google.rpc.RetryInfo detail (Gemini's 429
// RESOURCE_EXHAUSTED does): RetryAfter then reads the body's first 64 KiB
// and puts them back, so that the caller reads the body whole.
func RetryAfter(resp *http.Response, now time.Time) (time.Duration, bool) {
	if resp.StatusCode != http.StatusTooManyRequests && resp.StatusCode != http.StatusServiceUnavailable {
		return 0, false
	}
	if ms, err := strconv.ParseFloat(strings.TrimSpace(resp.Header.Get("retry-after-ms")), 64); err == nil {
		if d, ok := pause(ms / 1000); ok {
			return d, true
		}
	}
	v := strings.TrimSpace(resp.Header.Get("Retry-After"))
	if v == "" {
		return retryInfo(resp)
	}
	if s, err := strconv.ParseFloat(v, 64); err == nil {
		return pause(s)
	}
	if t, err := http.ParseTime(v); err == nil && t.After(now) {
		return t.Sub(now), true
	}
	return 0, false
}

// pause returns the pause of s seconds, and false unless s is above zero
// and fits a Duration.
func pause(s float64) (time.Duration, bool) {
	if !(s > 0) || s > math.MaxInt64/float64(time.Second) {
		return 0, false
	}
	return time.Duration(s * float64(time.Second)), true
}

// Remaining reads what the provider says remains of its limit: the
// IETF RateLimit field in its structured form (`"default";r=50;t=30`) and
// its earlier form (`limit=100, remaining=50, reset=30`),
// RateLimit-Remaining and RateLimit-Reset, and X-RateLimit-Remaining and
// X-RateLimit-Reset (seconds, or a Unix time). Of several policies it keeps
// the fewest remaining. ok is false when the response says nothing.
func Remaining(h http.Header, now time.Time) (remaining float64, reset time.Duration, ok bool) {
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
			params := Params(item)
			if r, found := params["r"]; found { // structured: "policy";r=50;t=30
				note(r, params["t"])
			}
		}
		params := Params(strings.ReplaceAll(field, ",", ";"))
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

// Policies reads the IETF RateLimit-Policy field: the quota of each
// policy it names, as a rate a second (`"output_tokens";q=8000;w=60` is
// 133.3/s), for the policies with both a quota and a window.
func Policies(h http.Header) map[string]float64 {
	var out map[string]float64
	for _, field := range h.Values("RateLimit-Policy") {
		for _, item := range strings.Split(field, ",") {
			policy, _, _ := strings.Cut(strings.TrimSpace(item), ";")
			policy = strings.Trim(policy, `"`)
			params := Params(item)
			q, w := params["q"], params["w"]
			if policy == "" || !(q >= 0) || !(w > 0) {
				continue
			}
			if out == nil {
				out = map[string]float64{}
			}
			out[policy] = q / w
		}
	}
	return out
}
