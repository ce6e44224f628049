package main

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/aws/aws-sdk-go-v2/aws"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime"
	"github.com/aws/aws-sdk-go-v2/service/bedrockruntime/types"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/azure"
	ooption "github.com/openai/openai-go/v3/option"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/llm"
)

// azure returns an OpenAI client of the fixture's provider, served over
// TLS (see azureServer), as an Azure OpenAI endpoint, which does not
// retry.
func (f *fixture) azure() openai.Client {
	return openai.NewClient(
		azure.WithEndpoint(f.url, azureAPIVersion),
		azure.WithAPIKey("test-key"),
		ooption.WithHTTPClient(&http.Client{Transport: f.read}),
		ooption.WithMaxRetries(0),
	)
}

// azureServer serves fake over TLS. The OpenAI SDK's Azure options send
// plain HTTP, allowed to loopback by azure.WithUnsafeAllowHTTP, through
// a transport of their own, past the client's Transport: through the
// quota Transport, Azure is reached over HTTPS, as it always is.
func azureServer(t *testing.T, fake *llmfake.Server) *httptest.Server {
	t.Helper()
	ts := httptest.NewTLSServer(fake)
	t.Cleanup(ts.Close)
	return ts
}

// bedrock returns a Bedrock runtime client of the fixture's provider,
// with static credentials, which does not retry.
func (f *fixture) bedrock() *bedrockruntime.Client {
	return bedrockruntime.New(bedrockruntime.Options{
		Region:       "us-east-1",
		BaseEndpoint: aws.String(f.url),
		HTTPClient:   &http.Client{Transport: f.read},
		Credentials: aws.CredentialsProviderFunc(func(context.Context) (aws.Credentials, error) {
			return aws.Credentials{AccessKeyID: "AKIDEXAMPLE", SecretAccessKey: "secret", Source: "test"}, nil
		}),
		Retryer: aws.NopRetryer{},
	})
}

// TestAzureSDK: a chat completion and a streamed one of the OpenAI SDK
// configured for Azure (its deployment path, api-version and api-key)
// reach it intact through the quota Transport, and it decodes their text
// and usage.
func TestAzureSDK(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.Azure, Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
	lim := llm.AzureLimits{TokensPerMinute: 30000}
	f := serveFixture(t, rdb, azureServer(t, fake), fake, lim.Requests(), llm.Azure(lim))
	client := f.azure()
	for i, stream := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		p := openAIParams(1000, stream)
		p.Model = azureDeployment
		var c *openai.ChatCompletion
		var err error
		if stream {
			s := client.Chat.Completions.NewStreaming(ctx, p)
			var acc openai.ChatCompletionAccumulator
			for s.Next() {
				acc.AddChunk(s.Current())
			}
			c, err = &acc.ChatCompletion, s.Err()
			s.Close()
		} else {
			c, err = client.Chat.Completions.New(ctx, p)
		}
		cancel()
		if err != nil {
			t.Fatalf("stream %v: %v", stream, err)
		}
		rec := fake.Records()[i]
		var text string
		if len(c.Choices) > 0 {
			text = c.Choices[0].Message.Content
		}
		if text != fakeAnswer || c.Usage.PromptTokens != int64(rec.Input) || c.Usage.CompletionTokens != used || rec.Stream != stream {
			t.Errorf("stream %v: the SDK decoded %q, %d prompt, %d completion tokens; want %q, %d and %d",
				stream, text, c.Usage.PromptTokens, c.Usage.CompletionTokens, fakeAnswer, rec.Input, used)
		}
	}
	f.checkBodies(t, 2)
}

