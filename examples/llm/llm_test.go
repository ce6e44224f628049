package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	ooption "github.com/openai/openai-go/v3/option"
	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/llm"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }

// fakeAnswer is the text of every answer of the fake provider.
const fakeAnswer = "Hello from the fake server."

// used is the output tokens every answer of the fake provider reports.
const used = 42

// callTimeout bounds each SDK call: a wait for tokens that would end later
// fails at once with quota.ErrWouldExceedDeadline.
const callTimeout = 10 * time.Second

// recorder is a RoundTripper that keeps the bytes of every response body
// read through it, in the order the requests were sent.
type recorder struct {
	rt     http.RoundTripper
	mu     sync.Mutex
	bodies []*bytes.Buffer
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.rt.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	buf := &bytes.Buffer{}
	r.bodies = append(r.bodies, buf)
	r.mu.Unlock()
	resp.Body = &tap{ReadCloser: resp.Body, mu: &r.mu, buf: buf}
	return resp, nil
}

// Bodies returns what was read of each response body so far.
func (r *recorder) Bodies() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.bodies))
	for i, b := range r.bodies {
		out[i] = b.String()
	}
	return out
}

// tap is a response body that copies what is read of it into buf.
type tap struct {
	io.ReadCloser
	mu  *sync.Mutex
	buf *bytes.Buffer
}

func (t *tap) Read(p []byte) (int, error) {
	n, err := t.ReadCloser.Read(p)
	t.mu.Lock()
	t.buf.Write(p[:n])
	t.mu.Unlock()
	return n, err
}

// fixture is a fake provider served on loopback and a quota Transport in
// front of it, with the response bodies as the provider sent them (wire,
// under the Transport) and as the SDK read them (read, above it).
type fixture struct {
	fake       *llmfake.Server
	url        string
	tr         *quota.Transport
	wire, read *recorder
}

func newFixture(t *testing.T, rdb *redis.Client, fake *llmfake.Server, requests quota.Limit, m quota.Metering) *fixture {
	t.Helper()
	return serveFixture(t, rdb, httptest.NewServer(fake), fake, requests, m)
}

// serveFixture is newFixture with fake served by ts, over HTTP or TLS.
func serveFixture(t *testing.T, rdb *redis.Client, ts *httptest.Server, fake *llmfake.Server, requests quota.Limit, m quota.Metering) *fixture {
	t.Helper()
	t.Cleanup(ts.Close)
	base := ts.Client().Transport.(*http.Transport).Clone() // trusts ts's certificate, if it has one
	t.Cleanup(base.CloseIdleConnections)
	f := &fixture{fake: fake, url: ts.URL, wire: &recorder{rt: base}}
	f.tr = quota.NewTransport(rdb, requests, quota.WithMetering(m), quota.WithBase(f.wire))
	f.read = &recorder{rt: f.tr}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := f.tr.Limiter().Flush(ctx); err != nil {
			t.Errorf("Flush: %v", err)
		}
	})
	return f
}

// anthropic returns an Anthropic client of the fixture's provider, which
// does not retry: a 429 fails the call.
func (f *fixture) anthropic() anthropic.Client {
	return anthropic.NewClient(
		aoption.WithHTTPClient(&http.Client{Transport: f.read}),
		aoption.WithBaseURL(f.url),
		aoption.WithAPIKey("test-key"),
		aoption.WithMaxRetries(0),
	)
}

// openai returns an OpenAI client of the fixture's provider, which does
// not retry.
func (f *fixture) openai() openai.Client {
	return openai.NewClient(
		ooption.WithHTTPClient(&http.Client{Transport: f.read}),
		ooption.WithBaseURL(f.url+"/v1/"),
		ooption.WithAPIKey("test-key"),
		ooption.WithMaxRetries(0),
	)
}

// checkBodies fails t unless the SDK read every response body byte for
// byte as the provider sent it.
func (f *fixture) checkBodies(t *testing.T, want int) {
	t.Helper()
	wire, read := f.wire.Bodies(), f.read.Bodies()
	if len(wire) != want || len(read) != want {
		t.Fatalf("%d responses from the provider, %d to the SDK, want %d", len(wire), len(read), want)
	}
	for i := range wire {
		if wire[i] != read[i] {
			t.Errorf("response %d: the SDK read %d bytes:\n%s\nthe provider sent %d:\n%s", i, len(read[i]), read[i], len(wire[i]), wire[i])
		}
	}
}

