package llmfake_test

import (
	"bytes"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
)

const (
	geminiPath   = "/v1beta/models/gemini-test:generateContent"
	geminiStream = "/v1beta/models/gemini-test:streamGenerateContent"
)

// geminiRequest is a generateContent request body with one user content.
func geminiRequest(maxTokens int, text string) map[string]any {
	return map[string]any{
		"contents":         []map[string]any{{"role": "user", "parts": []map[string]any{{"text": text}}}},
		"generationConfig": map[string]any{"maxOutputTokens": maxTokens},
	}
}

// geminiAnswer is a GenerateContentResponse, or a chunk of a stream.
type geminiAnswer struct {
	Candidates []struct {
		Content struct {
			Role  string `json:"role"`
			Parts []struct {
				Text string `json:"text"`
			} `json:"parts"`
		} `json:"content"`
		FinishReason string `json:"finishReason"`
		Index        int    `json:"index"`
	} `json:"candidates"`
	UsageMetadata struct {
		PromptTokenCount     int `json:"promptTokenCount"`
		CandidatesTokenCount int `json:"candidatesTokenCount"`
		TotalTokenCount      int `json:"totalTokenCount"`
	} `json:"usageMetadata"`
	ModelVersion string `json:"modelVersion"`
	ResponseID   string `json:"responseId"`
}

// geminiRPCError is the google.rpc error of a Gemini error answer.
type geminiRPCError struct {
	Error struct {
		Code    int               `json:"code"`
		Message string            `json:"message"`
		Status  string            `json:"status"`
		Details []json.RawMessage `json:"details"`
	} `json:"error"`
}

// geminiServer is a Gemini fake whose answers use 40% of maxOutputTokens.
func geminiServer(limits llmfake.Limits) *llmfake.Server {
	return &llmfake.Server{Kind: llmfake.Gemini, Limits: limits, Latency: 20 * time.Millisecond,
		Used: func(m int) int { return m * 4 / 10 }}
}

// TestGeminiJSON: generateContent answers one GenerateContentResponse
// whose usageMetadata tells the input the server counted and the output
// it used, and records the request.
func TestGeminiJSON(t *testing.T) {
	s := geminiServer(llmfake.Limits{Requests: llmfake.Bucket{Rate: 10, Burst: 10}})
	ts := serve(t, s)
	req := geminiRequest(100, "Some question for the model.")
	r := post(t, ts, geminiPath, req, "w1")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	wantHeader(t, r.header, "Content-Type", "application/json")
	if r.header.Get("x-ratelimit-remaining-requests") != "" || r.header.Get("Retry-After") != "" {
		t.Errorf("rate-limit headers in a Gemini answer: %v", r.header)
	}
	var a geminiAnswer
	decodeStrict(t, r.body, &a)
	in := inputOf(t, req)
	u := a.UsageMetadata
	if u.PromptTokenCount != in || u.CandidatesTokenCount != 40 || u.TotalTokenCount != in+40 {
		t.Errorf("usageMetadata = %+v, want %d prompt and 40 candidates tokens", u, in)
	}
	if len(a.Candidates) != 1 || a.Candidates[0].FinishReason != "STOP" || a.Candidates[0].Content.Role != "model" ||
		a.Candidates[0].Content.Parts[0].Text != "Hello from the fake server." || a.ModelVersion != "gemini-test" {
		t.Errorf("answer = %+v", a)
	}
	rec := onlyRecord(t, s)
	if rec.Input != in || rec.Max != 100 || rec.Output != 40 || rec.Stream || rec.Worker != "w1" {
		t.Errorf("record = %+v", rec)
	}
}