// TestAzureRetryAfterMs: a Transport that allows far more than the
// deployment sends a request Azure refuses, with retry-after: 1 and
// retry-after-ms of about 500; the pause it puts on the bucket is the
// milliseconds', not the second's: the next request goes about 0.5 s
// later, and is admitted.
func TestAzureRetryAfterMs(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.Azure, Latency: 10 * time.Millisecond, Used: func(int) int { return used },
		Limits: llmfake.Limits{Tokens: llmfake.Bucket{Rate: 1000, Burst: 1500}}}
	lim := llm.AzureLimits{TokensPerMinute: 6e6}
	f := serveFixture(t, rdb, azureServer(t, fake), fake, lim.Requests(), llm.Azure(lim))
	client := f.azure()
	call := func(maxTokens int64) error {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		p := openAIParams(maxTokens, false)
		p.Model = azureDeployment
		_, err := client.Chat.Completions.New(ctx, p)
		return err
	}
	if err := call(1000); err != nil {
		t.Fatal(err)
	}
	err := call(1000)
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) || apiErr.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("the second request: %v, want a 429", err)
	}
	ms := apiErr.Response.Header.Get("retry-after-ms")
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := f.tr.Limiter().Flush(ctx); err != nil { // the pause is in Redis
		t.Fatal(err)
	}
	start := time.Now()
	if err := call(100); err != nil {
		t.Fatalf("the request after the pause: %v", err)
	}
	// retry-after-ms is about 500: the pause is over well before the
	// whole second of retry-after.
	elapsed := time.Since(start)
	if elapsed < 300*time.Millisecond || elapsed > 900*time.Millisecond {
		t.Errorf("the next request went %v after the 429 (retry-after-ms %s, retry-after %s), want about 0.5 s",
			elapsed, ms, apiErr.Response.Header.Get("retry-after"))
	}
	t.Logf("retry-after-ms %s, retry-after %s: the next request went %v later", ms, apiErr.Response.Header.Get("retry-after"), elapsed.Round(time.Millisecond))
	if n := fake.Refused(); n != 1 {
		t.Errorf("the deployment refused %d requests, want the one", n)
	}
}

// bedrockCall sends one Converse or ConverseStream request of the
// model and returns the text and usage the SDK decoded.
func bedrockCall(ctx context.Context, client *bedrockruntime.Client, maxTokens int32, stream bool) (string, *types.TokenUsage, error) {
	in, streamIn := converseInput("anthropic.claude-sonnet-4-20250514-v1:0", "Say hello.", maxTokens)
	var text string
	if !stream {
		resp, err := client.Converse(ctx, in)
		if err != nil {
			return "", nil, err
		}
		if m, ok := resp.Output.(*types.ConverseOutputMemberMessage); ok {
			for _, b := range m.Value.Content {
				if t, ok := b.(*types.ContentBlockMemberText); ok {
					text += t.Value
				}
			}
		}
		return text, resp.Usage, nil
	}
	resp, err := client.ConverseStream(ctx, streamIn)
	if err != nil {
		return "", nil, err
	}
	s := resp.GetStream()
	defer s.Close()
	var u *types.TokenUsage
	for ev := range s.Events() {
		switch e := ev.(type) {
		case *types.ConverseStreamOutputMemberContentBlockDelta:
			if t, ok := e.Value.Delta.(*types.ContentBlockDeltaMemberText); ok {
				text += t.Value
			}
		case *types.ConverseStreamOutputMemberMetadata:
			u = e.Value.Usage
		}
	}
	return text, u, s.Err()
}

// TestBedrockSDK: Converse and ConverseStream of the AWS SDK, signed with
// static credentials, reach it intact through the quota Transport, and it
// decodes their text and usage, the stream's from the fake's AWS
// event-stream messages.
func TestBedrockSDK(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	fake := &llmfake.Server{Kind: llmfake.Bedrock, Latency: 20 * time.Millisecond, Used: func(int) int { return used }}
	f := newFixture(t, rdb, fake, quota.PerSecond(100), llm.Bedrock(llm.BedrockLimits{Tokens: llm.PerMinute(200000)}))
	client := f.bedrock()
	for i, stream := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		text, u, err := bedrockCall(ctx, client, 1000, stream)
		cancel()
		if err != nil {
			t.Fatalf("stream %v: %v", stream, err)
		}
		rec := fake.Records()[i]
		if text != fakeAnswer || u == nil || aws.ToInt32(u.InputTokens) != int32(rec.Input) || aws.ToInt32(u.OutputTokens) != used || rec.Stream != stream {
			t.Errorf("stream %v: the SDK decoded %q, usage %+v; want %q, %d and %d", stream, text, u, fakeAnswer, rec.Input, used)
		}
	}
	f.checkBodies(t, 2)
}

