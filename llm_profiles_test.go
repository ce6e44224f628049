package quota_test

import (
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/llm"
)

// The package's own tests meter LLM APIs with package llm's profiles,
// which they cannot import: llm imports the package (see LLMProfiles).
func init() {
	quota.LLMProfiles.Anthropic = func(input, output quota.Limit) quota.Metering {
		return llm.Anthropic(llm.AnthropicLimits{InputTokens: input, OutputTokens: output})
	}
	quota.LLMProfiles.OpenAI = func(tokens quota.Limit) quota.Metering {
		return llm.OpenAI(llm.OpenAILimits{Tokens: tokens})
	}
	quota.LLMProfiles.Gemini = func(input quota.Limit) quota.Metering {
		return llm.Gemini(llm.GeminiLimits{InputTokens: input})
	}
	quota.LLMProfiles.Azure = func(tpm float64, window time.Duration) (quota.Metering, quota.Limit) {
		lim := llm.AzureLimits{TokensPerMinute: tpm, Window: window}
		return llm.Azure(lim), lim.Requests()
	}
	quota.LLMProfiles.Bedrock = func(tokens quota.Limit, burndown float64) quota.Metering {
		return llm.Bedrock(llm.BedrockLimits{Tokens: tokens, OutputBurndown: func(string) float64 { return burndown }})
	}
}
