package llm

import (
	"maps"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/eventstream"
)

// claude5 is a burndown of 5 for the Claude models, 1 for the others.
func claude5(model string) float64 {
	if strings.Contains(model, "anthropic.claude") {
		return 5
	}
	return 1
}

const converseBody = `{"messages":[{"role":"user","content":[{"text":"How far is the Moon?"}]}],"inferenceConfig":{"maxTokens":300}}`

// A Bedrock request reserves its input estimate and its maximum output,
// times the model's burndown, from Converse's inferenceConfig.maxTokens
// or an Anthropic body's max_tokens, and MaxTokens when it names none.
func TestBedrockEstimate(t *testing.T) {
	m := Bedrock(BedrockLimits{Tokens: PerMinute(200000), OutputBurndown: claude5, MaxTokens: 1000})
	if got := m.Meters[0].Limit; got != PerMinute(200000) {
		t.Errorf("tokens meter %v, want %v", got, PerMinute(200000))
	}
	if len(m.NoGiveBack) != 0 || m.Remaining != nil {
		t.Errorf("NoGiveBack %v, Remaining set %v: Bedrock gives back, and sends no remaining counts", m.NoGiveBack, m.Remaining != nil)
	}
	anthropicBody := `{"anthropic_version":"bedrock-2023-05-31","max_tokens":200,"messages":[{"role":"user","content":"Hi"}]}`
	for _, c := range []struct {
		path, body string
		out        float64
	}{
		{"/model/us.anthropic.claude-sonnet-4-20250514-v1%3A0/converse", converseBody, 300 * 5},
		{"/model/amazon.nova-pro-v1%3A0/converse-stream", converseBody, 300},
		{"/model/anthropic.claude-3-haiku-20240307-v1%3A0/invoke", anthropicBody, 200 * 5},
		{"/model/amazon.nova-pro-v1%3A0/converse", `{"messages":[]}`, 1000},
		{"/model/arn%3Aaws%3Abedrock%3Aus-east-1%3A1%3Ainference-profile%2Fus.anthropic.claude-opus-4-v1%3A0/converse", converseBody, 300 * 5},
	} {
		u, err := m.Estimate(httptest.NewRequest("POST", c.path, nil), []byte(c.body))
		if want := (quota.Usage{MeterTokens: EstimateInput([]byte(c.body)) + c.out}); err != nil || !maps.Equal(u, want) {
			t.Errorf("%s %s: estimate %v, %v; want %v", c.path, c.body, u, err, want)
		}
	}
	if u, err := m.Estimate(httptest.NewRequest("GET", "/model/x/converse", nil), nil); u != nil || err != nil {
		t.Errorf("a request without a body: %v, %v; want nothing", u, err)
	}
	if _, err := m.Estimate(httptest.NewRequest("POST", "/model/x/converse", nil), []byte("not json")); err == nil {
		t.Error("an estimate of a body that is not JSON did not fail")
	}
	bad := Bedrock(BedrockLimits{Tokens: PerMinute(200000), OutputBurndown: func(string) float64 { return 0.5 }})
	if _, err := bad.Estimate(httptest.NewRequest("POST", "/model/x/converse", nil), []byte(converseBody)); err == nil || !strings.Contains(err.Error(), `OutputBurndown("x") = 0.5`) {
		t.Errorf("a burndown of 0.5: %v, want an error naming it", err)
	}
}

// bedrockResponse is a 200 response to a request to path, of contentType.
func bedrockResponse(path, contentType string) *http.Response {
	return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {contentType}},
		Request: httptest.NewRequest("POST", path, nil)}
}

// feed writes body to ur in chunks of 5 bytes and returns its usage.
func feed(ur quota.UsageReader, body []byte) (quota.Usage, bool) {
	for b := body; len(b) > 0; {
		n := min(5, len(b))
		ur.Write(b[:n])
		b = b[n:]
	}
	return ur.Usage()
}