// TestBedrockSettles: each request reserves its maxTokens, 1,000, times
// the burndown of 5, of a bucket of 7,000 tokens that refills 10 a
// second, and uses 42 (210 of the quota). Without a settle the second
// request would wait minutes; with the settles from Converse's body and
// from ConverseStream's metadata, six requests in a row go at once, and
// the provider, which meters alike, refuses none. The controls: never
// settled, the second request fails at once for its deadline; sent at
// once without the Transport, the AWS SDK meets Bedrock's
// ThrottlingException.
func TestBedrockSettles(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	const maxTokens, requests = 1000, 6
	newFake := func() *llmfake.Server {
		return &llmfake.Server{Kind: llmfake.Bedrock, Latency: 20 * time.Millisecond, Used: func(int) int { return used },
			Limits: llmfake.Limits{Tokens: llmfake.Bucket{Rate: 10, Burst: 7000}, OutputBurndown: 5}}
	}
	for _, stream := range []bool{false, true} {
		fake := newFake()
		f := newFixture(t, rdb, fake, quota.PerSecond(100), llm.Bedrock(llm.BedrockLimits{
			Tokens: quota.Limit{Rate: 10, Burst: 7000}, OutputBurndown: func(string) float64 { return 5 },
		}))
		client := f.bedrock()
		start := time.Now()
		for i := range requests {
			// A deadline past the wait for a whole reservation: a request
			// may reach the bucket before the settle of the one before it
			// (the AWS SDK returns as soon as it has closed the body), and
			// then queues until that settle gives the tokens back.
			ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
			_, _, err := bedrockCall(ctx, client, maxTokens, stream)
			cancel()
			if err != nil {
				t.Fatalf("stream %v: request %d of %d: %v", stream, i+1, requests, err)
			}
		}
		if elapsed := time.Since(start); elapsed > 5*time.Second {
			t.Errorf("stream %v: %d requests took %v, want them at once: each unsettled reservation takes 8 minutes to refill", stream, requests, elapsed)
		}
		if n := fake.Refused(); n > 0 {
			t.Errorf("stream %v: the provider refused %d requests", stream, n)
		}
	}

	// Never settled, the second request would wait 5 minutes.
	unsettled := llm.Bedrock(llm.BedrockLimits{Tokens: quota.Limit{Rate: 10, Burst: 7000}, OutputBurndown: func(string) float64 { return 5 }})
	unsettled.Usage = nil
	client := newFixture(t, rdb, newFake(), quota.PerSecond(100), unsettled).bedrock()
	var err error
	for range 2 {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		_, _, err = bedrockCall(ctx, client, maxTokens, false)
		cancel()
	}
	if !errors.Is(err, quota.ErrWouldExceedDeadline) {
		t.Errorf("never settled, the second request: %v, want quota.ErrWouldExceedDeadline: the control does not show what a settle gives back", err)
	}

	bare := newFake()
	ts := httptest.NewServer(bare)
	defer ts.Close()
	direct := (&fixture{url: ts.URL, read: &recorder{rt: http.DefaultTransport}}).bedrock()
	errs := make(chan error, requests)
	for range requests { // at once: one at a time, each answer gives back before the next
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			_, _, err := bedrockCall(ctx, direct, maxTokens, false)
			errs <- err
		}()
	}
	var throttled *types.ThrottlingException
	for range requests {
		var e *types.ThrottlingException
		if errors.As(<-errs, &e) {
			throttled = e
		}
	}
	if throttled == nil || !strings.Contains(throttled.ErrorMessage(), "Too many tokens") {
		t.Errorf("without the quota Transport the SDK met no ThrottlingException (%v): the limits do not bind, and the test shows nothing", throttled)
	}
}
