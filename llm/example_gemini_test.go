package llm_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"log"
	"net/http"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/standin"
	"github.com/sharedquota/quota/llm"
)

// Requests to Gemini's generateContent reserve a request, one of the
// requests a day and their input tokens, which Gemini's tokens a minute
// count, and are settled with the promptTokenCount of the answer's
// usageMetadata as the caller reads it.
func ExampleGemini() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	redisServer.SetTime(time.Now()) // near the callers' clock, which tells the day's resets
	provider := &llmfake.Server{Kind: llmfake.Gemini, Used: func(int) int { return 120 }}
	defer standin.Provider(provider.ServeHTTP)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(150), // requests a minute (RPM)
		quota.WithMetering(llm.Gemini(llm.GeminiLimits{
			InputTokens:    llm.PerMinute(1000000), // tokens a minute (TPM), input
			RequestsPerDay: 10000,                  // requests a day (RPD), from midnight Pacific
		})))
	client := &http.Client{Transport: tr} // genai.ClientConfig{HTTPClient: client}
	// end README

	body, _ := json.Marshal(map[string]any{
		"contents":         []map[string]any{{"role": "user", "parts": []map[string]any{{"text": "How far is the Moon?"}}}},
		"generationConfig": map[string]any{"maxOutputTokens": 1024},
	})
	resp, err := client.Post("https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash:generateContent",
		"application/json", bytes.NewReader(body))
	if err != nil {
		log.Fatal(err)
	}
	var answer struct {
		UsageMetadata struct {
			PromptTokenCount, CandidatesTokenCount int
		}
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	// The settle, at the body's end, goes before the process exits.
	if err := tr.Limiter().Flush(context.Background()); err != nil {
		log.Fatal(err)
	}
	fmt.Println(resp.Status, "with", answer.UsageMetadata.PromptTokenCount, "input and",
		answer.UsageMetadata.CandidatesTokenCount, "output tokens")
	// Output: 200 OK with 8 input and 120 output tokens
}