// TestGeminiStreams: streamGenerateContent with alt=sse answers a "data:"
// chunk a piece of text, each with the usage so far, the last all of it;
// without alt=sse, the same chunks as a JSON array.
func TestGeminiStreams(t *testing.T) {
	req := geminiRequest(100, "Some question for the model.")
	in := inputOf(t, req)
	check := func(t *testing.T, chunks []geminiAnswer) {
		t.Helper()
		var text strings.Builder
		for i, c := range chunks {
			u := c.UsageMetadata
			if u.PromptTokenCount != in || u.TotalTokenCount != in+u.CandidatesTokenCount {
				t.Errorf("chunk %d: usageMetadata %+v, want %d prompt tokens", i, u, in)
			}
			last := i == len(chunks)-1
			if (c.Candidates[0].FinishReason == "STOP") != last || (last && u.CandidatesTokenCount != 40) {
				t.Errorf("chunk %d of %d: finish %q, %d candidates tokens", i, len(chunks), c.Candidates[0].FinishReason, u.CandidatesTokenCount)
			}
			text.WriteString(c.Candidates[0].Content.Parts[0].Text)
		}
		if len(chunks) < 2 || text.String() != "Hello from the fake server." {
			t.Errorf("%d chunks of text %q", len(chunks), text.String())
		}
	}
	t.Run("sse", func(t *testing.T) {
		s := geminiServer(llmfake.Limits{})
		r := post(t, serve(t, s), geminiStream+"?alt=sse", req, "")
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		wantHeader(t, r.header, "Content-Type", "text/event-stream")
		var chunks []geminiAnswer
		for _, ev := range strings.Split(strings.TrimSuffix(string(r.body), "\r\n\r\n"), "\r\n\r\n") {
			data, ok := strings.CutPrefix(ev, "data: ")
			if !ok {
				t.Fatalf("event %q is no data line", ev)
			}
			var c geminiAnswer
			decodeStrict(t, []byte(data), &c)
			chunks = append(chunks, c)
		}
		check(t, chunks)
		if rec := onlyRecord(t, s); !rec.Stream || rec.Output != 40 {
			t.Errorf("record = %+v", rec)
		}
	})
	t.Run("array", func(t *testing.T) {
		s := geminiServer(llmfake.Limits{})
		r := post(t, serve(t, s), geminiStream, req, "")
		if r.status != http.StatusOK {
			t.Fatalf("status %d: %s", r.status, r.body)
		}
		wantHeader(t, r.header, "Content-Type", "application/json")
		var chunks []geminiAnswer
		dec := json.NewDecoder(bytes.NewReader(r.body))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&chunks); err != nil {
			t.Fatalf("%v: %s", err, r.body)
		}
		check(t, chunks)
	})
}

