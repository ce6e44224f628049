package ratelimit

import (
	"net/http"
	"strconv"
	"testing"
	"time"
)

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		status int
		value  string
		want   time.Duration
		ok     bool
	}{
		{429, "2", 2 * time.Second, true},
		{503, "0.5", 500 * time.Millisecond, true},
		{429, now.Add(90 * time.Second).Format(http.TimeFormat), 90 * time.Second, true},
		{429, now.Add(-time.Second).Format(http.TimeFormat), 0, false},
		{429, "", 0, false},
		{429, "-3", 0, false},
		{429, "soon", 0, false},
		{429, "1e300", 0, false},
		{200, "2", 0, false},
		{500, "2", 0, false},
	} {
		resp := &http.Response{StatusCode: tc.status, Header: http.Header{}}
		if tc.value != "" {
			resp.Header.Set("Retry-After", tc.value)
		}
		got, ok := RetryAfter(resp, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%d Retry-After %q = %v, %v; want %v, %v", tc.status, tc.value, got, ok, tc.want, tc.ok)
		}
	}
}

// retry-after-ms, which Azure OpenAI and OpenAI send beside Retry-After,
// is preferred when it holds a pause; one that does not leaves Retry-After
// to say.
func TestRetryAfterMillis(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		status      int
		ms, seconds string
		want        time.Duration
		ok          bool
	}{
		{429, "1500", "2", 1500 * time.Millisecond, true},
		{429, "250", "", 250 * time.Millisecond, true},
		{503, "12.5", "1", 12500 * time.Microsecond, true},
		{429, "0", "3", 3 * time.Second, true},
		{429, "-5", "3", 3 * time.Second, true},
		{429, "soon", "3", 3 * time.Second, true},
		{429, "1e300", "", 0, false},
		{200, "1500", "2", 0, false},
	} {
		resp := &http.Response{StatusCode: tc.status, Header: http.Header{}}
		resp.Header.Set("retry-after-ms", tc.ms)
		if tc.seconds != "" {
			resp.Header.Set("Retry-After", tc.seconds)
		}
		got, ok := RetryAfter(resp, now)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%d retry-after-ms %q Retry-After %q = %v, %v; want %v, %v", tc.status, tc.ms, tc.seconds, got, ok, tc.want, tc.ok)
		}
	}
}

func TestRateLimitHeaders(t *testing.T) {
	now := time.Unix(1_800_000_000, 0)
	for _, tc := range []struct {
		name      string
		header    http.Header
		remaining float64
		reset     time.Duration
		ok        bool
	}{
		{"structured", http.Header{"Ratelimit": {`"default";r=50;t=30`}}, 50, 30 * time.Second, true},
		{"structured, two policies", http.Header{"Ratelimit": {`"second";r=7;t=1, "day";r=2;t=3600`}}, 2, time.Hour, true},
		{"earlier draft", http.Header{"Ratelimit": {"limit=100, remaining=5, reset=10"}}, 5, 10 * time.Second, true},
		{"separate fields", http.Header{"Ratelimit-Remaining": {"3"}, "Ratelimit-Reset": {"4"}}, 3, 4 * time.Second, true},
		{"x- with seconds", http.Header{"X-Ratelimit-Remaining": {"9"}, "X-Ratelimit-Reset": {"20"}}, 9, 20 * time.Second, true},
		{"x- with a Unix time", http.Header{"X-Ratelimit-Remaining": {"0"}, "X-Ratelimit-Reset": {strconv.Itoa(1_800_000_060)}}, 0, time.Minute, true},
		{"the fewest wins", http.Header{"X-Ratelimit-Remaining": {"9"}, "Ratelimit-Remaining": {"4"}}, 4, 0, true},
		{"nothing", http.Header{"X-Other": {"1"}}, 0, 0, false},
		{"garbage", http.Header{"X-Ratelimit-Remaining": {"lots"}, "Ratelimit": {"r=;t=x"}}, 0, 0, false},
		{"negative", http.Header{"X-Ratelimit-Remaining": {"-1"}}, 0, 0, false},
	} {
		remaining, reset, ok := Remaining(tc.header, now)
		if ok != tc.ok || (ok && (remaining != tc.remaining || reset != tc.reset)) {
			t.Errorf("%s: %v, %v, %v; want %v, %v, %v", tc.name, remaining, reset, ok, tc.remaining, tc.reset, tc.ok)
		}
	}
}

func TestPolicies(t *testing.T) {
	h := http.Header{"Ratelimit-Policy": {`"requests";q=60;w=60, "output_tokens";q=8000;w=60`, `"nowindow";q=5, ;q=1;w=1, "zero";q=10;w=0`}}
	got := Policies(h)
	if len(got) != 2 || got["requests"] != 1 || got["output_tokens"] != 8000.0/60 {
		t.Errorf("Policies = %v, want requests 1/s and output_tokens 133.3/s", got)
	}
	if got := Policies(http.Header{}); got != nil {
		t.Errorf("Policies of no field = %v, want nil", got)
	}
}
