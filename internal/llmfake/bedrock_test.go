package llmfake_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/eventstream"
	"github.com/sharedquota/quota/internal/llmfake"
)

const (
	claudeModel = "/model/anthropic.claude-sonnet-4-20250514-v1%3A0/"
	converseReq = `{"messages":[{"role":"user","content":[{"text":"How far is the Moon?"}]}],"inferenceConfig":{"maxTokens":100}}`
)

// converseInput is what the fake counts of converseReq.
const converseInput = (len("How far is the Moon?")+3)/4 + 3

// Converse answers with its usage; InvokeModel with Anthropic's body and
// the token-count headers; both send no rate-limit headers.
func TestBedrockAnswers(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Bedrock, Used: func(int) int { return 40 }}
	ts := serve(t, s)
	r := post(t, ts, claudeModel+"converse", []byte(converseReq), "")
	var c struct {
		Output struct {
			Message struct {
				Role    string
				Content []struct{ Text string }
			}
		}
		StopReason string
		Usage      map[string]int
		Metrics    map[string]int
	}
	if err := json.Unmarshal(r.body, &c); err != nil || r.status != http.StatusOK {
		t.Fatalf("%d %s: %v", r.status, r.body, err)
	}
	if c.Output.Message.Role != "assistant" || len(c.Output.Message.Content) != 1 || c.StopReason != "end_turn" ||
		c.Usage["inputTokens"] != converseInput || c.Usage["outputTokens"] != 40 || c.Usage["totalTokens"] != converseInput+40 {
		t.Errorf("Converse body %s, want an answer with usage %d and 40", r.body, converseInput)
	}
	if r.header.Get("x-amzn-RequestId") == "" {
		t.Error("no x-amzn-RequestId")
	}
	for k := range r.header {
		if strings.Contains(strings.ToLower(k), "ratelimit") {
			t.Errorf("a rate-limit header %s: Bedrock sends none", k)
		}
	}

	inv := post(t, ts, claudeModel+"invoke", []byte(`{"anthropic_version":"bedrock-2023-05-31","max_tokens":100,"messages":[{"role":"user","content":"Hi"}]}`), "")
	var m struct {
		Type, Model string
		Usage       map[string]int
	}
	if err := json.Unmarshal(inv.body, &m); err != nil || inv.status != http.StatusOK {
		t.Fatalf("%d %s: %v", inv.status, inv.body, err)
	}
	if m.Type != "message" || m.Model != "anthropic.claude-sonnet-4-20250514-v1:0" || m.Usage["output_tokens"] != 40 {
		t.Errorf("InvokeModel body %s, want Anthropic's message with 40 output tokens", inv.body)
	}
	wantHeader(t, inv.header, "X-Amzn-Bedrock-Input-Token-Count", "4")
	wantHeader(t, inv.header, "X-Amzn-Bedrock-Output-Token-Count", "40")
}

// ConverseStream sends AWS event-stream messages whose CRCs check, the
// metadata event last with the usage, spread over the Latency.
func TestBedrockStream(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Bedrock, Latency: 100 * time.Millisecond, Used: func(int) int { return 25 }}
	ts := serve(t, s)
	r := post(t, ts, claudeModel+"converse-stream", []byte(converseReq), "")
	if ct := r.header.Get("Content-Type"); r.status != http.StatusOK || ct != "application/vnd.amazon.eventstream" {
		t.Fatalf("%d %s", r.status, ct)
	}
	var types []string
	var text string
	var usage map[string]int
	rd := eventstream.Reader{On: func(m eventstream.Message) {
		if m.Headers[":message-type"] != "event" || m.Headers[":content-type"] != "application/json" {
			t.Errorf("headers %v, want an event of JSON", m.Headers)
		}
		typ := m.Headers[":event-type"]
		types = append(types, typ)
		var p struct {
			Delta struct{ Text string }
			Usage map[string]int
		}
		if err := json.Unmarshal(m.Payload, &p); err != nil {
			t.Errorf("%s payload %q: %v", typ, m.Payload, err)
		}
		text += p.Delta.Text
		if typ == "metadata" {
			usage = p.Usage
		}
	}}
	rd.Write(r.body)
	if err := rd.Err(); err != nil {
		t.Fatal(err)
	}
	want := "messageStart contentBlockDelta contentBlockDelta contentBlockDelta contentBlockDelta contentBlockStop messageStop metadata"
	if got := strings.Join(types, " "); got != want {
		t.Errorf("events %s, want %s", got, want)
	}
	if text != "Hello from the fake server." || usage["inputTokens"] != converseInput || usage["outputTokens"] != 25 {
		t.Errorf("text %q, usage %v", text, usage)
	}
	near(t, "the stream's end", r.elapsed, 100*time.Millisecond, 60*time.Millisecond)
}

