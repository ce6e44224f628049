package ratelimit

import (
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"
)

// closeCounter is a response body that counts its Close calls.
type closeCounter struct {
	io.Reader
	closed int
}

func (c *closeCounter) Close() error { c.closed++; return nil }

// googleError is a Gemini 429 body whose RetryInfo asks for delay.
func googleError(delay string) string {
	return `{"error": {"code": 429, "message": "You exceeded your current quota.", "status": "RESOURCE_EXHAUSTED",
  "details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{"quotaId": "GenerateRequestsPerMinutePerProjectPerModel"}]},
    {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "` + delay + `"}]}}`
}

// TestRetryInfo: without a Retry-After field, a 429 or 503 whose JSON
// body carries a google.rpc.RetryInfo asks for its retryDelay; the body
// reads the same afterwards, and closes the response's.
func TestRetryInfo(t *testing.T) {
	now := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	long := `{"pad": "` + strings.Repeat("x", maxErrorBody) + `", ` + googleError("3s")[1:]
	for _, tc := range []struct {
		name        string
		status      int
		contentType string
		retryAfter  string
		body        string
		want        time.Duration
		ok          bool
	}{
		{"seconds", 429, "application/json; charset=UTF-8", "", googleError("3s"), 3 * time.Second, true},
		{"fraction", 429, "application/json", "", googleError("0.5s"), 500 * time.Millisecond, true},
		{"nanos", 503, "application/json", "", googleError("1.000340012s"), 1000340012 * time.Nanosecond, true},
		{"header first", 429, "application/json", "7", googleError("3s"), 7 * time.Second, true},
		{"zero", 429, "application/json", "", googleError("0s"), 0, false},
		{"negative", 429, "application/json", "", googleError("-3s"), 0, false},
		{"no unit", 429, "application/json", "", googleError("3"), 0, false},
		{"not a number", 429, "application/json", "", googleError("inf s"), 0, false},
		{"exponent", 429, "application/json", "", googleError("1e3s"), 0, false},
		{"huge", 429, "application/json", "", googleError("99999999999999999999s"), 0, false},
		{"no RetryInfo", 429, "application/json", "", `{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED"}}`, 0, false},
		{"not JSON", 429, "text/plain", "", googleError("3s"), 0, false},
		{"broken JSON", 429, "application/json", "", googleError("3s")[:100], 0, false},
		{"too long", 429, "application/json", "", long, 0, false},
		{"not a refusal", 400, "application/json", "", googleError("3s"), 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			body := &closeCounter{Reader: strings.NewReader(tc.body)}
			resp := &http.Response{StatusCode: tc.status, Header: http.Header{"Content-Type": {tc.contentType}}, Body: body}
			if tc.retryAfter != "" {
				resp.Header.Set("Retry-After", tc.retryAfter)
			}
			got, ok := RetryAfter(resp, now)
			if got != tc.want || ok != tc.ok {
				t.Errorf("RetryAfter = %v, %v; want %v, %v", got, ok, tc.want, tc.ok)
			}
			b, err := io.ReadAll(resp.Body)
			if err != nil || string(b) != tc.body {
				t.Errorf("the body read %d bytes, %v; want its %d bytes", len(b), err, len(tc.body))
			}
			if resp.Body.Close(); body.closed != 1 {
				t.Errorf("the response's body closed %d times, want 1", body.closed)
			}
		})
	}
}

// TestRetryInfoKeepsTheError: a body that fails while RetryAfter reads it
// fails the same for the caller, after the bytes read before.
func TestRetryInfoKeepsTheError(t *testing.T) {
	boom := errors.New("connection reset")
	body := &closeCounter{Reader: io.MultiReader(strings.NewReader(`{"error": `), failed{boom})}
	resp := &http.Response{StatusCode: 429, Header: http.Header{"Content-Type": {"application/json"}}, Body: body}
	if d, ok := RetryAfter(resp, time.Now()); ok {
		t.Errorf("RetryAfter = %v from a broken body", d)
	}
	b, err := io.ReadAll(resp.Body)
	if string(b) != `{"error": ` || !errors.Is(err, boom) {
		t.Errorf("read %q, %v; want the bytes before the error, and the error", b, err)
	}
}
