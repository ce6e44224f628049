package llmfake_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
)

const (
	anthropicPath = "/v1/messages"
	openAIPath    = "/v1/chat/completions"
)

// serve starts s on a test server, closed when the test ends.
func serve(t *testing.T, s http.Handler) *httptest.Server {
	t.Helper()
	ts := httptest.NewServer(s)
	t.Cleanup(ts.Close)
	return ts
}

// reply is a whole answer as the client saw it.
type reply struct {
	status  int
	header  http.Header
	body    []byte
	elapsed time.Duration // from sending the request to the end of the body
}

// post sends body (encoded as JSON unless it is a []byte) to path on ts
// with the X-Quota-Worker header worker, and reads the whole answer.
func post(t *testing.T, ts *httptest.Server, path string, body any, worker string) reply {
	t.Helper()
	r, err := exchange(context.Background(), ts, http.MethodPost, path, body, worker)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// exchange is post for any method, reporting failure instead of ending
// the test, so that other goroutines can use it.
func exchange(ctx context.Context, ts *httptest.Server, method, path string, body any, worker string) (reply, error) {
	resp, start, err := open(ctx, ts, method, path, body, worker)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, fmt.Errorf("reading the answer: %w", err)
	}
	return reply{resp.StatusCode, resp.Header, b, time.Since(start)}, nil
}

// send sends a request and returns the response, whose body is unread, and
// when the request was sent.
func send(t *testing.T, ctx context.Context, ts *httptest.Server, method, path string, body any, worker string) (*http.Response, time.Time) {
	t.Helper()
	resp, start, err := open(ctx, ts, method, path, body, worker)
	if err != nil {
		t.Fatal(err)
	}
	return resp, start
}