func anthropicParams(maxTokens int64) anthropic.MessageNewParams {
	return anthropic.MessageNewParams{
		Model:     anthropic.ModelClaudeSonnet4_6,
		MaxTokens: maxTokens,
		Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Say hello."))},
	}
}

// anthropicCall sends one message, streamed or not, and returns the
// answer as the SDK decoded it.
func anthropicCall(ctx context.Context, client anthropic.Client, maxTokens int64, stream bool) (*anthropic.Message, error) {
	if !stream {
		return client.Messages.New(ctx, anthropicParams(maxTokens))
	}
	s := client.Messages.NewStreaming(ctx, anthropicParams(maxTokens))
	defer s.Close()
	var msg anthropic.Message
	for s.Next() {
		if err := msg.Accumulate(s.Current()); err != nil {
			return nil, err
		}
	}
	return &msg, s.Err()
}

func openAIParams(maxTokens int64, stream bool) openai.ChatCompletionNewParams {
	p := openai.ChatCompletionNewParams{
		Model:               openai.ChatModelGPT5_5,
		MaxCompletionTokens: openai.Int(maxTokens),
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Say hello.")},
	}
	if stream {
		p.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	}
	return p
}

// openAICall sends one chat completion, streamed or not, and returns the
// answer as the SDK decoded it.
func openAICall(ctx context.Context, client openai.Client, maxTokens int64, stream bool) (*openai.ChatCompletion, error) {
	if !stream {
		return client.Chat.Completions.New(ctx, openAIParams(maxTokens, false))
	}
	s := client.Chat.Completions.NewStreaming(ctx, openAIParams(maxTokens, true))
	defer s.Close()
	var acc openai.ChatCompletionAccumulator
	for s.Next() {
		acc.AddChunk(s.Current())
	}
	return &acc.ChatCompletion, s.Err()
}

// TestAnthropicSDK: a message and a streamed message through the quota
// Transport reach the Anthropic SDK intact, and it decodes their text and
// usage.
func TestAnthropicSDK(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.Anthropic, Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
	f := newFixture(t, rdb, fake, quota.PerSecond(100),
		llm.Anthropic(llm.AnthropicLimits{InputTokens: llm.PerMinute(40000), OutputTokens: llm.PerMinute(8000)}))
	client := f.anthropic()
	for i, stream := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		msg, err := anthropicCall(ctx, client, 1000, stream)
		cancel()
		if err != nil {
			t.Fatalf("stream %v: %v", stream, err)
		}
		rec := fake.Records()[i]
		var text string
		for _, b := range msg.Content {
			text += b.Text
		}
		if text != fakeAnswer || msg.Usage.InputTokens != int64(rec.Input) || msg.Usage.OutputTokens != used || rec.Stream != stream {
			t.Errorf("stream %v: the SDK decoded %q, %d input and %d output tokens; want %q, %d and %d",
				stream, text, msg.Usage.InputTokens, msg.Usage.OutputTokens, fakeAnswer, rec.Input, used)
		}
		if !stream && msg.RawJSON() != f.wire.Bodies()[i] {
			t.Errorf("the SDK decoded %s, the provider sent %s", msg.RawJSON(), f.wire.Bodies()[i])
		}
	}
	f.checkBodies(t, 2)
	if b := f.read.Bodies()[1]; !strings.HasSuffix(b, "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n") {
		t.Errorf("the stream the SDK read does not end with message_stop:\n%s", b)
	}
}

