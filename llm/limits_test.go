package llm

import (
	"fmt"
	"math"
	"strings"
	"testing"

	"github.com/sharedquota/quota"
)

// A profile's Meters hold what their Limits print: PerMinute holds a
// minute's tokens, and a Limit with the default burst, which would hold
// three seconds' and refuse every larger request, is refused when the
// profile is made, as is a zero Limit, and a MaxTokens that would fail
// every request that names none.
func TestProfilesHoldWhatTheirLimitsPrint(t *testing.T) {
	m := OpenAI(OpenAILimits{Tokens: PerMinute(30000)})
	if got := m.Meters[0].Limit.String(); got != "500/s burst 30000" {
		t.Errorf("OpenAI's tokens meter on PerMinute(30000): %s, want 500/s burst 30000", got)
	}
	if got, want := m.Meters[0].Limit.String(), PerMinute(30000).String(); got != want {
		t.Errorf("OpenAI's tokens meter holds %s of a Limit that prints %s", got, want)
	}
	custom := quota.Limit{Rate: 10, Burst: 2000}
	if got := Anthropic(AnthropicLimits{InputTokens: PerMinute(40000), OutputTokens: custom}).Meters[1].Limit; got != custom {
		t.Errorf("Anthropic's output meter on %v: %v", custom, got)
	}
	for _, c := range []struct {
		name string
		make func()
		want string
	}{
		{"OpenAI(quota.PerMinute(30000))", func() { OpenAI(OpenAILimits{Tokens: quota.PerMinute(30000)}) },
			"llm.OpenAI: Tokens 500/s burst 1500 has the default burst, three seconds of its rate, and would refuse every request of more tokens: give llm.PerMinute(30000) for a bucket of a minute's tokens, or set the Burst"},
		{"Anthropic(InputTokens: quota.PerMinute(40000))", func() {
			Anthropic(AnthropicLimits{InputTokens: quota.PerMinute(40000), OutputTokens: PerMinute(8000)})
		}, "llm.Anthropic: InputTokens 666.6666666666666/s burst 2000 has the default burst"},
		{"Anthropic(OutputTokens: quota.PerMinute(8000))", func() {
			Anthropic(AnthropicLimits{InputTokens: PerMinute(40000), OutputTokens: quota.PerMinute(8000)})
		}, "give llm.PerMinute(8000) for a bucket"},
		{"OpenAI(MaxTokens: -1)", func() { OpenAI(OpenAILimits{Tokens: PerMinute(30000), MaxTokens: -1}) },
			"llm.OpenAI: MaxTokens -1, want 0 (for 4096) or a finite number above it"},
		{"OpenAI(MaxTokens: NaN)", func() { OpenAI(OpenAILimits{Tokens: PerMinute(30000), MaxTokens: math.NaN()}) },
			"llm.OpenAI: MaxTokens NaN"},
		{"Anthropic without OutputTokens", func() { Anthropic(AnthropicLimits{InputTokens: PerMinute(40000)}) },
			"llm.Anthropic: OutputTokens is the zero Limit"},
		{"Gemini(quota.PerMinute(1000000))", func() { Gemini(GeminiLimits{InputTokens: quota.PerMinute(1000000)}) },
			"llm.Gemini: InputTokens 16666.666666666668/s burst 50000 has the default burst"},
		{"Gemini without InputTokens", func() { Gemini(GeminiLimits{}) }, "llm.Gemini: InputTokens is the zero Limit"},
	} {
		func() {
			defer func() {
				got := fmt.Sprint(recover())
				if !strings.Contains(got, c.want) {
					t.Errorf("%s: panic %q, want %q", c.name, got, c.want)
				}
			}()
			c.make()
		}()
	}
}
