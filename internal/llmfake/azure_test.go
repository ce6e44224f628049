package llmfake_test

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
)

const azurePath = "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21"

// An Azure deployment answers OpenAI's bodies and streams at its path,
// charges input plus max_tokens to its tokens meter, and tells what
// remains in OpenAI's headers.
func TestAzureAnswers(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Azure, Used: func(int) int { return 30 },
		Limits: llmfake.Limits{Requests: llmfake.Bucket{Rate: 1, Burst: 10}, Tokens: llmfake.Bucket{Rate: 100, Burst: 5000}}}
	ts := serve(t, s)
	req := openAIRequest("How far is the Moon?", map[string]any{"max_tokens": 200})
	r := post(t, ts, azurePath, req, "w1")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	var body struct {
		Object string         `json:"object"`
		Usage  map[string]int `json:"usage"`
	}
	if err := json.Unmarshal(r.body, &body); err != nil {
		t.Fatal(err)
	}
	input := inputOf(t, req)
	if body.Object != "chat.completion" || body.Usage["prompt_tokens"] != input || body.Usage["completion_tokens"] != 30 {
		t.Errorf("body %s, want a chat.completion with usage %d and 30", r.body, input)
	}
	wantHeader(t, r.header, "x-ratelimit-remaining-requests", "9")
	wantHeader(t, r.header, "x-ratelimit-remaining-tokens", strconv.Itoa(5000-input-200))
	if rec := onlyRecord(t, s); rec.Charged != input+200 {
		t.Errorf("charged %d, want %d", rec.Charged, input+200)
	}

	stream := post(t, ts, azurePath, openAIRequest("Hi", map[string]any{"max_tokens": 50, "stream": true, "stream_options": map[string]any{"include_usage": true}}), "w1")
	events := splitSSE(t, stream.body)
	if ct := stream.header.Get("Content-Type"); ct != "text/event-stream" || len(events) < 2 || events[len(events)-1].data != "[DONE]" ||
		!strings.Contains(events[len(events)-2].data, `"completion_tokens":30`) {
		t.Errorf("stream %s %q, want OpenAI's events, the usage last before [DONE]", ct, stream.body)
	}
}

// A request off a deployment's chat completions, or without an
// api-version, is answered 404 as Azure answers, and not metered.
func TestAzureRoutes(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Azure}
	ts := serve(t, s)
	for _, path := range []string{
		"/openai/deployments/gpt-4o/chat/completions",
		"/v1/chat/completions?api-version=2024-10-21",
		"/openai/deployments//chat/completions?api-version=2024-10-21",
		"/openai/deployments/a/b/chat/completions?api-version=2024-10-21",
	} {
		r := post(t, ts, path, openAIRequest("Hi", nil), "")
		var e struct {
			Error struct{ Code, Message string } `json:"error"`
		}
		decodeStrict(t, r.body, &e)
		if r.status != http.StatusNotFound || e.Error.Code != "404" {
			t.Errorf("%s: %d %s, want 404 with Azure's error", path, r.status, r.body)
		}
	}
	if n := len(s.Records()); n != 0 {
		t.Errorf("%d requests recorded, want none", n)
	}
}

// A refused Azure request is answered 429 with Azure's error, retry-after
// in whole seconds and retry-after-ms, the wait to the millisecond.
func TestAzureRefuses(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Azure,
		Limits: llmfake.Limits{Tokens: llmfake.Bucket{Rate: 1000, Burst: 1500}}}
	ts := serve(t, s)
	req := openAIRequest("Hi", map[string]any{"max_tokens": 1000})
	if r := post(t, ts, azurePath, req, ""); r.status != http.StatusOK {
		t.Fatalf("first request: %d", r.status)
	}
	start := time.Now()
	r := post(t, ts, azurePath, req, "")
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("second request: %d, want 429", r.status)
	}
	var e struct {
		Error struct{ Code, Message string } `json:"error"`
	}
	if err := json.Unmarshal(r.body, &e); err != nil || e.Error.Code != "429" || !strings.Contains(e.Error.Message, "token rate limit") {
		t.Errorf("body %s, want Azure's 429 naming the token rate limit", r.body)
	}
	wantHeader(t, r.header, "retry-after", "1")
	ms, err := strconv.Atoi(r.header.Get("retry-after-ms"))
	// The bucket holds about 500 after the first, and the second needs
	// its 1000 and input: about 0.5 s of refill.
	if elapsed := time.Since(start); err != nil || ms < 400 || ms > 600+int(elapsed.Milliseconds()) {
		t.Errorf("retry-after-ms %q, want about 500", r.header.Get("retry-after-ms"))
	}
	if got := s.RefusedBy(); got["tokens"] != 1 {
		t.Errorf("refused by %v, want tokens 1", got)
	}
}
