// Command llm sends a message to Anthropic's, OpenAI's or Gemini's API, an
// Azure OpenAI deployment or Amazon Bedrock (cloud.go) through the
// provider's official Go SDK, whole and streamed, with a quota Transport
// as the SDK's HTTP client: every process that runs it against the same
// Redis shares the organization's limits on requests and tokens. A request
// reserves its estimated input tokens and its max_tokens; the Transport
// reads the usage from the answer as the SDK reads it, and settles the
// reservation with it. (Gemini counts the input tokens alone: its
// requests reserve no output.) With Redis on 127.0.0.1:6379 and the API
// key in ANTHROPIC_API_KEY, OPENAI_API_KEY or GEMINI_API_KEY:
//
//	go run . -provider anthropic
//	go run . -provider openai -redis 10.0.0.5:6379
//	go run . -provider gemini
//
// -base-url points the SDK at another server, such as a local fake of the
// API (for the OpenAI SDK, a URL ending in /v1/).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"os/signal"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go/v3"
	ooption "github.com/openai/openai-go/v3/option"
	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/llm"
)

// config is what the example is pointed at.
type config struct {
	Provider string // "anthropic", "openai", "gemini", "azure" or "bedrock"
	Redis    string // host:port of the Redis that holds the buckets
	BaseURL  string // the API's base URL; empty: the SDK's default
	Prompt   string // the message sent
}

// maxTokens bounds each answer, and is what a request reserves of the
// output tokens until its answer tells its usage.
const maxTokens = 1024

func main() {
	var cfg config
	flag.StringVar(&cfg.Provider, "provider", "anthropic", "the API: `anthropic`, openai, gemini, azure or bedrock")
	flag.StringVar(&cfg.Redis, "redis", "127.0.0.1:6379", "`host:port` of Redis")
	flag.StringVar(&cfg.BaseURL, "base-url", "", "the API's base `URL` (default the SDK's)")
	flag.StringVar(&cfg.Prompt, "prompt", "Say hello in five words.", "the `message` to send")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// run asks cfg.Provider's API cfg.Prompt twice and prints the answers.
func run(ctx context.Context, cfg config, out io.Writer) (err error) {
	rdb := redis.NewClient(quota.RedisOptions(cfg.Redis))
	defer rdb.Close()
	// The organization's limits, as the provider's console shows them:
	// every process that shares them must give the same.
	var tr *quota.Transport
	ask := askAnthropic
	switch cfg.Provider {
	case "anthropic":
		tr = quota.NewTransport(rdb, quota.PerMinute(50), quota.WithMetering(llm.Anthropic(llm.AnthropicLimits{
			InputTokens:  llm.PerMinute(40000),
			OutputTokens: llm.PerMinute(8000),
		})))
	case "openai":
		tr = quota.NewTransport(rdb, quota.PerMinute(500), quota.WithMetering(llm.OpenAI(llm.OpenAILimits{
			Tokens: llm.PerMinute(30000),
		})))
		ask = askOpenAI
	case "gemini":
		tr = quota.NewTransport(rdb, quota.PerMinute(150), quota.WithMetering(llm.Gemini(llm.GeminiLimits{
			InputTokens: llm.PerMinute(1000000),
		})))
		ask = askGemini
	case "azure": // see cloud.go
		tr, ask = azureTransport(rdb), askAzure
	case "bedrock":
		tr, ask = bedrockTransport(rdb), askBedrock
	default:
		return fmt.Errorf("unknown provider %q: want anthropic, openai, gemini, azure or bedrock", cfg.Provider)
	}
	// Settles run in the background; Flush waits for them.
	defer func() {
		fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		err = errors.Join(err, tr.Limiter().Flush(fctx))
	}()
	return ask(ctx, &http.Client{Transport: tr}, cfg, out)
}

func askAnthropic(ctx context.Context, hc *http.Client, cfg config, out io.Writer) error {
	opts := []aoption.RequestOption{aoption.WithHTTPClient(hc)}
	if cfg.BaseURL != "" {
		opts = append(opts, aoption.WithBaseURL(cfg.BaseURL))
	}
	client := anthropic.NewClient(opts...)
	params := anthropic.MessageNewParams{
		Model:     anthropic.ModelClaudeSonnet4_6,
		MaxTokens: maxTokens,
		Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock(cfg.Prompt))},
	}

	msg, err := client.Messages.New(ctx, params)
	if err != nil {
		return err
	}
	printMessage(out, "anthropic", msg)

	// A stream's usage arrives in its message_start and message_delta
	// events. Close it when done: a stream left open holds its reservation.
	stream := client.Messages.NewStreaming(ctx, params)
	defer stream.Close()
	var whole anthropic.Message
	for stream.Next() {
		if err := whole.Accumulate(stream.Current()); err != nil {
			return err
		}
	}
	if err := stream.Err(); err != nil {
		return err
	}
	printMessage(out, "anthropic stream", &whole)
	return nil
}

func printMessage(out io.Writer, label string, msg *anthropic.Message) {
	fmt.Fprintf(out, "%s: ", label)
	for _, block := range msg.Content {
		fmt.Fprint(out, block.Text)
	}
	fmt.Fprintf(out, " (%d input, %d output tokens)\n", msg.Usage.InputTokens, msg.Usage.OutputTokens)
}

func askOpenAI(ctx context.Context, hc *http.Client, cfg config, out io.Writer) error {
	opts := []ooption.RequestOption{ooption.WithHTTPClient(hc)}
	if cfg.BaseURL != "" {
		opts = append(opts, ooption.WithBaseURL(cfg.BaseURL))
	}
	client := openai.NewClient(opts...)
	params := openai.ChatCompletionNewParams{
		Model:               openai.ChatModelGPT5_5,
		MaxCompletionTokens: openai.Int(maxTokens),
		Messages:            []openai.ChatCompletionMessageParamUnion{openai.UserMessage(cfg.Prompt)},
	}

	return chat(ctx, client, params, "openai", out)
}

// chat sends params to client's chat completions, then again as a stream,
// and prints both answers under label. include_usage makes the stream's
// last chunk carry its usage, which the Transport settles the reservation
// with.
func chat(ctx context.Context, client openai.Client, params openai.ChatCompletionNewParams, label string, out io.Writer) error {
	resp, err := client.Chat.Completions.New(ctx, params)
	if err != nil {
		return err
	}
	printCompletion(out, label, resp)

	params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
	stream := client.Chat.Completions.NewStreaming(ctx, params)
	defer stream.Close()
	var whole openai.ChatCompletionAccumulator
	for stream.Next() {
		whole.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		return err
	}
	printCompletion(out, label+" stream", &whole.ChatCompletion)
	return nil
}

func printCompletion(out io.Writer, label string, c *openai.ChatCompletion) {
	fmt.Fprintf(out, "%s: ", label)
	for _, choice := range c.Choices {
		fmt.Fprint(out, choice.Message.Content)
	}
	fmt.Fprintf(out, " (%d tokens)\n", c.Usage.TotalTokens)
}