// Bedrock charges input plus max tokens times the burndown at
// admission, gives back the output unused, times the burndown, when the
// answer ends, and refuses with a ThrottlingException, no Retry-After.
func TestBedrockMeters(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Bedrock, Latency: 50 * time.Millisecond, Used: func(int) int { return 10 },
		Limits: llmfake.Limits{Tokens: llmfake.Bucket{Rate: 1, Burst: 1000}, OutputBurndown: 5}}
	ts := serve(t, s)
	// 100 × 5 + input of 1000: admitted; a second one at once is not.
	if r := post(t, ts, claudeModel+"converse", []byte(converseReq), ""); r.status != http.StatusOK {
		t.Fatalf("first: %d %s", r.status, r.body)
	}
	if rec := onlyRecord(t, s); rec.Charged != converseInput+10*5 {
		t.Errorf("charged %d, want input and 10 × 5", rec.Charged)
	}
	// After the answer, 90 × 5 came back: 1000 - input - 50 remain, room
	// for another.
	if r := post(t, ts, claudeModel+"converse", []byte(converseReq), ""); r.status != http.StatusOK {
		t.Errorf("after the give-back: %d %s, want 200", r.status, r.body)
	}
	big := strings.Replace(converseReq, `"maxTokens":100`, `"maxTokens":190`, 1)
	r := post(t, ts, claudeModel+"converse-stream", []byte(big), "")
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("a request of 950 tokens more: %d, want 429", r.status)
	}
	if got := r.header.Get("X-Amzn-ErrorType"); !strings.HasPrefix(got, "ThrottlingException") {
		t.Errorf("X-Amzn-ErrorType %q, want ThrottlingException", got)
	}
	if got := r.header.Get("Retry-After"); got != "" {
		t.Errorf("Retry-After %q: Bedrock sends none", got)
	}
	var e struct{ Message string }
	if err := json.Unmarshal(r.body, &e); err != nil || !strings.Contains(e.Message, "Too many tokens") {
		t.Errorf("body %s, want Bedrock's message", r.body)
	}
}

// Requests Bedrock would not take are refused unmetered.
func TestBedrockBadRequests(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.Bedrock}
	ts := serve(t, s)
	for _, c := range []struct {
		path, body, errType string
		status              int
	}{
		{"/model/x/chat", converseReq, "UnknownOperationException", 404},
		{"/v1/messages", converseReq, "UnknownOperationException", 404},
		{claudeModel + "invoke", `{"messages":[]}`, "ValidationException", 400},
		{claudeModel + "converse", `not json`, "ValidationException", 400},
		{claudeModel + "converse", `{"inferenceConfig":{"maxTokens":0}}`, "ValidationException", 400},
	} {
		r := post(t, ts, c.path, []byte(c.body), "")
		if r.status != c.status || !strings.HasPrefix(r.header.Get("X-Amzn-ErrorType"), c.errType) {
			t.Errorf("%s %s: %d %s, want %d %s", c.path, c.body, r.status, r.header.Get("X-Amzn-ErrorType"), c.status, c.errType)
		}
	}
	if n := len(s.Records()); n != 0 {
		t.Errorf("%d requests recorded, want none", n)
	}
}
