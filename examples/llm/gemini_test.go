package main

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/genai"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/llm"
)

// gemini returns a Gemini client of the fixture's provider, which does not
// retry.
func (f *fixture) gemini(t *testing.T) *genai.Client {
	t.Helper()
	t.Setenv("GEMINI_API_KEY", "test-key")
	c, err := geminiClient(context.Background(), &http.Client{Transport: f.read}, f.url)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// geminiCall asks one question, streamed or not, and returns the text and
// the last usage the SDK decoded.
func geminiCall(ctx context.Context, c *genai.Client, maxTokens int32, stream bool) (string, *genai.GenerateContentResponseUsageMetadata, error) {
	gc := &genai.GenerateContentConfig{MaxOutputTokens: maxTokens}
	if !stream {
		resp, err := c.Models.GenerateContent(ctx, geminiModel, genai.Text("Say hello."), gc)
		if err != nil {
			return "", nil, err
		}
		return resp.Text(), resp.UsageMetadata, nil
	}
	var text string
	var u *genai.GenerateContentResponseUsageMetadata
	for chunk, err := range c.Models.GenerateContentStream(ctx, geminiModel, genai.Text("Say hello."), gc) {
		if err != nil {
			return text, u, err
		}
		text += chunk.Text()
		u = chunk.UsageMetadata
	}
	return text, u, nil
}

// TestGeminiSDK: an answer and a streamed one (alt=sse) through the quota
// Transport reach Google's SDK intact, and it decodes their text and
// usage.
func TestGeminiSDK(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.Gemini, Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
	f := newFixture(t, rdb, fake, quota.PerSecond(100), llm.Gemini(llm.GeminiLimits{InputTokens: llm.PerMinute(1000000)}))
	client := f.gemini(t)
	for i, stream := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		text, u, err := geminiCall(ctx, client, 1000, stream)
		cancel()
		if err != nil {
			t.Fatalf("stream %v: %v", stream, err)
		}
		rec := fake.Records()[i]
		if text != fakeAnswer || u == nil || u.PromptTokenCount != int32(rec.Input) || u.CandidatesTokenCount != used || rec.Stream != stream || rec.Max != 1000 {
			t.Errorf("stream %v: the SDK decoded %q, usage %+v; want %q, %d input and %d output tokens", stream, text, u, fakeAnswer, rec.Input, used)
		}
	}
	f.checkBodies(t, 2)
	if b := f.read.Bodies()[1]; !strings.HasPrefix(b, "data: {") || !strings.Contains(b, `"finishReason":"STOP"`) {
		t.Errorf("the SDK read no alt=sse stream:\n%s", b)
	}
}

// TestGeminiSettles: each request reserves its estimated input, about 37
// tokens, of a bucket of 160 that refills 1 in 10 seconds, and Gemini
// counts 6. Without a settle the fifth request would wait minutes; with
// the settles from the body and from the stream, eight requests in a row
// go at once, and the provider, which meters alike, refuses none. A
// Transport that never settles is held at the fifth.
func TestGeminiSettles(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	const requests = 8
	run := func(t *testing.T, stream, settle bool) (sent int, err error) {
		input := quota.Limit{Rate: 0.1, Burst: 160}
		fake := &llmfake.Server{Kind: llmfake.Gemini, Limits: llmfake.Limits{InputTokens: llmfake.Bucket{Rate: 0.1, Burst: 160}},
			Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
		m := llm.Gemini(llm.GeminiLimits{InputTokens: input})
		if !settle {
			m.Usage = nil
		}
		f := newFixture(t, rdb, fake, quota.PerSecond(100), m)
		client := f.gemini(t)
		for sent < requests {
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			_, _, err = geminiCall(ctx, client, 800, stream)
			cancel()
			if err != nil {
				break
			}
			sent++
		}
		if n := fake.Refused(); n > 0 {
			t.Errorf("the provider refused %d requests with 429 (%v)", n, fake.RefusedBy())
		}
		return sent, err
	}
	for _, stream := range []bool{false, true} {
		t.Run(map[bool]string{false: "body", true: "stream"}[stream], func(t *testing.T) {
			if sent, err := run(t, stream, true); err != nil {
				t.Errorf("request %d of %d: %v", sent+1, requests, err)
			}
		})
	}
	t.Run("never settled", func(t *testing.T) {
		sent, err := run(t, false, false)
		if !errors.Is(err, quota.ErrWouldExceedDeadline) || sent > 4 {
			t.Fatalf("%d requests sent, then %v; want quota.ErrWouldExceedDeadline: the control does not show what a settle gives back", sent, err)
		}
	})
}

// TestGeminiRefusalPauses: the provider allows one request in 10 s, the
// Transport a hundred a second. The second request's 429 reaches the SDK
// whole, which decodes its RESOURCE_EXHAUSTED and RetryInfo; the
// RetryInfo paused the shared bucket, so the third waits, and fails at
// once within a 2 s deadline, unsent.
func TestGeminiRefusalPauses(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.Gemini, Limits: llmfake.Limits{Requests: llmfake.Bucket{Rate: 0.1, Burst: 1}},
		Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
	f := newFixture(t, rdb, fake, quota.PerSecond(100), llm.Gemini(llm.GeminiLimits{InputTokens: llm.PerMinute(1000000)}))
	client := f.gemini(t)
	ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
	defer cancel()
	if _, _, err := geminiCall(ctx, client, 100, false); err != nil {
		t.Fatal(err)
	}
	_, _, err := geminiCall(ctx, client, 100, false)
	var apiErr genai.APIError
	if !errors.As(err, &apiErr) || apiErr.Code != 429 || apiErr.Status != "RESOURCE_EXHAUSTED" {
		t.Fatalf("the second request: %v, want the SDK's APIError 429 RESOURCE_EXHAUSTED", err)
	}
	var delay any
	for _, d := range apiErr.Details {
		if d["@type"] == "type.googleapis.com/google.rpc.RetryInfo" {
			delay = d["retryDelay"]
		}
	}
	if delay != "10s" && delay != "9s" {
		t.Errorf("the SDK decoded the details %v, want a RetryInfo of 10s", apiErr.Details)
	}
	f.checkBodies(t, 2)
	if err := f.tr.Limiter().Flush(ctx); err != nil {
		t.Fatal(err)
	}
	short, cancelShort := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancelShort()
	start := time.Now()
	_, _, err = geminiCall(short, client, 100, false)
	if !errors.Is(err, quota.ErrWouldExceedDeadline) || time.Since(start) > time.Second || len(f.wire.Bodies()) != 2 {
		t.Errorf("the third request, after %v: %v, %d sent; want quota.ErrWouldExceedDeadline at once, unsent",
			time.Since(start).Round(time.Millisecond), err, len(f.wire.Bodies()))
	}
	if n := fake.Refused(); n != 1 {
		t.Errorf("the provider refused %d requests, want 1", n)
	}
}
