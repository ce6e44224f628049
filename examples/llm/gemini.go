package main

import (
	"context"
	"fmt"
	"io"
	"net/http"

	"google.golang.org/genai"
)

// geminiModel is the model the example asks.
const geminiModel = "gemini-2.5-flash"

// geminiClient returns a client of Gemini's API that sends through hc, at
// baseURL when not empty; its API key is GEMINI_API_KEY's (or
// GOOGLE_API_KEY's). The SDK does not retry unless its HTTPOptions ask.
func geminiClient(ctx context.Context, hc *http.Client, baseURL string) (*genai.Client, error) {
	return genai.NewClient(ctx, &genai.ClientConfig{
		Backend:     genai.BackendGeminiAPI,
		HTTPClient:  hc,
		HTTPOptions: genai.HTTPOptions{BaseURL: baseURL},
	})
}

func askGemini(ctx context.Context, hc *http.Client, cfg config, out io.Writer) error {
	client, err := geminiClient(ctx, hc, cfg.BaseURL)
	if err != nil {
		return err
	}
	gc := &genai.GenerateContentConfig{MaxOutputTokens: maxTokens}
	resp, err := client.Models.GenerateContent(ctx, geminiModel, genai.Text(cfg.Prompt), gc)
	if err != nil {
		return err
	}
	printGemini(out, "gemini", resp.Text(), resp.UsageMetadata)

	// The SDK streams with alt=sse: every chunk carries the usage so far,
	// the last one final, which the Transport settles the reservation with.
	var text string
	var usage *genai.GenerateContentResponseUsageMetadata
	for chunk, err := range client.Models.GenerateContentStream(ctx, geminiModel, genai.Text(cfg.Prompt), gc) {
		if err != nil {
			return err
		}
		text += chunk.Text()
		if chunk.UsageMetadata != nil {
			usage = chunk.UsageMetadata
		}
	}
	printGemini(out, "gemini stream", text, usage)
	return nil
}

func printGemini(out io.Writer, label, text string, u *genai.GenerateContentResponseUsageMetadata) {
	if u == nil {
		u = &genai.GenerateContentResponseUsageMetadata{}
	}
	fmt.Fprintf(out, "%s: %s (%d input, %d output tokens)\n", label, text, u.PromptTokenCount, u.CandidatesTokenCount)
}
