package quota

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of Gemini's API through metered Transports: its 429, whose wait
// is in the body's RetryInfo. Its fleets are TestLLMFleet's.

// geminiRefusal is a Gemini 429's body, its RetryInfo asking for a pause
// of 1.5 s, or without one when delay is empty.
func geminiRefusal(delay string) []byte {
	retry := ""
	if delay != "" {
		retry = `, {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "` + delay + `"}`
	}
	return []byte(`{"error": {"code": 429, "message": "You exceeded your current quota.", "status": "RESOURCE_EXHAUSTED", ` +
		`"details": [{"@type": "type.googleapis.com/google.rpc.QuotaFailure", "violations": [{"quotaId": ` +
		`"GenerateContentPaidTierInputTokensPerModelPerMinute"}]}` + retry + `]}}`)
}

// TestGeminiRetryInfoPauses: a Gemini 429 RESOURCE_EXHAUSTED, with no
// Retry-After but a RetryInfo of 1.5 s in its body, pauses the shared
// bucket: another process's Transport on it sends its next request 1.5 s
// later. The caller reads the 429's body whole. The control, a 429
// without RetryInfo, pauses nothing.
func TestGeminiRetryInfoPauses(t *testing.T) {
	srv := redistest.Start(t)
	for i, c := range []struct {
		delay    string
		min, max time.Duration
	}{
		{"1.5s", 1300 * time.Millisecond, 3 * time.Second},
		{"", 0, 500 * time.Millisecond}, // the control
	} {
		refusal := geminiRefusal(c.delay)
		var seen atomic.Int64
		provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json; charset=UTF-8")
			if seen.Add(1) == 1 {
				w.WriteHeader(http.StatusTooManyRequests)
				w.Write(refusal)
				return
			}
			w.Write([]byte(`{"candidates": [], "usageMetadata": {"promptTokenCount": 10, "totalTokenCount": 10}}`))
		}))
		m := LLMProfiles.Gemini(Limit{Rate: 1e6, Burst: 1e6})
		key := WithKey(Fixed("gemini-pause-" + string(rune('a'+i))))
		a := NewTransport(srv.Client(t), Limit{Rate: 100, Burst: 100}, WithMetering(m), key)
		b := NewTransport(srv.Client(t), Limit{Rate: 100, Burst: 100}, WithMetering(m), key)
		send := func(tr *Transport) (*http.Response, []byte) {
			body := []byte(`{"contents": [{"role": "user", "parts": [{"text": "How far is the Moon?"}]}]}`)
			resp, err := (&http.Client{Transport: tr}).Post(provider.URL+"/v1beta/models/gemini-2.5-flash:generateContent",
				"application/json", bytes.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			got, err := io.ReadAll(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			return resp, got
		}
		resp, got := send(a)
		if resp.StatusCode != http.StatusTooManyRequests || !bytes.Equal(got, refusal) {
			t.Errorf("retryDelay %q: the caller read %s %q, want 429 and the body whole, %q", c.delay, resp.Status, got, refusal)
		}
		if err := a.Limiter().Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if resp, _ := send(b); resp.StatusCode != http.StatusOK {
			t.Errorf("retryDelay %q: the next request: %s", c.delay, resp.Status)
		}
		if waited := time.Since(start); waited < c.min || waited > c.max {
			t.Errorf("retryDelay %q: another Transport on the bucket sent its next request after %v, want %v to %v",
				c.delay, waited.Round(time.Millisecond), c.min, c.max)
		}
		if err := b.Limiter().Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		provider.Close()
	}
}
