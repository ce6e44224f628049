package llm

import (
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/usage"
)

// OpenAILimits are an OpenAI organization's limits for a model, as its
// settings show them; the requests a minute are the Transport's Limit.
// A request takes its input and max_tokens at once: Tokens needs a
// Burst that holds them, as PerMinute's minute does; a Limit with no
// Burst is refused (see the package's doc).
type OpenAILimits struct {
	Tokens quota.Limit // a minute, e.g. llm.PerMinute(30000)
	// EstimateInput estimates a request's input tokens from its body;
	// nil: EstimateCharacters.
	EstimateInput func(body []byte) float64
	// MaxTokens is what a request that names no max_tokens (nor
	// max_completion_tokens, nor max_output_tokens) reserves for its
	// answer; 0 means 4096.
	MaxTokens float64
}

// OpenAI returns the Metering of OpenAI's chat completions and responses
// APIs, as OpenAI counts: a request's tokens are its estimated input and
// its max_tokens, charged when it arrives, and not given back. A settle
// takes more when the answer's usage (in the JSON body, or in a stream's
// last chunk with stream_options.include_usage) exceeds the reservation,
// and never gives back. The x-ratelimit-remaining-{requests,tokens}
// headers lower the shared buckets, and Retry-After pauses them. It
// panics if Tokens has no Burst, or MaxTokens is below 0 or not finite.
func OpenAI(lim OpenAILimits) quota.Metering {
	return chatCompletions(tokens("OpenAI", "Tokens", lim.Tokens), lim.EstimateInput, maxTokensOr("OpenAI", lim.MaxTokens))
}

// maxTokensOr returns maxTokens, or 4096 for 0, and panics, naming the
// profile, if it is below 0 or not finite.
func maxTokensOr(profile string, maxTokens float64) float64 {
	if !(maxTokens >= 0) || math.IsInf(maxTokens, 0) {
		panic(fmt.Sprintf("llm.%s: MaxTokens %v, want 0 (for 4096) or a finite number above it", profile, maxTokens))
	}
	if maxTokens == 0 {
		return 4096
	}
	return maxTokens
}

// chatCompletions returns the Metering of an API that counts as OpenAI's
// does, on the tokens Limit tok: a request reserves estimate's input (nil:
// EstimateCharacters) and its max_tokens, maxTokens when it names none,
// never given back, and the usage in the JSON body or the stream's last
// chunk settles it. OpenAI and Azure OpenAI share it.
func chatCompletions(tok quota.Limit, estimate func([]byte) float64, maxTokens float64) quota.Metering {
	if estimate == nil {
		estimate = EstimateCharacters
	}
	return quota.Metering{
		Meters:     []quota.Meter{{Name: MeterTokens, Limit: tok}},
		NoGiveBack: []string{MeterTokens},
		Estimate: func(req *http.Request, body []byte) (quota.Usage, error) {
			if body == nil {
				return nil, nil
			}
			var r struct {
				MaxTokens       *float64 `json:"max_tokens"`
				MaxCompletion   *float64 `json:"max_completion_tokens"`
				MaxOutputTokens *float64 `json:"max_output_tokens"`
			}
			if err := json.Unmarshal(body, &r); err != nil {
				return nil, err
			}
			out := maxTokens
			for _, p := range []*float64{r.MaxTokens, r.MaxCompletion, r.MaxOutputTokens} {
				if p != nil {
					out = *p
				}
			}
			return quota.Usage{MeterTokens: estimate(body) + out}, nil
		},
		Usage: func(resp *http.Response) quota.UsageReader {
			if resp.StatusCode/100 != 2 {
				return nil
			}
			if isEventStream(resp) {
				return newLastUsage("usage", openAIUsage)
			}
			return &jsonUsage{f: usage.NewField("usage", maxUsage), read: openAIUsage}
		},
		Remaining: func(h http.Header, now time.Time) map[string]float64 {
			return remaining(h, map[string]string{
				"x-ratelimit-remaining-requests": quota.MeterRequests,
				"x-ratelimit-remaining-tokens":   MeterTokens,
			})
		},
	}
}

// openAIUsage reads OpenAI's usage object, of chat completions
// (prompt_tokens, completion_tokens) or of responses (input_tokens,
// output_tokens).
func openAIUsage(v []byte) (quota.Usage, bool) {
	var u struct {
		Total  *float64 `json:"total_tokens"`
		Prompt float64  `json:"prompt_tokens"`
		Compl  float64  `json:"completion_tokens"`
		Input  float64  `json:"input_tokens"`
		Output float64  `json:"output_tokens"`
	}
	if json.Unmarshal(v, &u) != nil {
		return nil, false
	}
	if u.Total != nil {
		return quota.Usage{MeterTokens: *u.Total}, true
	}
	n := u.Prompt + u.Compl + u.Input + u.Output
	return quota.Usage{MeterTokens: n}, n > 0
}
