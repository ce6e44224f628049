package llm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/standin"
	"github.com/sharedquota/quota/llm"
)

// The examples run against stand-ins (internal/standin): a miniredis for
// the fleet's Redis, and a fake of the provider's API answering through
// http.DefaultTransport. The code between a "// README:" line and the
// next "// end README" line of an Example is a Go block of README.md or
// of a page under docs/ (see the root's readme_test.go).

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
	redisServer := standin.Redis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.Anthropic, Used: func(int) int { return 312 }}
	defer standin.Provider(provider.ServeHTTP)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(50), // requests a minute
		quota.WithMetering(llm.Anthropic(llm.AnthropicLimits{
			InputTokens:  llm.PerMinute(40000),
			OutputTokens: llm.PerMinute(8000),
		})))
	client := &http.Client{Transport: tr} // an SDK's option.WithHTTPClient(client)
	// OpenAI: llm.OpenAI(llm.OpenAILimits{Tokens: llm.PerMinute(30000)})
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
	redisServer := standin.Redis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.OpenAI, Used: func(int) int { return 200 }}
	defer standin.Provider(provider.ServeHTTP)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(500),
		quota.WithMetering(llm.OpenAI(llm.OpenAILimits{Tokens: llm.PerMinute(30000)})))
	client := &http.Client{Transport: tr}
	// end README

	postLLM(client, "https://api.openai.com/v1/chat/completions", 500)
	// Output: 200 OK with 200 output tokens used
}

// PerMinute holds a minute of tokens, as the APIs' buckets do, where a
// quota.Limit's default burst holds three seconds of its rate.
func ExamplePerMinute() {
	fmt.Println(llm.PerMinute(30000))
	fmt.Println(quota.PerMinute(30000))
	// Output:
	// 500/s burst 30000
	// 500/s burst 1500
}

// A request's input tokens are estimated from its body; a tokenizer, or a
// count of the message text, tightens the estimate.
func ExampleAnthropicLimits() {
	body := []byte(`{"model":"model-1","max_tokens":1024,"messages":[{"role":"user","content":"How far is the Moon?"}]}`)
	m := llm.Anthropic(llm.AnthropicLimits{
		InputTokens:  llm.PerMinute(40000),
		OutputTokens: llm.PerMinute(8000),
		EstimateInput: func(body []byte) float64 {
			var r struct {
				Messages []struct{ Content string } `json:"messages"`
			}
			if json.Unmarshal(body, &r) != nil {
				return llm.EstimateInput(body)
			}
			n := 0.0
			for _, m := range r.Messages {
				n += float64(len(m.Content))/4 + 4 // the text, and each message's framing
			}
			return n
		},
	})
	req, _ := http.NewRequest("POST", "https://api.anthropic.com/v1/messages", bytes.NewReader(body))
	u, _ := m.Estimate(req, body)
	fmt.Println(llm.EstimateInput(body), "input tokens by default,", u[llm.MeterInputTokens], "by the message text;", u[llm.MeterOutputTokens], "output")
	// Output: 33 input tokens by default, 9 by the message text; 1024 output
}
