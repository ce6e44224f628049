package quota

import (
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
)

// llmRequest returns the JSON body of the seq-th request of a worker to
// an LLM API, "anthropic" or "openai": one user message of 300 to 1200
// bytes, max_tokens, and a stream when stream is set (with its usage, for
// OpenAI).
func llmRequest(api string, seq, maxTokens int, stream bool) []byte {
	text := strings.Repeat("quota shares one limit across a fleet. ", 40)[:300+seq*137%900]
	req := map[string]any{
		"model":      "model-1",
		"max_tokens": maxTokens,
		"messages":   []map[string]any{{"role": "user", "content": text}},
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
func readUsage(t *testing.T, m Metering, contentType, body string) (Usage, bool) {
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

func TestAnthropicProfile(t *testing.T) {
	m := Anthropic(AnthropicLimits{InputTokens: PerMinute(40000), OutputTokens: PerMinute(8000)})
	if got := m.Meters[1].Limit; got.Burst != 8000 {
		t.Errorf("output meter %v, want a burst of a minute, 8000", got)
	}
	body := llmRequest("anthropic", 1, 1024, false)
	u, err := m.Estimate(httptest.NewRequest("POST", "/v1/messages", nil), body)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Usage{MeterInputTokens: math.Ceil(float64(len(body)) / 3), MeterOutputTokens: 1024}); !maps.Equal(u, want) {
		t.Errorf("estimate %v, want %v", u, want)
	}
	if _, err := m.Estimate(httptest.NewRequest("POST", "/v1/messages", nil), []byte("not json")); err == nil {
		t.Error("an estimate of a body that is not JSON did not fail")
	}
	got, ok := readUsage(t, m, "application/json", `{"id":"msg_1","type":"message","content":[{"type":"text","text":"a \"usage\": {\"output_tokens\": 9}"}],`+
		`"usage":{"input_tokens":10,"cache_creation_input_tokens":5,"cache_read_input_tokens":100,"output_tokens":20}}`)
	if want := (Usage{MeterInputTokens: 15, MeterOutputTokens: 20}); !ok || !maps.Equal(got, want) {
		t.Errorf("JSON usage %v %v, want %v (input with cache writes, without cache reads)", got, ok, want)
	}
	stream := "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"output_tokens\":1}}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"hi\"}}\n\n"
	got, ok = readUsage(t, m, "text/event-stream", stream)
	if want := (Usage{MeterInputTokens: 12}); !ok || !maps.Equal(got, want) {
		t.Errorf("a stream cut before message_delta: %v %v, want %v: the output keeps its reservation", got, ok, want)
	}
	stream += "event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":37}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
	got, ok = readUsage(t, m, "text/event-stream; charset=utf-8", stream)
	if want := (Usage{MeterInputTokens: 12, MeterOutputTokens: 37}); !ok || !maps.Equal(got, want) {
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
	if want := map[string]float64{MeterRequests: 49, MeterInputTokens: 39000, MeterOutputTokens: 7000}; !maps.Equal(left, want) {
		t.Errorf("remaining %v, want %v", left, want)
	}
	h = http.Header{"Ratelimit": {`"output_tokens";r=500;t=30, "other";r=1`}}
	if left := m.Remaining(h, time.Now()); !maps.Equal(left, map[string]float64{MeterOutputTokens: 500}) {
		t.Errorf("IETF RateLimit: remaining %v, want output_tokens 500", left)
	}
}

func TestOpenAIProfile(t *testing.T) {
	m := OpenAI(OpenAILimits{Tokens: PerMinute(30000)})
	body := llmRequest("openai", 1, 500, true)
	u, err := m.Estimate(httptest.NewRequest("POST", "/v1/chat/completions", nil), body)
	if err != nil {
		t.Fatal(err)
	}
	if want := (Usage{MeterTokens: math.Ceil(float64(len(body))/4) + 500}); !maps.Equal(u, want) {
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
	if left := m.Remaining(h, time.Now()); !maps.Equal(left, map[string]float64{MeterRequests: 499, MeterTokens: 29000}) {
		t.Errorf("remaining %v", left)
	}
}

// llmRun is one fleet's run against a fake LLM API, and what came of it.
type llmRun struct {
	api      string // "anthropic" or "openai"
	stream   bool
	noSettle bool    // the profile without its Usage
	quantile float64 // above zero: reserve this of the output in place of max_tokens
	ownLimit bool    // per-process limiters: each worker a prefix of its own
	run      time.Duration
	delay    time.Duration // from when its workers are ready to its start

	binding  float64 // of the binding limit's rate, in the steady window
	refused  int     // 429s
	requests int
	perReq   map[string]float64 // script calls a request, by operation
}

// llmFleet runs 4 worker processes x 8 goroutines through Transports
// WithMetering of the run's profile against a fake provider that meters
// as that provider documents, with the fleet's limits at 95% of the
// provider's. Anthropic: 100 requests, 40,000 input and 8,000 output
// tokens a second, the output binding; OpenAI: 100 requests and 20,000
// tokens (input and max_tokens, at admission) a second. Every request
// asks for 1,000 output tokens and uses 10 to 60% of them; the provider
// takes 100 ms to answer. The steady window leaves out the first 2.5 s
// and the last 0.3 s: the 32 first reservations queue at their whole
// max_tokens, 4 s of output at the fleet's rate, and the callers asleep
// in that queue learn of the settles that move it from their Limiters'
// reads of the record, every 0.5 s (see docs/llm.md).
func llmFleet(t *testing.T, srv *redistest.Server, r *llmRun) {
	t.Helper()
	p := &llmfake.Server{Latency: 100 * time.Millisecond}
	fleet := llmLimits{}
	switch r.api {
	case "anthropic":
		p.Kind = llmfake.Anthropic
		p.Limits = llmfake.Limits{
			Requests:     llmfake.Bucket{Rate: 100, Burst: 100},
			InputTokens:  llmfake.Bucket{Rate: 40000, Burst: 40000},
			OutputTokens: llmfake.Bucket{Rate: 8000, Burst: 8000},
		}
		fleet.Input, fleet.Output = Limit{Rate: 38000, Burst: 38000}, Limit{Rate: 7600, Burst: 7600}
	case "openai":
		p.Kind = llmfake.OpenAI
		p.Limits = llmfake.Limits{
			Requests: llmfake.Bucket{Rate: 100, Burst: 100},
			Tokens:   llmfake.Bucket{Rate: 20000, Burst: 20000},
		}
		fleet.Tokens = Limit{Rate: 19000, Burst: 19000}
	}
	provider := httptest.NewServer(p)
	defer provider.Close()
	path := "/v1/messages"
	if r.api == "openai" {
		path = "/v1/chat/completions"
	}
	spec := workerSpec{Addr: srv.Addr(), Key: provider.Listener.Addr().String(), Limit: Limit{Rate: 95, Burst: 95},
		Goroutines: 8, Duration: r.run, Delay: r.delay, URL: provider.URL + path, LLM: r.api, LLMLimits: fleet,
		Stream: r.stream, MaxTokens: 1000, NoSettle: r.noSettle, OwnPrefix: r.ownLimit, ReserveOutput: r.quantile}
	w := startWorkers(t, 4, spec)
	reps := w.wait(t)
	from, to := w.start.Add(2500*time.Millisecond), w.start.Add(r.run-300*time.Millisecond)
	var used, limit float64
	for _, rec := range p.Records() {
		if rec.At.Before(from) || !rec.At.Before(to) {
			continue
		}
		switch r.api {
		case "anthropic":
			used += float64(rec.Output)
		case "openai":
			used += float64(rec.Charged)
		}
	}
	switch r.api {
	case "anthropic":
		limit = p.Limits.OutputTokens.Rate
	case "openai":
		limit = p.Limits.Tokens.Rate
	}
	r.binding = used / to.Sub(from).Seconds() / limit
	r.refused = p.Refused()
	r.requests = len(p.Records()) + r.refused
	ops := map[string]int{}
	for _, rep := range reps {
		for op, n := range rep.Ops {
			ops[op] += n
		}
	}
	r.perReq = map[string]float64{}
	for op, n := range ops {
		r.perReq[op] = float64(n) / float64(max(1, r.requests))
	}
	t.Logf("%s: %d requests, %d refused with 429 (%v), %.2f of the binding limit's rate in the steady window; script calls a request: %v",
		r.name(), r.requests, r.refused, p.RefusedBy(), r.binding, r.perReq)
}

func (r *llmRun) name() string {
	s := r.api
	if r.stream {
		s += " stream"
	} else {
		s += " body"
	}
	switch {
	case r.noSettle:
		s += ", never settled (control)"
	case r.ownLimit:
		s += ", per-process limiters (control)"
	case r.quantile > 0:
		s += fmt.Sprintf(", reserving %g output tokens, not max_tokens", r.quantile)
	}
	return s
}

// TestLLMFleet: 4 processes x 8 goroutines through metered Transports at
// 95% of a fake provider's limits, for each provider, body and stream: no
// 429, at least 0.9 of the binding limit's rate in the steady window, at
// most one take call and one settle call a request.
func TestLLMFleet(t *testing.T) {
	redistest.Long(t)
	// Alone, not beside the parallel tests, so that the machine is not too
	// loaded for the fleets' timing: a grant that reaches the provider
	// late counts there in a later window than in the fleet's bucket.
	// The fleets run 10 s, so that their steady window of 7 s holds the
	// noise of the answers' spread of usage to about 0.02 of the limit.
	// They start 1 s apart, so that no two cold starts meet: a fleet hands
	// off its burst at once, and when those first requests reach the
	// provider later than the ones granted after them, the provider's
	// bucket, full meanwhile, loses to its cap the refill the fleet's
	// bucket counts on. The fleets' 5% (400 output tokens of Anthropic's)
	// covers 53 ms of that; with the four fleets' 16 workers starting
	// together on 2 cores, the first requests took 50 to 300 ms from the
	// Transport to the provider, and later ones 2 ms.
	srv := redistest.Start(t)
	fleets := []*llmRun{
		{api: "anthropic"}, {api: "anthropic", stream: true},
		{api: "openai"}, {api: "openai", stream: true},
	}
	runLLM(t, srv, fleets, 10*time.Second, time.Second)
	for _, r := range fleets {
		if r.refused > 0 {
			t.Errorf("%s: %d requests refused with 429", r.name(), r.refused)
		}
		if r.binding < 0.9 {
			t.Errorf("%s: %.2f of the binding limit's rate, want at least 0.9", r.name(), r.binding)
		}
		if n := r.perReq["take"]; n > 1.05 {
			t.Errorf("%s: %.2f take calls a request, want at most 1", r.name(), n)
		}
		if n := r.perReq["adjust"]; n > 1.05 {
			t.Errorf("%s: %.2f settle calls a request, want at most 1", r.name(), n)
		}
	}
}

// TestLLMFleetControls are TestLLMFleet's negative controls, 5 s each:
// per-process limiters meet 429s, a fleet that never settles stays well
// below the settled fleet's rate, and one that reserves the 90th
// percentile of the usage in place of max_tokens meets 429s (Anthropic
// charges max_tokens on arrival). Load only makes each more likely, so
// they run beside the parallel tests.
func TestLLMFleetControls(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	controls := []*llmRun{
		{api: "anthropic", ownLimit: true}, {api: "anthropic", noSettle: true},
		{api: "anthropic", quantile: 550}, // the usage's 90th percentile
	}
	runLLM(t, srv, controls, 5*time.Second, 0)
	for _, r := range controls {
		switch {
		case r.ownLimit && r.refused == 0:
			t.Errorf("%s: no 429: the provider's limits do not bind the fleet, and the test shows nothing", r.name())
		case r.noSettle && r.binding > 0.6:
			t.Errorf("%s: %.2f of the binding limit's rate, want well below the settled fleet's", r.name(), r.binding)
		case r.quantile > 0 && r.refused == 0:
			t.Errorf("%s: no 429: reserving less than max_tokens went unpunished, and the test shows nothing", r.name())
		}
	}
}

// runLLM runs the fleets rs side by side, each for d, the i-th starting
// i×stagger after the first.
func runLLM(t *testing.T, srv *redistest.Server, rs []*llmRun, d, stagger time.Duration) {
	var wg sync.WaitGroup
	for i, r := range rs {
		r.run, r.delay = d, time.Duration(i)*stagger
		wg.Go(func() { llmFleet(t, srv, r) })
	}
	wg.Wait()
}