// TestAnthropicSettles: each request reserves its max_tokens, 800, of a
// bucket of 2,000 output tokens that refills 10 a second, and uses 42.
// Without a settle the third request would wait 40 s; with the settles
// from the body and from the stream, six requests in a row go at once,
// and the provider, which meters alike, refuses none. A Transport that
// never settles is held at the third.
func TestAnthropicSettles(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	const maxTokens, requests = 800, 6
	run := func(t *testing.T, stream, settle bool) (sent int, err error) {
		fake := &llmfake.Server{
			Kind:    llmfake.Anthropic,
			Limits:  llmfake.Limits{OutputTokens: llmfake.Bucket{Rate: 10, Burst: 2000}},
			Latency: 20 * time.Millisecond,
			Used:    func(int) int { return used },
		}
		m := llm.Anthropic(llm.AnthropicLimits{InputTokens: llm.PerMinute(600000), OutputTokens: quota.Limit{Rate: 10, Burst: 2000}})
		if !settle {
			m.Usage = nil
		}
		f := newFixture(t, rdb, fake, quota.PerSecond(100), m)
		client := f.anthropic()
		for sent < requests {
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			_, err = anthropicCall(ctx, client, maxTokens, stream)
			cancel()
			if err != nil {
				break
			}
			sent++
		}
		if n := fake.Refused(); n > 0 {
			t.Errorf("the provider refused %d requests with 429 (%v)", n, fake.RefusedBy())
		}
		if n := len(fake.Records()); n != sent {
			t.Errorf("the provider admitted %d requests, the SDK saw %d answers", n, sent)
		}
		return sent, err
	}
	for _, stream := range []bool{false, true} {
		name := map[bool]string{false: "body", true: "stream"}[stream]
		t.Run(name, func(t *testing.T) {
			if sent, err := run(t, stream, true); err != nil {
				t.Errorf("request %d of %d: %v", sent+1, requests, err)
			}
		})
	}
	t.Run("never settled", func(t *testing.T) {
		sent, err := run(t, false, false)
		if !errors.Is(err, quota.ErrWouldExceedDeadline) {
			t.Fatalf("%d requests sent, then %v; want quota.ErrWouldExceedDeadline: the control does not show what a settle gives back", sent, err)
		}
		t.Logf("without settles: %d requests, then %v", sent, err)
	})
}

// TestOpenAISDK: a chat completion and a streamed one through the quota
// Transport reach the OpenAI SDK intact, and it decodes their text and
// usage.
func TestOpenAISDK(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.OpenAI, Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
	f := newFixture(t, rdb, fake, quota.PerSecond(100), llm.OpenAI(llm.OpenAILimits{Tokens: llm.PerMinute(30000)}))
	client := f.openai()
	for i, stream := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		c, err := openAICall(ctx, client, 1000, stream)
		cancel()
		if err != nil {
			t.Fatalf("stream %v: %v", stream, err)
		}
		rec := fake.Records()[i]
		var text string
		if len(c.Choices) > 0 {
			text = c.Choices[0].Message.Content
		}
		u := c.Usage
		if text != fakeAnswer || u.PromptTokens != int64(rec.Input) || u.CompletionTokens != used || u.TotalTokens != int64(rec.Input+used) || rec.Stream != stream {
			t.Errorf("stream %v: the SDK decoded %q, %d prompt, %d completion, %d total tokens; want %q, %d, %d and %d",
				stream, text, u.PromptTokens, u.CompletionTokens, u.TotalTokens, fakeAnswer, rec.Input, used, rec.Input+used)
		}
		if !stream && c.RawJSON() != f.wire.Bodies()[i] {
			t.Errorf("the SDK decoded %s, the provider sent %s", c.RawJSON(), f.wire.Bodies()[i])
		}
	}
	f.checkBodies(t, 2)
	if b := f.read.Bodies()[1]; !strings.HasSuffix(b, "data: [DONE]\n\n") {
		t.Errorf("the stream the SDK read does not end with [DONE]:\n%s", b)
	}
}

