package llm

import (
	"encoding/json"
	"net/http"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/usage"
)

// AnthropicLimits are an Anthropic organization's limits for a model
// class, as its console shows them; the requests a minute are the
// Transport's Limit. Anthropic's buckets hold a minute's tokens and
// refill continuously, as PerMinute's do; a Limit with no Burst is
// refused (see the package's doc).
type AnthropicLimits struct {
	InputTokens  quota.Limit // a minute, e.g. llm.PerMinute(40000)
	OutputTokens quota.Limit // a minute, e.g. llm.PerMinute(8000)
	// EstimateInput estimates a request's input tokens from its body;
	// nil: EstimateInput.
	EstimateInput func(body []byte) float64
}

// Anthropic returns the Metering of Anthropic's Messages API, as it
// counts: a request reserves 1 request, its estimated input tokens and
// its max_tokens of output tokens when it is sent, and is settled with the
// input (with cache writes) and output tokens its answer reports, in the
// JSON body's usage or, for a stream, in message_start and message_delta.
// The anthropic-ratelimit-{requests,input-tokens,output-tokens}-remaining
// headers lower the shared buckets, and Retry-After pauses them. It
// panics if InputTokens or OutputTokens has no Burst.
func Anthropic(lim AnthropicLimits) quota.Metering {
	estimate := lim.EstimateInput
	if estimate == nil {
		estimate = EstimateInput
	}
	return quota.Metering{
		Meters: []quota.Meter{
			{Name: MeterInputTokens, Limit: tokens("Anthropic", "InputTokens", lim.InputTokens)},
			{Name: MeterOutputTokens, Limit: tokens("Anthropic", "OutputTokens", lim.OutputTokens)},
		},
		Estimate: func(req *http.Request, body []byte) (quota.Usage, error) {
			if body == nil {
				return nil, nil // a request without a body: the request alone
			}
			var r struct {
				MaxTokens *float64 `json:"max_tokens"`
			}
			if err := json.Unmarshal(body, &r); err != nil {
				return nil, err
			}
			u := quota.Usage{MeterInputTokens: estimate(body)}
			if r.MaxTokens != nil {
				u[MeterOutputTokens] = *r.MaxTokens
			}
			return u, nil
		},
		Usage: func(resp *http.Response) quota.UsageReader {
			if resp.StatusCode/100 != 2 {
				return nil // an error answer: the provider's counts are its own
			}
			if isEventStream(resp) {
				return newAnthropicStream()
			}
			return &jsonUsage{f: usage.NewField("usage", maxUsage), read: anthropicUsage}
		},
		Remaining: func(h http.Header, now time.Time) map[string]float64 {
			return remaining(h, map[string]string{
				"anthropic-ratelimit-requests-remaining":      quota.MeterRequests,
				"anthropic-ratelimit-input-tokens-remaining":  MeterInputTokens,
				"anthropic-ratelimit-output-tokens-remaining": MeterOutputTokens,
			})
		},
	}
}

// anthropicUsage reads Anthropic's usage object.
func anthropicUsage(v []byte) (quota.Usage, bool) {
	var u struct {
		Input  *float64 `json:"input_tokens"`
		Output *float64 `json:"output_tokens"`
		Cached float64  `json:"cache_creation_input_tokens"`
	}
	if json.Unmarshal(v, &u) != nil {
		return nil, false
	}
	out := quota.Usage{}
	if u.Input != nil {
		out[MeterInputTokens] = *u.Input + u.Cached
	}
	if u.Output != nil {
		out[MeterOutputTokens] = *u.Output
	}
	return out, len(out) > 0
}

// anthropicStream reads the usage of a streamed Anthropic answer: the
// input tokens in message_start, the output tokens in message_delta
// (a count of the whole answer so far, the last one final).
type anthropicStream struct {
	events usage.Events
	used   quota.Usage
	output bool // a message_delta told the output tokens
}

func newAnthropicStream() *anthropicStream {
	s := &anthropicStream{used: quota.Usage{}}
	s.events.Max = maxUsage
	s.events.On = func(event string, data []byte) {
		switch event {
		case "message_start":
			var m struct {
				Message struct {
					Usage json.RawMessage `json:"usage"`
				} `json:"message"`
			}
			if json.Unmarshal(data, &m) == nil {
				if u, ok := anthropicUsage(m.Message.Usage); ok {
					if n, ok := u[MeterInputTokens]; ok {
						s.used[MeterInputTokens] = n
					}
				}
			}
		case "message_delta":
			var m struct {
				Usage json.RawMessage `json:"usage"`
			}
			if json.Unmarshal(data, &m) == nil {
				if u, ok := anthropicUsage(m.Usage); ok {
					if n, ok := u[MeterOutputTokens]; ok {
						s.used[MeterOutputTokens], s.output = n, true
					}
					if n, ok := u[MeterInputTokens]; ok {
						s.used[MeterInputTokens] = n
					}
				}
			}
		}
	}
	return s
}

func (s *anthropicStream) Write(p []byte) (int, error) { return s.events.Write(p) }

// Usage reports the input tokens once message_start told them, and the
// output tokens once a message_delta did: a stream cut before them keeps
// their reservation.
func (s *anthropicStream) Usage() (quota.Usage, bool) {
	s.events.Close()
	if !s.output {
		delete(s.used, MeterOutputTokens)
	}
	return s.used, len(s.used) > 0
}