// A Bedrock answer settles with its input, cache writes and output times
// the burndown: from the headers of InvokeModel, else from the usage of
// the body (Converse's or Anthropic's), or of a ConverseStream's metadata.
func TestBedrockUsage(t *testing.T) {
	m := Bedrock(BedrockLimits{Tokens: PerMinute(200000), OutputBurndown: claude5})
	claude := "/model/anthropic.claude-sonnet-4-20250514-v1%3A0/"
	converse := `{"output":{"message":{"role":"assistant","content":[{"text":"\"usage\":{\"inputTokens\":1}"}]}},"stopReason":"end_turn",` +
		`"usage":{"inputTokens":10,"outputTokens":20,"totalTokens":30,"cacheReadInputTokens":100,"cacheWriteInputTokens":4},"metrics":{"latencyMs":90}}`
	got, ok := feed(m.Usage(bedrockResponse(claude+"converse", "application/json")), []byte(converse))
	if want := (quota.Usage{MeterTokens: 10 + 4 + 20*5}); !ok || !maps.Equal(got, want) {
		t.Errorf("Converse body: %v, %v; want %v", got, ok, want)
	}
	got, ok = feed(m.Usage(bedrockResponse("/model/amazon.nova-pro-v1%3A0/converse", "application/json")), []byte(converse))
	if want := (quota.Usage{MeterTokens: 10 + 4 + 20}); !ok || !maps.Equal(got, want) {
		t.Errorf("Converse body, burndown 1: %v, %v; want %v", got, ok, want)
	}
	invoke := `{"id":"msg_1","type":"message","content":[],"usage":{"input_tokens":8,"cache_creation_input_tokens":2,"output_tokens":3}}`
	got, ok = feed(m.Usage(bedrockResponse(claude+"invoke", "application/json")), []byte(invoke))
	if want := (quota.Usage{MeterTokens: 8 + 2 + 3*5}); !ok || !maps.Equal(got, want) {
		t.Errorf("InvokeModel body: %v, %v; want %v", got, ok, want)
	}
	resp := bedrockResponse(claude+"invoke", "application/json")
	resp.Header.Set("X-Amzn-Bedrock-Input-Token-Count", "7")
	resp.Header.Set("X-Amzn-Bedrock-Output-Token-Count", "6")
	got, ok = feed(m.Usage(resp), []byte(`{"usage":{"input_tokens":1000,"output_tokens":1000}}`))
	if want := (quota.Usage{MeterTokens: 7 + 6*5}); !ok || !maps.Equal(got, want) {
		t.Errorf("InvokeModel headers: %v, %v; want %v (the headers win)", got, ok, want)
	}

	event := func(typ, payload string) []byte {
		return eventstream.Encode([][2]string{{":event-type", typ}, {":content-type", "application/json"}, {":message-type", "event"}}, []byte(payload))
	}
	var stream []byte
	stream = append(stream, event("messageStart", `{"role":"assistant"}`)...)
	stream = append(stream, event("contentBlockDelta", `{"contentBlockIndex":0,"delta":{"text":"\"usage\""}}`)...)
	stream = append(stream, event("messageStop", `{"stopReason":"end_turn"}`)...)
	cut := len(stream)
	stream = append(stream, event("metadata", `{"usage":{"inputTokens":11,"outputTokens":9,"totalTokens":20},"metrics":{"latencyMs":5}}`)...)
	const es = "application/vnd.amazon.eventstream"
	got, ok = feed(m.Usage(bedrockResponse(claude+"converse-stream", es)), stream)
	if want := (quota.Usage{MeterTokens: 11 + 9*5}); !ok || !maps.Equal(got, want) {
		t.Errorf("ConverseStream: %v, %v; want %v", got, ok, want)
	}
	if got, ok := feed(m.Usage(bedrockResponse(claude+"converse-stream", es)), stream[:cut]); ok {
		t.Errorf("a stream cut before its metadata: %v, want no usage (the reservation kept)", got)
	}
	exception := eventstream.Encode([][2]string{{":exception-type", "throttlingException"}, {":message-type", "exception"}}, []byte(`{"message":"slow down"}`))
	if got, ok := feed(m.Usage(bedrockResponse(claude+"converse-stream", es)), append(stream[:cut:cut], exception...)); ok {
		t.Errorf("a stream ended by an exception: %v, want no usage", got)
	}
	if ur := m.Usage(&http.Response{StatusCode: 429, Header: http.Header{"X-Amzn-Errortype": {"ThrottlingException"}}}); ur != nil {
		t.Error("a 429 is settled")
	}
}

// Bedrock's profile panics as the others do on a Limit with no Burst.
func TestBedrockLimits(t *testing.T) {
	defer func() {
		if r, _ := recover().(string); !strings.Contains(r, "llm.Bedrock: Tokens") {
			t.Errorf("panic %q, want one naming llm.Bedrock's Tokens", r)
		}
	}()
	Bedrock(BedrockLimits{Tokens: quota.PerMinute(200000)})
}