// TestOpenAIWaits: each request takes its input and max_completion_tokens,
// 400, from a bucket of 1,000 tokens that refills 500 a second, and OpenAI
// gives none back. Five requests in a row through the quota Transport,
// answered whole and streamed in turn, wait for their tokens and the
// provider refuses none; sent without it, the provider refuses some.
func TestOpenAIWaits(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	const maxTokens, requests, rate, burst = 400, 5, 500, 1000
	newFake := func() *llmfake.Server {
		return &llmfake.Server{
			Kind:    llmfake.OpenAI,
			Limits:  llmfake.Limits{Tokens: llmfake.Bucket{Rate: rate, Burst: burst}},
			Latency: 20 * time.Millisecond,
			Used:    func(int) int { return used },
		}
	}
	fake := newFake()
	f := newFixture(t, rdb, fake, quota.PerSecond(100), llm.OpenAI(llm.OpenAILimits{Tokens: quota.Limit{Rate: rate, Burst: burst}}))
	client := f.openai()
	start := time.Now()
	for i := range requests {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		_, err := openAICall(ctx, client, maxTokens, i%2 == 1)
		cancel()
		if err != nil {
			t.Fatalf("request %d of %d: %v", i+1, requests, err)
		}
	}
	elapsed := time.Since(start)
	if n := fake.Refused(); n > 0 {
		t.Errorf("the provider refused %d requests with 429 (%v)", n, fake.RefusedBy())
	}
	recs := fake.Records()
	charged := 0
	for _, r := range recs {
		charged += r.Charged
	}
	// The Transport reserves at least what the provider charges: the
	// requests beyond the burst waited for the refill.
	least := time.Duration(float64(charged-burst) / rate * float64(time.Second))
	if len(recs) != requests || elapsed < least*9/10 {
		t.Errorf("%d requests admitted in %v, want %d in %v or more (%d tokens charged)", len(recs), elapsed, requests, least, charged)
	}
	t.Logf("%d requests, %d tokens charged, in %v (the refill alone takes %v)", len(recs), charged, elapsed.Round(time.Millisecond), least.Round(time.Millisecond))

	// The control: the same requests without the quota Transport.
	bare := newFake()
	ts := httptest.NewServer(bare)
	defer ts.Close()
	direct := openai.NewClient(ooption.WithBaseURL(ts.URL+"/v1/"), ooption.WithAPIKey("test-key"), ooption.WithMaxRetries(0))
	for i := range requests {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		_, _ = openAICall(ctx, direct, maxTokens, i%2 == 1)
		cancel()
	}
	if bare.Refused() == 0 {
		t.Errorf("without the quota Transport the provider refused nothing: the limits do not bind, and the test shows nothing")
	}
}

// TestRun runs the example against a fake of each provider.
func TestRun(t *testing.T) {
	srv := redistest.Start(t)
	t.Setenv("ANTHROPIC_API_KEY", "test-key")
	t.Setenv("OPENAI_API_KEY", "test-key")
	t.Setenv("GEMINI_API_KEY", "test-key")
	t.Setenv("AZURE_OPENAI_API_KEY", "test-key")
	t.Setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
	t.Setenv("AWS_SECRET_ACCESS_KEY", "secret")
	for _, tc := range []struct {
		provider string
		kind     llmfake.Kind
		path     string
	}{
		{"anthropic", llmfake.Anthropic, ""},
		{"openai", llmfake.OpenAI, "/v1/"},
		{"gemini", llmfake.Gemini, ""},
		{"azure", llmfake.Azure, ""},
		{"bedrock", llmfake.Bedrock, ""},
	} {
		fake := &llmfake.Server{Kind: tc.kind, Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
		ts := httptest.NewServer(fake)
		restore := func() {}
		if tc.kind == llmfake.Azure { // over TLS: see azureServer
			ts.Close()
			ts = azureServer(t, fake)
			old := http.DefaultTransport
			http.DefaultTransport, restore = ts.Client().Transport, func() { http.DefaultTransport = old }
		}
		var out bytes.Buffer
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		err := run(ctx, config{Provider: tc.provider, Redis: srv.Addr(), BaseURL: ts.URL + tc.path, Prompt: "Say hello."}, &out)
		cancel()
		restore()
		ts.Close()
		if err != nil {
			t.Fatalf("%s: %v", tc.provider, err)
		}
		if n := strings.Count(out.String(), fakeAnswer); n != 2 || len(fake.Records()) != 2 {
			t.Errorf("%s: %d requests, printed:\n%s\nwant two answers %q", tc.provider, len(fake.Records()), out.String(), fakeAnswer)
		}
		t.Logf("%s:\n%s", tc.provider, out.String())
	}
}
