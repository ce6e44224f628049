package quota_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
)

// postLLM posts a request of one message and maxTokens to url through
// client, and prints the status and the output tokens the answer used.
func postLLM(client *http.Client, url string, maxTokens int) {
	body, _ := json.Marshal(map[string]any{
		"model": "model-1", "max_tokens": maxTokens,
		"messages": []map[string]any{{"role": "user", "content": "How far is the Moon?"}},
	})
	resp, err := client.Post(url, "application/json", bytes.NewReader(body))
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct {
		Usage map[string]int `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.Status, "with", answer.Usage["output_tokens"]+answer.Usage["completion_tokens"], "output tokens used")
}

// Requests to Anthropic's Messages API reserve a request, their input
// tokens and their max_tokens of output, and are settled from the usage
// of the answer as the caller reads it.
func ExampleAnthropic() {
	redisServer := standInRedis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.Anthropic, Used: func(int) int { return 312 }}
	defer standInProvider(provider.ServeHTTP)()
	rdb := standInClient(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(50), // requests a minute
		quota.WithMetering(quota.Anthropic(quota.AnthropicLimits{
			InputTokens:  quota.PerMinute(40000),
			OutputTokens: quota.PerMinute(8000),
		})))
	client := &http.Client{Transport: tr} // an SDK's option.WithHTTPClient(client)
	// OpenAI: quota.OpenAI(quota.OpenAILimits{Tokens: quota.PerMinute(30000)})
	// end README

	postLLM(client, "https://api.anthropic.com/v1/messages", 1024)
	// The settle of the 712 output tokens the answer did not use goes
	// before the process exits.
	if err := tr.Limiter().Flush(context.Background()); err != nil {
		log.Fatal(err)
	}
	// Output: 200 OK with 312 output tokens used
}

// Requests to OpenAI reserve a request and their input and max_tokens of
// tokens, which OpenAI charges on arrival and does not give back.
func ExampleOpenAI() {
	redisServer := standInRedis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.OpenAI, Used: func(int) int { return 200 }}
	defer standInProvider(provider.ServeHTTP)()
	rdb := standInClient(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(500),
		quota.WithMetering(quota.OpenAI(quota.OpenAILimits{Tokens: quota.PerMinute(30000)})))
	client := &http.Client{Transport: tr}
	// end README

	postLLM(client, "https://api.openai.com/v1/chat/completions", 500)
	// Output: 200 OK with 200 output tokens used
}

// Work that is not an http.Request reserves its amount of each limit and
// settles with what it used.
func ExampleLimiter_Reserve() {
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := standInClient(redisServer)
	defer rdb.Close()
	l := quota.NewLimiter(rdb)
	ctx := context.Background()

	// README:
	meters := []quota.Meter{
		{Name: quota.MeterRequests, Limit: quota.PerMinute(50)},
		{Name: quota.MeterInputTokens, Limit: quota.Limit{Rate: 40000.0 / 60, Burst: 40000}},
		{Name: quota.MeterOutputTokens, Limit: quota.Limit{Rate: 8000.0 / 60, Burst: 8000}},
	}
	r, err := l.Reserve(ctx, "anthropic", meters, quota.Usage{
		quota.MeterRequests: 1, quota.MeterInputTokens: 1200, quota.MeterOutputTokens: 1024,
	})
	if err != nil {
		return // ctx ended first, or Redis is unavailable under FailClosed
	}
	// ... call the API ...
	r.Settle(quota.Usage{quota.MeterInputTokens: 1187, quota.MeterOutputTokens: 311})
	// end README

	if err := l.Flush(ctx); err != nil { // the settle, before the process exits
		log.Fatal(err)
	}
	fmt.Println("reserved", r.Reserved()[quota.MeterOutputTokens], "output tokens, settled with 311")
	// Output: reserved 1024 output tokens, settled with 311
}
