package llm

import (
	"fmt"
	"math"
	"time"

	"github.com/sharedquota/quota"
)

// AzureLimits are an Azure OpenAI deployment's limits, as its quota page
// shows them: its tokens a minute, and the requests a minute that go with
// them (Requests returns their Limit, the Transport's). Azure checks a
// deployment's rate over windows of 1 or 10 seconds, not a minute, so
// the buckets hold a Window of their rate, not a minute's.
type AzureLimits struct {
	// TokensPerMinute is the deployment's tokens a minute (TPM), e.g.
	// 30000.
	TokensPerMinute float64
	// RequestsPerMinute is the deployment's requests a minute (RPM); 0
	// means 6 for each 1,000 tokens a minute, the ratio of most models.
	RequestsPerMinute float64
	// Window is how long a span the buckets hold the rate of: Azure
	// checks a deployment's rate over 1 or 10 seconds; 0 means 1 s, which
	// keeps within either.
	Window time.Duration
	// MaxRequest is the most tokens one request reserves, its estimated
	// input and its max_tokens: the tokens' bucket holds at least that
	// many, even when they are more than a Window's, so that such a
	// request fits; a larger one fails with quota.ErrExceedsBurst. 0
	// means twice MaxTokens.
	MaxRequest float64
	// EstimateInput estimates a request's input tokens from its body;
	// nil: EstimateCharacters.
	EstimateInput func(body []byte) float64
	// MaxTokens is what a request that names no max_tokens (nor
	// max_completion_tokens, nor max_output_tokens) reserves for its
	// answer; 0 means 4096.
	MaxTokens float64
}

// Azure returns the Metering of an Azure OpenAI deployment's chat
// completions and responses, as Azure counts: a request's tokens are its
// estimated input and its max_tokens, charged when it arrives and not
// given back, as OpenAI's are (see OpenAI), into a bucket of
// lim.Tokens(). The x-ratelimit-remaining-{requests,tokens} headers lower
// the shared buckets, and a 429's retry-after-ms (else its Retry-After)
// pauses them. Give the Transport lim.Requests() as its Limit. It panics
// if a field of lim is invalid (see Tokens).
func Azure(lim AzureLimits) quota.Metering {
	return chatCompletions(lim.Tokens(), lim.EstimateInput, maxTokensOr("Azure", lim.MaxTokens))
}

// Tokens returns the Limit of the deployment's tokens: TokensPerMinute a
// minute, in a bucket of a Window's, or of MaxRequest when that is more.
// It panics if TokensPerMinute is not a finite number above zero, Window
// below zero, or MaxRequest or MaxTokens below zero or not finite.
func (l AzureLimits) Tokens() quota.Limit {
	rate := l.rate("TokensPerMinute", l.TokensPerMinute)
	most := l.MaxRequest
	if !(most >= 0) || math.IsInf(most, 0) {
		panic(fmt.Sprintf("llm.Azure: MaxRequest %v, want 0 (for twice MaxTokens) or a finite number above it", most))
	}
	if most == 0 {
		most = 2 * maxTokensOr("Azure", l.MaxTokens)
	}
	return quota.Limit{Rate: rate, Burst: max(rate*l.window().Seconds(), most)}
}

// Requests returns the Limit of the deployment's requests, the
// Transport's: RequestsPerMinute a minute, or 6 for each 1,000 of
// TokensPerMinute, in a bucket of a Window's, at least one. It panics as
// Tokens does, or if RequestsPerMinute is below zero or not finite.
func (l AzureLimits) Requests() quota.Limit {
	rpm := l.RequestsPerMinute
	if rpm == 0 {
		rpm = 6 * l.rate("TokensPerMinute", l.TokensPerMinute) * 60 / 1000
	}
	rate := l.rate("RequestsPerMinute", rpm)
	return quota.Limit{Rate: rate, Burst: max(1, rate*l.window().Seconds())}
}

// rate returns perMinute a second, and panics, naming field, unless it is
// a finite number above zero.
func (l AzureLimits) rate(field string, perMinute float64) float64 {
	if !(perMinute > 0) || math.IsInf(perMinute, 0) {
		panic(fmt.Sprintf("llm.Azure: %s %v, want the deployment's, a finite number above zero", field, perMinute))
	}
	return perMinute / 60
}

// window returns the Window, 1 s for 0, and panics if it is negative.
func (l AzureLimits) window() time.Duration {
	switch {
	case l.Window < 0:
		panic(fmt.Sprintf("llm.Azure: Window %v, want 0 (for 1 s) or more", l.Window))
	case l.Window == 0:
		return time.Second
	}
	return l.Window
}
