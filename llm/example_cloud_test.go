package llm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"strings"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/standin"
	"github.com/sharedquota/quota/llm"
)

// An Azure OpenAI deployment's limits are its tokens a minute, and the
// requests a minute that go with them; its buckets hold a second of them,
// raised to hold the largest request, since Azure checks its rate over 1
// or 10 seconds.
func ExampleAzure() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.Azure, Used: func(int) int { return 200 }}
	defer standin.Provider(provider.ServeHTTP)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	lim := llm.AzureLimits{TokensPerMinute: 30000} // the deployment's TPM
	tr := quota.NewTransport(rdb, lim.Requests(),  // 6 a minute for each 1,000 tokens a minute
		quota.WithMetering(llm.Azure(lim)))
	client := &http.Client{Transport: tr} // openai-go: option.WithHTTPClient(client), with azure.WithEndpoint
	// end README

	fmt.Println("requests", lim.Requests(), "tokens", lim.Tokens())
	postLLM(client, "https://example.openai.azure.com/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", 500)
	// Output:
	// requests 3/s burst 3 tokens 500/s burst 8192
	// 200 OK with 200 output tokens used
}

// A Bedrock model's quotas count input and output against one tokens a
// minute; output tokens of some models take 5 each.
func ExampleBedrock() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.Bedrock, Used: func(int) int { return 120 }}
	defer standin.Provider(provider.ServeHTTP)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(200), // requests a minute
		quota.WithMetering(llm.Bedrock(llm.BedrockLimits{
			Tokens: llm.PerMinute(200000), // input and output
			OutputBurndown: func(model string) float64 {
				if strings.Contains(model, "anthropic.claude-sonnet-4") || strings.Contains(model, "anthropic.claude-opus-4") {
					return 5 // an output token takes 5 of the quota
				}
				return 1
			},
		})))
	client := &http.Client{Transport: tr} // bedrockruntime.Options{HTTPClient: client}
	// end README

	body, _ := json.Marshal(map[string]any{
		"messages":        []map[string]any{{"role": "user", "content": []map[string]string{{"text": "How far is the Moon?"}}}},
		"inferenceConfig": map[string]any{"maxTokens": 500},
	})
	url := "https://bedrock-runtime.us-east-1.amazonaws.com/model/us.anthropic.claude-sonnet-4-20250514-v1:0/converse"
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
	// The request reserved its input and 500 × 5; the settle keeps its
	// input and 120 × 5, and gives back the rest.
	fmt.Println(resp.Status, "with", answer.Usage["outputTokens"], "output tokens used")
	if err := tr.Limiter().Flush(context.Background()); err != nil {
		log.Fatal(err)
	}
	// Output: 200 OK with 120 output tokens used
}