// open is send, reporting failure instead of ending the test.
func open(ctx context.Context, ts *httptest.Server, method, path string, body any, worker string) (*http.Response, time.Time, error) {
	b, ok := body.([]byte)
	if !ok {
		var err error
		if b, err = json.Marshal(body); err != nil {
			return nil, time.Time{}, err
		}
	}
	req, err := http.NewRequestWithContext(ctx, method, ts.URL+path, bytes.NewReader(b))
	if err != nil {
		return nil, time.Time{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if worker != "" {
		req.Header.Set("X-Quota-Worker", worker)
	}
	start := time.Now()
	resp, err := ts.Client().Do(req)
	if err != nil {
		return nil, time.Time{}, fmt.Errorf("%s %s: %w", method, path, err)
	}
	return resp, start, nil
}

// anthropicRequest is a Messages API request body with one user message.
func anthropicRequest(maxTokens int, stream bool, text string) map[string]any {
	return map[string]any{
		"model":      "claude-test",
		"max_tokens": maxTokens,
		"stream":     stream,
		"messages":   []map[string]any{{"role": "user", "content": text}},
	}
}

// openAIRequest is a Chat Completions request body with one user message
// and the extra fields.
func openAIRequest(text string, extra map[string]any) map[string]any {
	req := map[string]any{
		"model":    "gpt-test",
		"messages": []map[string]any{{"role": "user", "content": text}},
	}
	for k, v := range extra {
		req[k] = v
	}
	return req
}

// inputOf is the input tokens the server counts for body.
func inputOf(t *testing.T, body any) int {
	t.Helper()
	b, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	return llmfake.InputTokens(b)
}

// decodeStrict decodes b into v, failing on fields v does not have.
func decodeStrict(t *testing.T, b []byte, v any) {
	t.Helper()
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		t.Fatalf("decoding %s: %v", b, err)
	}
}

// sseEvent is one server-sent event.
type sseEvent struct {
	name string // the "event:" field, empty when absent
	data string // the "data:" lines, joined by newlines
}

// splitSSE splits a whole event stream into its events.
func splitSSE(t *testing.T, body []byte) []sseEvent {
	t.Helper()
	s := string(body)
	if !strings.HasSuffix(s, "\n\n") {
		t.Fatalf("stream does not end with a blank line: %q", s)
	}
	var events []sseEvent
	for _, block := range strings.Split(strings.TrimSuffix(s, "\n\n"), "\n\n") {
		var ev sseEvent
		var data []string
		for _, line := range strings.Split(block, "\n") {
			switch {
			case strings.HasPrefix(line, "event: "):
				ev.name = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				data = append(data, strings.TrimPrefix(line, "data: "))
			default:
				t.Fatalf("unexpected stream line %q", line)
			}
		}
		ev.data = strings.Join(data, "\n")
		events = append(events, ev)
	}
	return events
}

// Mirrors of the Anthropic SDK's types.
type (
	antMessage struct {
		ID           string     `json:"id"`
		Type         string     `json:"type"`
		Role         string     `json:"role"`
		Model        string     `json:"model"`
		Content      []antBlock `json:"content"`
		StopReason   *string    `json:"stop_reason"`
		StopSequence *string    `json:"stop_sequence"`
		Usage        antUsage   `json:"usage"`
	}
	antBlock struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	antUsage struct {
		InputTokens              int `json:"input_tokens"`
		CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
		CacheReadInputTokens     int `json:"cache_read_input_tokens"`
		OutputTokens             int `json:"output_tokens"`
	}
	antError struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
)

// Mirrors of the OpenAI SDK's types.
type (
	oaiCompletion struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		Model   string `json:"model"`
		Choices []struct {
			Index   int `json:"index"`
			Message struct {
				Role    string `json:"role"`
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage oaiUsage `json:"usage"`
	}
	oaiChunk struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Created int64  `json:"created"`
		Model   string `json:"model"`
		Choices []struct {
			Index int `json:"index"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
		Usage *oaiUsage `json:"usage"`
	}
	oaiUsage struct {
		PromptTokens     int `json:"prompt_tokens"`
		CompletionTokens int `json:"completion_tokens"`
		TotalTokens      int `json:"total_tokens"`
	}
	oaiError struct {
		Error struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    *string `json:"code"`
		} `json:"error"`
	}
)

// onlyRecord returns the server's one record.
func onlyRecord(t *testing.T, s *llmfake.Server) llmfake.Record {
	t.Helper()
	recs := s.Records()
	if len(recs) != 1 {
		t.Fatalf("Records: %d, want 1: %+v", len(recs), recs)
	}
	return recs[0]
}

// wantHeader checks that header k is v.
func wantHeader(t *testing.T, h http.Header, k, v string) {
	t.Helper()
	if got := h.Get(k); got != v {
		t.Errorf("header %s = %q, want %q", k, got, v)
	}
}

// near checks that got is within tol of want.
func near(t *testing.T, what string, got, want, tol time.Duration) {
	t.Helper()
	if d := got - want; d < -tol || d > tol {
		t.Errorf("%s = %v, want %v ± %v", what, got, want, tol)
	}
}

func TestInputTokens(t *testing.T) {
	for _, c := range []struct {
		name string
		body string
		want int
	}{
		// 8 + 6 ("héllo" is 6 bytes) + 1 bytes of text: 4 tokens, plus
		// 3 for each of 2 messages. The system prompt and the image do
		// not count.
		{"mixed", `{"model":"m","max_tokens":5,"system":"not counted",
			"messages":[{"role":"user","content":"abcdefgh"},
			{"role":"assistant","content":[{"type":"text","text":"héllo"},
			{"type":"image","source":{"type":"base64","data":"AAAA"}},
			{"type":"text","text":"x"}]}]}`, 10},
		{"one byte", `{"messages":[{"role":"user","content":"a"}]}`, 4},
		{"four bytes", `{"messages":[{"role":"user","content":"abcd"}]}`, 4},
		{"empty content", `{"messages":[{"role":"user","content":""}]}`, 3},
		{"no messages", `{"messages":[]}`, 0},
		{"not JSON", `nope`, 0},
	} {
		if got := llmfake.InputTokens([]byte(c.body)); got != c.want {
			t.Errorf("%s: InputTokens = %d, want %d", c.name, got, c.want)
		}
	}
}

func TestAnthropicJSON(t *testing.T) {
	s := &llmfake.Server{
		Kind: llmfake.Anthropic,
		Limits: llmfake.Limits{
			Requests:     llmfake.Bucket{Rate: 10, Burst: 50},
			InputTokens:  llmfake.Bucket{Rate: 1000, Burst: 10000},
			OutputTokens: llmfake.Bucket{Rate: 1000, Burst: 10000},
		},
		Latency: 30 * time.Millisecond,
		Used:    func(m int) int { return m / 4 },
	}
	ts := serve(t, s)
	body := anthropicRequest(400, false, "Hello there, how are you today?")
	n := inputOf(t, body)
	r := post(t, ts, anthropicPath, body, "w1")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if r.elapsed < s.Latency {
		t.Errorf("answered in %v, before the latency %v", r.elapsed, s.Latency)
	}
	wantHeader(t, r.header, "Content-Type", "application/json")
	if r.header.Get("request-id") == "" {
		t.Error("no request-id header")
	}

	var m antMessage
	decodeStrict(t, r.body, &m)
	if !strings.HasPrefix(m.ID, "msg_") || m.Type != "message" || m.Role != "assistant" || m.Model != "claude-test" {
		t.Errorf("message = %+v", m)
	}
	if len(m.Content) != 1 || m.Content[0].Type != "text" || m.Content[0].Text == "" {
		t.Errorf("content = %+v", m.Content)
	}
	if m.StopReason == nil || *m.StopReason != "end_turn" || m.StopSequence != nil {
		t.Errorf("stop_reason %v, stop_sequence %v", m.StopReason, m.StopSequence)
	}
	if want := (antUsage{InputTokens: n, OutputTokens: 100}); m.Usage != want {
		t.Errorf("usage = %+v, want %+v", m.Usage, want)
	}

	rec := onlyRecord(t, s)
	if want := (llmfake.Record{At: rec.At, Input: n, Max: 400, Output: 100, Worker: "w1"}); rec != want {
		t.Errorf("record = %+v, want %+v", rec, want)
	}

	// Levels right after admission, and when each bucket is full again.
	for _, c := range []struct {
		meter            string
		limit, remaining int
		untilFull        time.Duration
	}{
		{"requests", 50, 49, 100 * time.Millisecond},
		{"input-tokens", 10000, 10000 - n, time.Duration(n) * time.Millisecond},
		{"output-tokens", 10000, 9600, 400 * time.Millisecond},
	} {
		p := "anthropic-ratelimit-" + c.meter
		wantHeader(t, r.header, p+"-limit", strconv.Itoa(c.limit))
		wantHeader(t, r.header, p+"-remaining", strconv.Itoa(c.remaining))
		reset, err := time.Parse(time.RFC3339, r.header.Get(p+"-reset"))
		if err != nil {
			t.Errorf("%s-reset: %v", p, err)
			continue
		}
		near(t, p+"-reset after admission", reset.Sub(rec.At), c.untilFull, 2*time.Millisecond)
	}
}

func TestAnthropicStream(t *testing.T) {
	s := &llmfake.Server{
		Kind:    llmfake.Anthropic,
		Limits:  llmfake.Limits{OutputTokens: llmfake.Bucket{Rate: 1000, Burst: 10000}},
		Latency: 200 * time.Millisecond,
		Used:    func(m int) int { return m / 2 },
	}
	ts := serve(t, s)
	body := anthropicRequest(300, true, "Tell me a story.")
	n := inputOf(t, body)
	resp, start := send(t, context.Background(), ts, http.MethodPost, anthropicPath, body, "w2")
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	wantHeader(t, resp.Header, "Content-Type", "text/event-stream")
	wantHeader(t, resp.Header, "anthropic-ratelimit-output-tokens-remaining", "9700")
	if resp.Header.Get("request-id") == "" {
		t.Error("no request-id header")
	}

	// The first event comes at admission, the last at the end of Latency.
	br := bufio.NewReader(resp.Body)
	var first []byte
	for !bytes.HasSuffix(first, []byte("\n\n")) {
		line, err := br.ReadBytes('\n')
		if err != nil {
			t.Fatalf("reading the first event: %v", err)
		}
		first = append(first, line...)
	}
	firstAt := time.Since(start)
	rest, err := io.ReadAll(br)
	if err != nil {
		t.Fatal(err)
	}
	endAt := time.Since(start)
	if endAt < s.Latency {
		t.Errorf("stream ended after %v, before the latency %v", endAt, s.Latency)
	}
	if endAt-firstAt < s.Latency/2 {
		t.Errorf("first event at %v, last at %v: not spread over the latency %v", firstAt, endAt, s.Latency)
	}

	events := splitSSE(t, append(first, rest...))
	var names []string
	for _, ev := range events {
		names = append(names, ev.name)
		var typed struct {
			Type string `json:"type"`
		}
		if err := json.Unmarshal([]byte(ev.data), &typed); err != nil || typed.Type != ev.name {
			t.Errorf("event %s has data %s", ev.name, ev.data)
		}
	}
	deltas := 0
	for deltas+2 < len(names) && names[deltas+2] == "content_block_delta" {
		deltas++
	}
	want := []string{"message_start", "content_block_start"}
	for range deltas {
		want = append(want, "content_block_delta")
	}
	want = append(want, "content_block_stop", "message_delta", "message_stop")
	if deltas < 1 || strings.Join(names, ",") != strings.Join(want, ",") {
		t.Fatalf("events %v", names)
	}

	var start0 struct {
		Type    string     `json:"type"`
		Message antMessage `json:"message"`
	}
	decodeStrict(t, []byte(events[0].data), &start0)
	msg := start0.Message
	if !strings.HasPrefix(msg.ID, "msg_") || msg.Model != "claude-test" || msg.StopReason != nil || msg.StopSequence != nil {
		t.Errorf("message_start message = %+v", msg)
	}
	if !strings.Contains(events[0].data, `"content":[]`) {
		t.Errorf("message_start content is not an empty array: %s", events[0].data)
	}
	if want := (antUsage{InputTokens: n, OutputTokens: 1}); msg.Usage != want {
		t.Errorf("message_start usage = %+v, want %+v", msg.Usage, want)
	}

	var blockStart struct {
		Type         string   `json:"type"`
		Index        int      `json:"index"`
		ContentBlock antBlock `json:"content_block"`
	}
	decodeStrict(t, []byte(events[1].data), &blockStart)
	if blockStart.ContentBlock.Type != "text" {
		t.Errorf("content_block_start = %+v", blockStart)
	}
	var text strings.Builder
	for _, ev := range events[2 : 2+deltas] {
		var d struct {
			Type  string   `json:"type"`
			Index int      `json:"index"`
			Delta antBlock `json:"delta"`
		}
		decodeStrict(t, []byte(ev.data), &d)
		if d.Delta.Type != "text_delta" || d.Index != 0 {
			t.Errorf("content_block_delta = %+v", d)
		}
		text.WriteString(d.Delta.Text)
	}
	if text.Len() == 0 {
		t.Error("the stream has no text")
	}

	var md struct {
		Type  string `json:"type"`
		Delta struct {
			StopReason   *string `json:"stop_reason"`
			StopSequence *string `json:"stop_sequence"`
		} `json:"delta"`
		Usage struct {
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}
	decodeStrict(t, []byte(events[len(events)-2].data), &md)
	if md.Delta.StopReason == nil || *md.Delta.StopReason != "end_turn" || md.Delta.StopSequence != nil {
		t.Errorf("message_delta delta = %+v", md.Delta)
	}
	if md.Usage.OutputTokens != 150 {
		t.Errorf("message_delta output_tokens = %d, want 150", md.Usage.OutputTokens)
	}
	rec := onlyRecord(t, s)
	if rec.Output != 150 || rec.Input != n || rec.Max != 300 || !rec.Stream || rec.Worker != "w2" {
		t.Errorf("record = %+v", rec)
	}
}

func TestOpenAIJSON(t *testing.T) {
	s := &llmfake.Server{
		Kind: llmfake.OpenAI,
		Limits: llmfake.Limits{
			Requests: llmfake.Bucket{Rate: 1, Burst: 60},
			Tokens:   llmfake.Bucket{Rate: 10, Burst: 100000},
		},
		Latency: 30 * time.Millisecond,
		Used:    func(m int) int { return 20 },
	}
	ts := serve(t, s)
	// max_completion_tokens wins over max_tokens.
	body := openAIRequest("What is the time?", map[string]any{"max_completion_tokens": 200, "max_tokens": 999})
	n := inputOf(t, body)
	r := post(t, ts, openAIPath, body, "w3")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if r.elapsed < s.Latency {
		t.Errorf("answered in %v, before the latency %v", r.elapsed, s.Latency)
	}
	wantHeader(t, r.header, "Content-Type", "application/json")
	if r.header.Get("x-request-id") == "" {
		t.Error("no x-request-id header")
	}

	var c oaiCompletion
	decodeStrict(t, r.body, &c)
	if !strings.HasPrefix(c.ID, "chatcmpl-") || c.Object != "chat.completion" || c.Model != "gpt-test" || c.Created == 0 {
		t.Errorf("completion = %+v", c)
	}
	if len(c.Choices) != 1 || c.Choices[0].Message.Role != "assistant" || c.Choices[0].Message.Content == "" || c.Choices[0].FinishReason != "stop" {
		t.Errorf("choices = %+v", c.Choices)
	}
	if want := (oaiUsage{n, 20, n + 20}); c.Usage != want {
		t.Errorf("usage = %+v, want %+v", c.Usage, want)
	}

	rec := onlyRecord(t, s)
	if want := (llmfake.Record{At: rec.At, Input: n, Max: 200, Output: 20, Charged: n + 200, Worker: "w3"}); rec != want {
		t.Errorf("record = %+v, want %+v", rec, want)
	}
	if c.Created != rec.At.Unix() {
		t.Errorf("created %d, admitted at %d", c.Created, rec.At.Unix())
	}

	wantHeader(t, r.header, "x-ratelimit-limit-requests", "60")
	wantHeader(t, r.header, "x-ratelimit-remaining-requests", "59")
	wantHeader(t, r.header, "x-ratelimit-reset-requests", "1s")
	wantHeader(t, r.header, "x-ratelimit-limit-tokens", "100000")
	wantHeader(t, r.header, "x-ratelimit-remaining-tokens", strconv.Itoa(100000-n-200))
	reset, err := time.ParseDuration(r.header.Get("x-ratelimit-reset-tokens"))
	if err != nil {
		t.Fatalf("x-ratelimit-reset-tokens: %v", err)
	}
	near(t, "x-ratelimit-reset-tokens", reset, time.Duration(n+200)*100*time.Millisecond, time.Millisecond)
}

func TestOpenAIResetFormat(t *testing.T) {
	// One request of a bucket refilling one every 6 minutes.
	s := &llmfake.Server{
		Kind:   llmfake.OpenAI,
		Limits: llmfake.Limits{Requests: llmfake.Bucket{Rate: 1.0 / 360, Burst: 10}},
	}
	r := post(t, serve(t, s), openAIPath, openAIRequest("hi", nil), "")
	if r.status != http.StatusOK {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	wantHeader(t, r.header, "x-ratelimit-reset-requests", "6m0s")
	// Unlimited meters have no headers.
	if v := r.header.Get("x-ratelimit-limit-tokens"); v != "" {
		t.Errorf("x-ratelimit-limit-tokens = %q for an unlimited meter", v)
	}
}

func TestOpenAIStream(t *testing.T) {
	for _, includeUsage := range []bool{false, true} {
		t.Run("include_usage="+strconv.FormatBool(includeUsage), func(t *testing.T) {
			s := &llmfake.Server{
				Kind:    llmfake.OpenAI,
				Latency: 30 * time.Millisecond,
				Used:    func(m int) int { return 7 },
			}
			ts := serve(t, s)
			extra := map[string]any{"stream": true, "max_tokens": 50}
			if includeUsage {
				extra["stream_options"] = map[string]any{"include_usage": true}
			}
			body := openAIRequest("Stream, please.", extra)
			n := inputOf(t, body)
			r := post(t, ts, openAIPath, body, "")
			if r.status != http.StatusOK {
				t.Fatalf("status %d: %s", r.status, r.body)
			}
			wantHeader(t, r.header, "Content-Type", "text/event-stream")
			if r.elapsed < s.Latency {
				t.Errorf("answered in %v, before the latency %v", r.elapsed, s.Latency)
			}

			events := splitSSE(t, r.body)
			if len(events) < 3 || events[len(events)-1].data != "[DONE]" {
				t.Fatalf("events %+v", events)
			}
			chunks := events[:len(events)-1]
			var text strings.Builder
			stops := 0
			for i, ev := range chunks {
				if ev.name != "" {
					t.Errorf("chunk %d has event name %q", i, ev.name)
				}
				var fields map[string]json.RawMessage
				if err := json.Unmarshal([]byte(ev.data), &fields); err != nil {
					t.Fatalf("chunk %d: %v", i, err)
				}
				usage, has := fields["usage"]
				last := i == len(chunks)-1
				switch {
				case !includeUsage && has:
					t.Errorf("chunk %d has a usage field without include_usage: %s", i, ev.data)
				case includeUsage && !has:
					t.Errorf("chunk %d has no usage field with include_usage: %s", i, ev.data)
				case includeUsage && !last && string(usage) != "null":
					t.Errorf("chunk %d has usage %s, want null", i, usage)
				}

				var c oaiChunk
				decodeStrict(t, []byte(ev.data), &c)
				if !strings.HasPrefix(c.ID, "chatcmpl-") || c.Object != "chat.completion.chunk" || c.Model != "gpt-test" || c.Created == 0 {
					t.Errorf("chunk %d = %+v", i, c)
				}
				if includeUsage && last {
					if len(c.Choices) != 0 || c.Usage == nil || !strings.Contains(ev.data, `"choices":[]`) {
						t.Errorf("usage chunk = %s", ev.data)
					} else if want := (oaiUsage{n, 7, n + 7}); *c.Usage != want {
						t.Errorf("usage = %+v, want %+v", *c.Usage, want)
					}
					continue
				}
				if len(c.Choices) != 1 {
					t.Fatalf("chunk %d has %d choices", i, len(c.Choices))
				}
				text.WriteString(c.Choices[0].Delta.Content)
				if f := c.Choices[0].FinishReason; f != nil {
					if *f != "stop" {
						t.Errorf("finish_reason %q", *f)
					}
					stops++
				}
			}
			if text.Len() == 0 {
				t.Error("the stream has no text")
			}
			if stops != 1 {
				t.Errorf("%d chunks with a finish_reason, want 1", stops)
			}
			rec := onlyRecord(t, s)
			if rec.Output != 7 || rec.Input != n || rec.Max != 50 || rec.Charged != n+50 || !rec.Stream {
				t.Errorf("record = %+v", rec)
			}
		})
	}
}

func TestRefusals(t *testing.T) {
	ant := anthropicRequest(100, false, "Some question for the model.")
	antN := inputOf(t, ant)
	oai := openAIRequest("Some question for the model.", map[string]any{"max_tokens": 100})
	oaiN := inputOf(t, oai)
	// A bucket refilling in 10 seconds what one request takes.
	tenSeconds := func(charge int) llmfake.Bucket {
		return llmfake.Bucket{Rate: float64(charge) / 10, Burst: float64(charge)}
	}
	// Requests has a limit it does not reach, to show that a refusal
	// charges nothing.
	spare := llmfake.Bucket{Rate: 0.001, Burst: 5}
	for _, c := range []struct {
		name   string
		kind   llmfake.Kind
		limits llmfake.Limits
		meter  string
		retry  int
	}{
		{"anthropic requests", llmfake.Anthropic, llmfake.Limits{Requests: tenSeconds(1)}, "requests", 10},
		{"anthropic input", llmfake.Anthropic, llmfake.Limits{Requests: spare, InputTokens: tenSeconds(antN)}, "input_tokens", 10},
		{"anthropic output", llmfake.Anthropic, llmfake.Limits{Requests: spare, OutputTokens: tenSeconds(100)}, "output_tokens", 10},
		// Both token meters are short; output takes longer to refill.
		{"anthropic longest", llmfake.Anthropic, llmfake.Limits{
			Requests:     spare,
			InputTokens:  tenSeconds(antN),
			OutputTokens: llmfake.Bucket{Rate: 5, Burst: 100},
		}, "output_tokens", 20},
		{"openai requests", llmfake.OpenAI, llmfake.Limits{Requests: tenSeconds(1)}, "requests", 10},
		{"openai tokens", llmfake.OpenAI, llmfake.Limits{Requests: spare, Tokens: tenSeconds(oaiN + 100)}, "tokens", 10},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &llmfake.Server{
				Kind:    c.kind,
				Limits:  c.limits,
				Latency: 20 * time.Millisecond,
				Used:    func(m int) int { return m }, // nothing to give back
			}
			ts := serve(t, s)
			path, body := anthropicPath, ant
			if c.kind == llmfake.OpenAI {
				path, body = openAIPath, oai
			}
			if r := post(t, ts, path, body, ""); r.status != http.StatusOK {
				t.Fatalf("first request: status %d: %s", r.status, r.body)
			}
			start := time.Now()
			r := post(t, ts, path, body, "")
			if r.status != http.StatusTooManyRequests {
				t.Fatalf("second request: status %d: %s", r.status, r.body)
			}
			if r.elapsed > time.Second {
				t.Errorf("refused after %v: a refusal should not wait", r.elapsed)
			}
			// The wait is c.retry seconds less the time since the first
			// admission, rounded up.
			retry, err := strconv.Atoi(r.header.Get("Retry-After"))
			if err != nil || retry > c.retry || retry < c.retry-1-int(time.Since(start)/time.Second) {
				t.Errorf("Retry-After %q, want %d", r.header.Get("Retry-After"), c.retry)
			}
			wantHeader(t, r.header, "Content-Type", "application/json")
			if c.kind == llmfake.Anthropic {
				wantHeader(t, r.header, "x-should-retry", "true")
				var e antError
				decodeStrict(t, r.body, &e)
				if e.Type != "error" || e.Error.Type != "rate_limit_error" || e.Error.Message == "" {
					t.Errorf("error = %+v", e)
				}
				if c.meter != "requests" {
					wantHeader(t, r.header, "anthropic-ratelimit-requests-remaining", "4")
				}
			} else {
				var e oaiError
				decodeStrict(t, r.body, &e)
				if e.Error.Type != c.meter || e.Error.Code == nil || *e.Error.Code != "rate_limit_exceeded" || e.Error.Message == "" {
					t.Errorf("error = %+v", e)
				}
				if c.meter != "requests" {
					wantHeader(t, r.header, "x-ratelimit-remaining-requests", "4")
				}
			}
			if got := s.Refused(); got != 1 {
				t.Errorf("Refused = %d, want 1", got)
			}
			if got := s.RefusedBy(); len(got) != 1 || got[c.meter] != 1 {
				t.Errorf("RefusedBy = %v, want %s: 1", got, c.meter)
			}
			onlyRecord(t, s)
		})
	}
}

func TestAnthropicGiveBack(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run("stream="+strconv.FormatBool(stream), func(t *testing.T) {
			// The first request takes all 100 output tokens and uses 10;
			// the next needs 50 of the 90 given back at its end. The
			// refill adds 1 a second, negligible here.
			s := &llmfake.Server{
				Kind:    llmfake.Anthropic,
				Limits:  llmfake.Limits{OutputTokens: llmfake.Bucket{Rate: 1, Burst: 100}},
				Latency: 200 * time.Millisecond,
				Used:    func(int) int { return 10 },
			}
			ts := serve(t, s)
			firstDone := make(chan reply, 1)
			if stream {
				// A stream's headers come at admission.
				resp, start := send(t, context.Background(), ts, http.MethodPost, anthropicPath, anthropicRequest(100, true, "first"), "")
				defer resp.Body.Close()
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("first request: status %d", resp.StatusCode)
				}
				wantHeader(t, resp.Header, "anthropic-ratelimit-output-tokens-remaining", "0")
				go func() {
					b, _ := io.ReadAll(resp.Body)
					firstDone <- reply{resp.StatusCode, resp.Header, b, time.Since(start)}
				}()
			} else {
				go func() {
					r, err := exchange(context.Background(), ts, http.MethodPost, anthropicPath, anthropicRequest(100, false, "first"), "")
					if err != nil {
						t.Error(err)
					}
					firstDone <- r
				}()
				for deadline := time.Now().Add(5 * time.Second); len(s.Records()) == 0; time.Sleep(time.Millisecond) {
					if time.Now().After(deadline) {
						t.Fatal("the first request was not admitted")
					}
				}
			}

			r := post(t, ts, anthropicPath, anthropicRequest(50, false, "second"), "")
			if r.status != http.StatusTooManyRequests {
				t.Fatalf("second request, during the first: status %d: %s", r.status, r.body)
			}
			first := <-firstDone
			if first.status != http.StatusOK || first.elapsed < s.Latency {
				t.Fatalf("first request: status %d after %v", first.status, first.elapsed)
			}

			r = post(t, ts, anthropicPath, anthropicRequest(50, false, "third"), "")
			if r.status != http.StatusOK {
				t.Fatalf("third request, after the first: status %d: %s", r.status, r.body)
			}
			rem, err := strconv.Atoi(r.header.Get("anthropic-ratelimit-output-tokens-remaining"))
			if err != nil || rem < 40 || rem > 45 {
				t.Errorf("output tokens remaining %q, want about 40", r.header.Get("anthropic-ratelimit-output-tokens-remaining"))
			}
			if got := s.RefusedBy(); len(got) != 1 || got["output_tokens"] != 1 {
				t.Errorf("RefusedBy = %v", got)
			}
			if got := len(s.Records()); got != 2 {
				t.Errorf("%d records, want 2", got)
			}
		})
	}
}

func TestOpenAINeverGivesBack(t *testing.T) {
	body := openAIRequest("A question.", map[string]any{"max_tokens": 100})
	charge := inputOf(t, body) + 100
	// Room for two charges less one token; the first answer uses 1 token.
	s := &llmfake.Server{
		Kind:    llmfake.OpenAI,
		Limits:  llmfake.Limits{Tokens: llmfake.Bucket{Rate: 0.01, Burst: float64(2*charge - 1)}},
		Latency: 20 * time.Millisecond,
		Used:    func(int) int { return 1 },
	}
	ts := serve(t, s)
	r := post(t, ts, openAIPath, body, "")
	if r.status != http.StatusOK {
		t.Fatalf("first request: status %d: %s", r.status, r.body)
	}
	wantHeader(t, r.header, "x-ratelimit-remaining-tokens", strconv.Itoa(charge-1))
	time.Sleep(100 * time.Millisecond)
	r = post(t, ts, openAIPath, body, "")
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("second request, after the first: status %d: %s", r.status, r.body)
	}
	wantHeader(t, r.header, "x-ratelimit-remaining-tokens", strconv.Itoa(charge-1))
	if got := s.RefusedBy(); got["tokens"] != 1 {
		t.Errorf("RefusedBy = %v", got)
	}
	if rec := onlyRecord(t, s); rec.Charged != charge || rec.Output != 1 {
		t.Errorf("record = %+v, want charged %d", rec, charge)
	}
}

func TestClientGoesAway(t *testing.T) {
	baseline := runtime.NumGoroutine()
	s := &llmfake.Server{
		Kind:    llmfake.Anthropic,
		Limits:  llmfake.Limits{OutputTokens: llmfake.Bucket{Rate: 1, Burst: 100}},
		Latency: 2 * time.Second,
		Used:    func(int) int { return 10 },
	}
	returned := make(chan struct{}, 10)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		s.ServeHTTP(w, r)
		returned <- struct{}{}
	}))
	defer ts.Close()

	ctx, cancel := context.WithCancel(context.Background())
	resp, _ := send(t, ctx, ts, http.MethodPost, anthropicPath, anthropicRequest(100, true, "first"), "")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d", resp.StatusCode)
	}
	cancel()
	resp.Body.Close()
	admitted := onlyRecord(t, s).At
	select {
	case <-returned:
	case <-time.After(time.Second):
		t.Fatal("the handler did not return after the client went away")
	}
	if d := time.Since(admitted); d >= s.Latency {
		t.Fatalf("the handler returned %v after admission, not before the answer's end", d)
	}

	// The unused tokens come back at the planned end, not before.
	r := post(t, ts, anthropicPath, anthropicRequest(50, false, "second"), "")
	if r.status != http.StatusTooManyRequests {
		t.Fatalf("request before the planned end: status %d: %s", r.status, r.body)
	}
	time.Sleep(time.Until(admitted.Add(s.Latency + 300*time.Millisecond)))
	// A stream, whose status comes at admission; the client leaves at once.
	ctx, cancel = context.WithCancel(context.Background())
	resp, _ = send(t, ctx, ts, http.MethodPost, anthropicPath, anthropicRequest(50, true, "third"), "")
	cancel()
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("request after the planned end: status %d", resp.StatusCode)
	}

	// Nothing is left running once the server is closed.
	ts.Close()
	for deadline := time.Now().Add(3 * time.Second); runtime.NumGoroutine() > baseline; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			buf := make([]byte, 1<<16)
			t.Fatalf("%d goroutines, %d before:\n%s", runtime.NumGoroutine(), baseline, buf[:runtime.Stack(buf, true)])
		}
	}
}

func TestRecordsAndDefaultUsed(t *testing.T) {
	outputs := func() []int {
		s := &llmfake.Server{Kind: llmfake.Anthropic}
		ts := serve(t, s)
		const n = 300
		for i := range n {
			worker := "w" + strconv.Itoa(i%3)
			if r := post(t, ts, anthropicPath, anthropicRequest(1000, i%2 == 1, "x"), worker); r.status != http.StatusOK {
				t.Fatalf("request %d: status %d: %s", i, r.status, r.body)
			}
		}
		recs := s.Records()
		if len(recs) != n {
			t.Fatalf("%d records, want %d", len(recs), n)
		}
		var out []int
		sum := 0
		for i, rec := range recs {
			if i > 0 && rec.At.Before(recs[i-1].At) {
				t.Errorf("record %d admitted before record %d", i, i-1)
			}
			if rec.Worker != "w"+strconv.Itoa(i%3) || rec.Stream != (i%2 == 1) || rec.Max != 1000 || rec.Input != 4 || rec.Charged != 0 {
				t.Errorf("record %d = %+v", i, rec)
			}
			if rec.Output < 100 || rec.Output > 600 {
				t.Errorf("record %d used %d of 1000", i, rec.Output)
			}
			sum += rec.Output
			out = append(out, rec.Output)
		}
		if mean := float64(sum) / n; mean < 300 || mean > 400 {
			t.Errorf("mean output %.1f of 1000, want about 350", mean)
		}
		if got := s.Refused(); got != 0 {
			t.Errorf("Refused = %d", got)
		}
		if got := s.RefusedBy(); len(got) != 0 {
			t.Errorf("RefusedBy = %v", got)
		}
		return out
	}
	a, b := outputs(), outputs()
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("output %d differs between servers: %d, %d", i, a[i], b[i])
		}
	}

	// At least one token; Used's results are clamped to 0..max_tokens.
	for _, c := range []struct {
		used      func(int) int
		max, want int
	}{
		{nil, 1, 1},
		{func(int) int { return 5000 }, 100, 100},
		{func(int) int { return -3 }, 100, 0},
	} {
		s := &llmfake.Server{Kind: llmfake.OpenAI, Used: c.used}
		post(t, serve(t, s), openAIPath, openAIRequest("x", map[string]any{"max_tokens": c.max}), "")
		if rec := onlyRecord(t, s); rec.Output != c.want {
			t.Errorf("max %d: used %d, want %d", c.max, rec.Output, c.want)
		}
	}
}

func TestOpenAIMaxTokens(t *testing.T) {
	s := &llmfake.Server{Kind: llmfake.OpenAI}
	ts := serve(t, s)
	post(t, ts, openAIPath, openAIRequest("x", nil), "")
	post(t, ts, openAIPath, openAIRequest("x", map[string]any{"max_tokens": 77}), "")
	recs := s.Records()
	if len(recs) != 2 || recs[0].Max != 4096 || recs[0].Charged != 4+4096 || recs[1].Max != 77 || recs[1].Charged != 4+77 {
		t.Errorf("records = %+v", recs)
	}
}

func TestBadRequests(t *testing.T) {
	for _, c := range []struct {
		name   string
		kind   llmfake.Kind
		method string
		path   string
		body   any
		status int
	}{
		{"anthropic no max_tokens", llmfake.Anthropic, http.MethodPost, anthropicPath,
			map[string]any{"model": "m", "messages": []any{}}, http.StatusBadRequest},
		{"anthropic zero max_tokens", llmfake.Anthropic, http.MethodPost, anthropicPath, anthropicRequest(0, false, "x"), http.StatusBadRequest},
		{"anthropic not JSON", llmfake.Anthropic, http.MethodPost, anthropicPath, []byte("nope"), http.StatusBadRequest},
		{"anthropic GET", llmfake.Anthropic, http.MethodGet, anthropicPath, []byte{}, http.StatusMethodNotAllowed},
		{"anthropic wrong path", llmfake.Anthropic, http.MethodPost, openAIPath, anthropicRequest(10, false, "x"), http.StatusNotFound},
		{"openai not JSON", llmfake.OpenAI, http.MethodPost, openAIPath, []byte("{"), http.StatusBadRequest},
		{"openai wrong path", llmfake.OpenAI, http.MethodPost, anthropicPath, openAIRequest("x", nil), http.StatusNotFound},
	} {
		t.Run(c.name, func(t *testing.T) {
			s := &llmfake.Server{Kind: c.kind, Limits: llmfake.Limits{Requests: llmfake.Bucket{Rate: 1, Burst: 1}}}
			ts := serve(t, s)
			resp, _ := send(t, context.Background(), ts, c.method, c.path, c.body, "")
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			if err != nil {
				t.Fatal(err)
			}
			if resp.StatusCode != c.status {
				t.Fatalf("status %d, want %d: %s", resp.StatusCode, c.status, b)
			}
			if c.kind == llmfake.Anthropic {
				var e antError
				decodeStrict(t, b, &e)
				if e.Type != "error" || e.Error.Type == "" || e.Error.Message == "" {
					t.Errorf("error = %+v", e)
				}
			} else {
				var e oaiError
				decodeStrict(t, b, &e)
				if e.Error.Type == "" || e.Error.Message == "" {
					t.Errorf("error = %+v", e)
				}
			}
			if len(s.Records()) != 0 || s.Refused() != 0 {
				t.Errorf("records %v, refused %d", s.Records(), s.Refused())
			}
		})
	}
}

func TestConcurrentRate(t *testing.T) {
	s := &llmfake.Server{
		Kind:    llmfake.Anthropic,
		Limits:  llmfake.Limits{Requests: llmfake.Bucket{Rate: 50, Burst: 10}},
		Latency: 20 * time.Millisecond,
	}
	ts := serve(t, s)
	const workers, each = 8, 10
	var mu sync.Mutex
	statuses := map[int]int{}
	var wg sync.WaitGroup
	start := time.Now()
	for w := range workers {
		wg.Go(func() {
			for i := range each {
				r, err := exchange(context.Background(), ts, http.MethodPost, anthropicPath, anthropicRequest(10, i%2 == 0, "x"), "w"+strconv.Itoa(w))
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				statuses[r.status]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	ok, refused := statuses[http.StatusOK], statuses[http.StatusTooManyRequests]
	if ok+refused != workers*each {
		t.Fatalf("statuses %v", statuses)
	}
	recs := s.Records()
	if len(recs) != ok || s.Refused() != refused || s.RefusedBy()["requests"] != refused {
		t.Errorf("%d records, %d refused, by %v; answered %v", len(recs), s.Refused(), s.RefusedBy(), statuses)
	}
	// The burst plus the refill over the test's time.
	if most := 10 + 50*elapsed.Seconds() + 1; float64(ok) > most {
		t.Errorf("%d admitted in %v, at most %.0f allowed", ok, elapsed, most)
	}
}
