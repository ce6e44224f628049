package llm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }

// request returns the JSON body of a request to an LLM API, "anthropic"
// or "openai": one user message of 300 bytes, max_tokens, and a stream
// when stream is set (with its usage, for OpenAI).
func request(api string, maxTokens int, stream bool) []byte {
	req := map[string]any{
		"model":      "model-1",
		"max_tokens": maxTokens,
		"messages":   []map[string]any{{"role": "user", "content": strings.Repeat("quota shares one limit across a fleet. ", 8)[:300]}},
	}
	if stream {
		req["stream"] = true
		if api == "openai" {
			req["stream_options"] = map[string]any{"include_usage": true}
		}
	}
	b, _ := json.Marshal(req)
	return b
}

// readUsage feeds body to the profile m's UsageReader for a response of
// contentType, in chunks of 7 bytes, and returns what it read.
func readUsage(t *testing.T, m quota.Metering, contentType, body string) (quota.Usage, bool) {
	t.Helper()
	resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {contentType}}}
	ur := m.Usage(resp)
	if ur == nil {
		t.Fatalf("no UsageReader for a %s answer", contentType)
	}
	for b := []byte(body); len(b) > 0; {
		n := min(7, len(b))
		ur.Write(b[:n])
		b = b[n:]
	}
	return ur.Usage()
}

func TestAnthropic(t *testing.T) {
	m := Anthropic(AnthropicLimits{InputTokens: PerMinute(40000), OutputTokens: PerMinute(8000)})
	if got := m.Meters[1].Limit; got.Burst != 8000 {
		t.Errorf("output meter %v, want a burst of a minute, 8000", got)
	}
	body := request("anthropic", 1024, false)
	u, err := m.Estimate(httptest.NewRequest("POST", "/v1/messages", nil), body)
	if err != nil {
		t.Fatal(err)
	}
	if want := (quota.Usage{MeterInputTokens: math.Ceil(float64(len(body)) / 3), MeterOutputTokens: 1024}); !maps.Equal(u, want) {
		t.Errorf("estimate %v, want %v", u, want)
	}
	if _, err := m.Estimate(httptest.NewRequest("POST", "/v1/messages", nil), []byte("not json")); err == nil {
		t.Error("an estimate of a body that is not JSON did not fail")
	}
	got, ok := readUsage(t, m, "application/json", `{"id":"msg_1","type":"message","content":[{"type":"text","text":"a \"usage\": {\"output_tokens\": 9}"}],`+
		`"usage":{"input_tokens":10,"cache_creation_input_tokens":5,"cache_read_input_tokens":100,"output_tokens":20}}`)
	if want := (quota.Usage{MeterInputTokens: 15, MeterOutputTokens: 20}); !ok || !maps.Equal(got, want) {
		t.Errorf("JSON usage %v %v, want %v (input with cache writes, without cache reads)", got, ok, want)
	}
	stream := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n"
	got, ok = readUsage(t, m, "text/event-stream", stream)
	if want := (quota.Usage{MeterInputTokens: 12}); !ok || !maps.Equal(got, want) {
		t.Errorf("a stream cut before message_delta: %v %v, want %v: the output keeps its reservation", got, ok, want)
	}
	stream += "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":37}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
	got, ok = readUsage(t, m, "text/event-stream; charset=utf-8", stream)
	if want := (quota.Usage{MeterInputTokens: 12, MeterOutputTokens: 37}); !ok || !maps.Equal(got, want) {
		t.Errorf("a whole stream: %v %v, want %v", got, ok, want)
	}
	if ur := m.Usage(&http.Response{StatusCode: 429, Header: http.Header{}}); ur != nil {
		t.Error("a 429 is read for usage")
	}
	h := http.Header{}
	h.Set("anthropic-ratelimit-requests-remaining", "49")
	h.Set("anthropic-ratelimit-input-tokens-remaining", "39000")
	h.Set("anthropic-ratelimit-output-tokens-remaining", "7000")
	h.Set("anthropic-ratelimit-output-tokens-reset", "2026-12-03T12:00:00Z")
	left := m.Remaining(h, time.Now())
	if want := map[string]float64{quota.MeterRequests: 49, MeterInputTokens: 39000, MeterOutputTokens: 7000}; !maps.Equal(left, want) {
		t.Errorf("remaining %v, want %v", left, want)
	}
	h = http.Header{"Ratelimit": {`"output_tokens";r=500;t=30, "other";r=1`}}
	if left := m.Remaining(h, time.Now()); !maps.Equal(left, map[string]float64{MeterOutputTokens: 500}) {
		t.Errorf("IETF RateLimit: remaining %v, want output_tokens 500", left)
	}
}