// TestGeminiRefusals: a request a meter cannot pay is answered 429 with a
// google.rpc RESOURCE_EXHAUSTED error whose RetryInfo tells the wait, and
// no Retry-After header; it charges nothing. The input tokens are charged
// at admission and never given back.
func TestGeminiRefusals(t *testing.T) {
	req := geminiRequest(100, "Some question for the model.")
	in := inputOf(t, req)
	spare := llmfake.Bucket{Rate: 0.001, Burst: 5}
	for _, c := range []struct {
		name   string
		limits llmfake.Limits
		meter  string
		quota  string
		retry  []string // the wait, rounded up, less the time since the first admission
	}{
		{"requests", llmfake.Limits{Requests: llmfake.Bucket{Rate: 0.1, Burst: 1}}, "requests", "GenerateRequestsPerMinutePerProjectPerModel",
			[]string{"10s", "9s"}},
		// The input meter holds 1.5 requests' input: the first answer's
		// output gives nothing back.
		{"input", llmfake.Limits{Requests: spare, InputTokens: llmfake.Bucket{Rate: float64(in) / 10, Burst: float64(in) * 3 / 2}},
			"input_tokens", "GenerateContentPaidTierInputTokensPerModelPerMinute", []string{"5s", "4s"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := geminiServer(c.limits)
			ts := serve(t, s)
			if r := post(t, ts, geminiPath, req, ""); r.status != http.StatusOK {
				t.Fatalf("first request: status %d: %s", r.status, r.body)
			}
			r := post(t, ts, geminiPath, req, "")
			if r.status != http.StatusTooManyRequests {
				t.Fatalf("second request: status %d: %s", r.status, r.body)
			}
			if v := r.header.Get("Retry-After"); v != "" {
				t.Errorf("Retry-After %q: Gemini tells the wait in the body", v)
			}
			wantHeader(t, r.header, "Content-Type", "application/json; charset=UTF-8")
			var e geminiRPCError
			decodeStrict(t, r.body, &e)
			if e.Error.Code != 429 || e.Error.Status != "RESOURCE_EXHAUSTED" || !strings.Contains(e.Error.Message, "Please retry in") {
				t.Errorf("error = %+v", e.Error)
			}
			var delay, quotaID string
			for _, d := range e.Error.Details {
				var detail struct {
					Type       string `json:"@type"`
					RetryDelay string `json:"retryDelay"`
					Violations []struct {
						QuotaID string `json:"quotaId"`
					} `json:"violations"`
				}
				if err := json.Unmarshal(d, &detail); err != nil {
					t.Fatal(err)
				}
				switch detail.Type {
				case "type.googleapis.com/google.rpc.RetryInfo":
					delay = detail.RetryDelay
				case "type.googleapis.com/google.rpc.QuotaFailure":
					quotaID = detail.Violations[0].QuotaID
				}
			}
			if delay != c.retry[0] && delay != c.retry[1] {
				t.Errorf("retryDelay %q, want %s", delay, c.retry[0])
			}
			if quotaID != c.quota {
				t.Errorf("quotaId %q, want %q", quotaID, c.quota)
			}
			if got := s.RefusedBy(); len(got) != 1 || got[c.meter] != 1 {
				t.Errorf("RefusedBy = %v, want %s: 1", got, c.meter)
			}
			onlyRecord(t, s)
		})
	}
}

// TestGeminiBadRequests: an unknown path, another method than POST, a
// body that is not JSON and a maxOutputTokens below 1 are answered with a
// google.rpc error, and neither metered nor recorded.
func TestGeminiBadRequests(t *testing.T) {
	s := geminiServer(llmfake.Limits{Requests: llmfake.Bucket{Rate: 0.001, Burst: 1}})
	ts := serve(t, s)
	for _, c := range []struct {
		method, path string
		body         any
		status       int
		rpc          string
	}{
		{"POST", "/v1beta/models/gemini-test:countTokens", geminiRequest(10, "x"), 404, "NOT_FOUND"},
		{"POST", "/v1/messages", geminiRequest(10, "x"), 404, "NOT_FOUND"},
		{"GET", geminiPath, []byte{}, 405, "INVALID_ARGUMENT"},
		{"POST", geminiPath, []byte("{"), 400, "INVALID_ARGUMENT"},
		{"POST", geminiPath, geminiRequest(0, "x"), 400, "INVALID_ARGUMENT"},
	} {
		r, err := exchange(t.Context(), ts, c.method, c.path, c.body, "")
		if err != nil {
			t.Fatal(err)
		}
		var e geminiRPCError
		if r.status != c.status || json.Unmarshal(r.body, &e) != nil || e.Error.Status != c.rpc || e.Error.Code != c.status {
			t.Errorf("%s %s: status %d %s, want %d %s", c.method, c.path, r.status, r.body, c.status, c.rpc)
		}
	}
	if n := len(s.Records()); n != 0 || s.Refused() != 0 {
		t.Errorf("%d records, %d refused: a bad request was metered", n, s.Refused())
	}
	// The one request the bucket holds is still there.
	if r := post(t, ts, "/v1/models/gemini-test:generateContent", geminiRequest(10, "x"), ""); r.status != http.StatusOK {
		t.Errorf("status %d: %s", r.status, r.body)
	}
}