func TestOpenAI(t *testing.T) {
	m := OpenAI(OpenAILimits{Tokens: PerMinute(30000)})
	body := request("openai", 500, true)
	u, err := m.Estimate(httptest.NewRequest("POST", "/v1/chat/completions", nil), body)
	if err != nil {
		t.Fatal(err)
	}
	if want := (quota.Usage{MeterTokens: math.Ceil(float64(len(body))/4) + 500}); !maps.Equal(u, want) {
		t.Errorf("estimate %v, want %v", u, want)
	}
	u, _ = m.Estimate(httptest.NewRequest("POST", "/v1/chat/completions", nil), []byte(`{"max_completion_tokens":100}`))
	if u[MeterTokens] != 8+100 { // 29 bytes
		t.Errorf("estimate with max_completion_tokens: %v", u)
	}
	u, _ = m.Estimate(httptest.NewRequest("POST", "/v1/chat/completions", nil), []byte(`{}`))
	if u[MeterTokens] != 1+4096 {
		t.Errorf("estimate without max_tokens: %v, want 4096 for the answer", u)
	}
	got, ok := readUsage(t, m, "application/json", `{"id":"chatcmpl-1","choices":[{"message":{"content":"x"}}],"usage":{"prompt_tokens":12,"completion_tokens":34,"total_tokens":46}}`)
	if !ok || got[MeterTokens] != 46 {
		t.Errorf("JSON usage %v %v, want 46 tokens", got, ok)
	}
	chunk := "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n"
	got, ok = readUsage(t, m, "text/event-stream", chunk+chunk+"data: [DONE]\n\n")
	if ok {
		t.Errorf("a stream without its usage chunk: %v, want none", got)
	}
	got, ok = readUsage(t, m, "text/event-stream", chunk+"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":7,\"total_tokens\":12}}\n\ndata: [DONE]\n\n")
	if !ok || got[MeterTokens] != 12 {
		t.Errorf("a stream's usage chunk: %v %v, want 12 tokens", got, ok)
	}
	h := http.Header{}
	h.Set("x-ratelimit-remaining-requests", "499")
	h.Set("x-ratelimit-remaining-tokens", "29000")
	h.Set("x-ratelimit-reset-tokens", "6m0s")
	if left := m.Remaining(h, time.Now()); !maps.Equal(left, map[string]float64{quota.MeterRequests: 499, MeterTokens: 29000}) {
		t.Errorf("remaining %v", left)
	}
}

// requests is the requests' Limit of the tests' Transports.
var requests = quota.Limit{Rate: 100, Burst: 100}

// level returns what the meter of the Transport tr's bucket name holds
// now, to within 20 tokens, as a reservation with a deadline learns it:
// the most of the meter granted within a second, which at the tests'
// refill of a token a second is what it holds.
func level(t *testing.T, tr *quota.Transport, m quota.Metering, name, meter string) float64 {
	t.Helper()
	meters := append([]quota.Meter{{Name: quota.MeterRequests, Limit: requests}}, m.Meters...)
	var lim quota.Limit
	for _, mt := range meters {
		if mt.Name == meter {
			lim = mt.Limit
		}
	}
	l := tr.Limiter()
	lo, hi := 0.0, lim.Burst
	for hi-lo > 20 {
		mid := (lo + hi) / 2
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		r, err := l.Reserve(ctx, name, meters, quota.Usage{meter: mid})
		cancel()
		if errors.Is(err, quota.ErrWouldExceedDeadline) {
			hi = mid
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		r.Cancel()
		if err := l.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		lo = mid
	}
	return lo
}

// TestSettledInRedis: through a Transport on a real Redis, a request of
// each profile, its answer a JSON body or a stream, reserves what the
// profile estimates and is settled with what the answer reports:
// Anthropic takes the input tokens counted and gives back the output
// tokens not used; OpenAI gives nothing back. An Anthropic answer whose
// headers say less remains lowers the shared bucket to it. The meters
// refill a token a second, so what they hold tells what was settled.
func TestSettledInRedis(t *testing.T) {
	srv := redistest.Start(t)
	const burst, maxTokens, used = 10000, 1000, 100
	slow := quota.Limit{Rate: 1, Burst: burst}
	for i, c := range []struct {
		api     string
		stream  bool
		limited bool // the provider's output bucket holds 5,000 tokens
	}{
		{api: "anthropic"}, {api: "anthropic", stream: true}, {api: "anthropic", limited: true},
		{api: "openai"}, {api: "openai", stream: true},
	} {
		p := &llmfake.Server{Kind: llmfake.Anthropic, Latency: 10 * time.Millisecond, Used: func(int) int { return used }}
		// A bucket of the case's own: the next case's provider may listen
		// on the port this one closed.
		name := fmt.Sprintf("settled-%d", i)
		m := Anthropic(AnthropicLimits{InputTokens: slow, OutputTokens: slow})
		path := "/v1/messages"
		if c.api == "openai" {
			p.Kind, path = llmfake.OpenAI, "/v1/chat/completions"
			m = OpenAI(OpenAILimits{Tokens: slow})
		}
		if c.limited {
			p.Limits.OutputTokens = llmfake.Bucket{Rate: 1, Burst: burst / 2}
		}
		provider := httptest.NewServer(p)
		tr := quota.NewTransport(srv.Client(t), requests, quota.WithMetering(m), quota.WithKey(quota.Fixed(name)))
		body := request(c.api, maxTokens, c.stream)
		resp, err := (&http.Client{Transport: tr}).Post(provider.URL+path, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		provider.Close()
		if err := tr.Limiter().Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		what := c.api + map[bool]string{false: " body", true: " stream"}[c.stream]
		if c.limited {
			what += ", the provider's output bucket at 5,000"
		}
		recs := p.Records()
		if resp.StatusCode != 200 || len(recs) != 1 {
			t.Fatalf("%s: %s, %d requests admitted", what, resp.Status, len(recs))
		}
		input := float64(recs[0].Input)
		var want map[string]float64
		switch {
		case c.api == "openai":
			want = map[string]float64{MeterTokens: burst - EstimateCharacters(body) - maxTokens}
		case c.limited:
			// The headers said 4,000 remained after the reservation of
			// 1,000; the settle gives back 900 of it.
			want = map[string]float64{MeterInputTokens: burst - input, MeterOutputTokens: burst/2 - maxTokens + (maxTokens - used)}
		default:
			want = map[string]float64{MeterInputTokens: burst - input, MeterOutputTokens: burst - used}
		}
		for meter, n := range want {
			if got := level(t, tr, m, name, meter); got < n-40 || got > n+20 {
				t.Errorf("%s: %s holds %.0f after the settle, want about %.0f", what, meter, got, n)
			}
		}
	}
}
