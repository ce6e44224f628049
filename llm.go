package quota

import (
	"encoding/json"
	"math"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/usage"
)

// The Meters of the LLM Meterings, beside MeterRequests.
const (
	MeterInputTokens  = "input_tokens"  // Anthropic: input tokens a minute
	MeterOutputTokens = "output_tokens" // Anthropic: output tokens a minute
	MeterTokens       = "tokens"        // OpenAI: tokens a minute, input and output
)

// EstimateInput is the default estimate of a request's input tokens: a
// token for every 3 bytes of its JSON body. English text runs about 4
// bytes a token and the body's JSON adds its own, so it overcounts most
// requests by a third or more; what it overcounts a settle gives back.
// Text that tokenizes densely (code, some scripts) comes nearer 3.
func EstimateInput(body []byte) float64 { return math.Ceil(float64(len(body)) / 3) }

// AnthropicLimits are an Anthropic organization's limits for a model
// class, as its console shows them; the requests a minute are the
// Transport's Limit. A zero Burst is one minute of Rate: Anthropic's
// buckets hold a minute's tokens and refill continuously.
type AnthropicLimits struct {
	InputTokens  Limit // a minute, e.g. PerMinute(40000)
	OutputTokens Limit // a minute, e.g. PerMinute(8000)
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
// headers lower the shared buckets, and Retry-After pauses them.
func Anthropic(lim AnthropicLimits) Metering {
	estimate := lim.EstimateInput
	if estimate == nil {
		estimate = EstimateInput
	}
	return Metering{
		Meters: []Meter{
			{Name: MeterInputTokens, Limit: minuteBurst(lim.InputTokens)},
			{Name: MeterOutputTokens, Limit: minuteBurst(lim.OutputTokens)},
		},
		Estimate: func(req *http.Request, body []byte) (Usage, error) {
			if body == nil {
				return nil, nil // a request without a body: the request alone
			}
			var r struct {
				MaxTokens *float64 `json:"max_tokens"`
			}
			if err := json.Unmarshal(body, &r); err != nil {
				return nil, err
			}
			u := Usage{MeterInputTokens: estimate(body)}
			if r.MaxTokens != nil {
				u[MeterOutputTokens] = *r.MaxTokens
			}
			return u, nil
		},
		Usage: func(resp *http.Response) UsageReader {
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
				"anthropic-ratelimit-requests-remaining":      MeterRequests,
				"anthropic-ratelimit-input-tokens-remaining":  MeterInputTokens,
				"anthropic-ratelimit-output-tokens-remaining": MeterOutputTokens,
			})
		},
	}
}

// anthropicUsage reads Anthropic's usage object.
func anthropicUsage(v []byte) (Usage, bool) {
	var u struct {
		Input  *float64 `json:"input_tokens"`
		Output *float64 `json:"output_tokens"`
		Cached float64  `json:"cache_creation_input_tokens"`
	}
	if json.Unmarshal(v, &u) != nil {
		return nil, false
	}
	out := Usage{}
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
	used   Usage
	output bool // a message_delta told the output tokens
}

func newAnthropicStream() *anthropicStream {
	s := &anthropicStream{used: Usage{}}
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
func (s *anthropicStream) Usage() (Usage, bool) {
	s.events.Close()
	if !s.output {
		delete(s.used, MeterOutputTokens)
	}
	return s.used, len(s.used) > 0
}

// EstimateCharacters estimates a request's input tokens as OpenAI does
// when it admits the request, from its characters: a token for every 4
// bytes of its JSON body, which the JSON's own bytes make an overcount.
func EstimateCharacters(body []byte) float64 { return math.Ceil(float64(len(body)) / 4) }

// OpenAILimits are an OpenAI organization's limits for a model, as its
// settings show them; the requests a minute are the Transport's Limit. A
// zero Burst is one minute of Rate.
type OpenAILimits struct {
	Tokens Limit // a minute, e.g. PerMinute(30000)
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
// headers lower the shared buckets, and Retry-After pauses them.
func OpenAI(lim OpenAILimits) Metering {
	estimate := lim.EstimateInput
	if estimate == nil {
		estimate = EstimateCharacters
	}
	maxTokens := lim.MaxTokens
	if maxTokens <= 0 {
		maxTokens = 4096
	}
	return Metering{
		Meters:     []Meter{{Name: MeterTokens, Limit: minuteBurst(lim.Tokens)}},
		NoGiveBack: []string{MeterTokens},
		Estimate: func(req *http.Request, body []byte) (Usage, error) {
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
			return Usage{MeterTokens: estimate(body) + out}, nil
		},
		Usage: func(resp *http.Response) UsageReader {
			if resp.StatusCode/100 != 2 {
				return nil
			}
			if isEventStream(resp) {
				return newOpenAIStream()
			}
			return &jsonUsage{f: usage.NewField("usage", maxUsage), read: openAIUsage}
		},
		Remaining: func(h http.Header, now time.Time) map[string]float64 {
			return remaining(h, map[string]string{
				"x-ratelimit-remaining-requests": MeterRequests,
				"x-ratelimit-remaining-tokens":   MeterTokens,
			})
		},
	}
}

// openAIUsage reads OpenAI's usage object, of chat completions
// (prompt_tokens, completion_tokens) or of responses (input_tokens,
// output_tokens).
func openAIUsage(v []byte) (Usage, bool) {
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
		return Usage{MeterTokens: *u.Total}, true
	}
	n := u.Prompt + u.Compl + u.Input + u.Output
	return Usage{MeterTokens: n}, n > 0
}

// openAIStream reads the usage of a streamed OpenAI answer: the chunk
// whose usage is not null (the last, with stream_options.include_usage).
type openAIStream struct {
	events usage.Events
	field  *usage.Field
	used   Usage
}

func newOpenAIStream() *openAIStream {
	s := &openAIStream{field: usage.NewField("usage", maxUsage)}
	s.events.Max = maxUsage
	s.events.On = func(_ string, data []byte) {
		s.field.Reset()
		_, _ = s.field.Write(data)
		if v, ok := s.field.Value(); ok {
			if u, ok := openAIUsage(v); ok {
				s.used = u
			}
		}
	}
	return s
}

func (s *openAIStream) Write(p []byte) (int, error) { return s.events.Write(p) }

func (s *openAIStream) Usage() (Usage, bool) {
	s.events.Close()
	return s.used, s.used != nil
}

// maxUsage bounds what a UsageReader keeps of a body: a usage object, or
// one event of a stream.
const maxUsage = 64 << 10

// jsonUsage reads a JSON body's top-level usage object as it streams by.
type jsonUsage struct {
	f    *usage.Field
	read func([]byte) (Usage, bool)
}

func (j *jsonUsage) Write(p []byte) (int, error) { return j.f.Write(p) }

func (j *jsonUsage) Usage() (Usage, bool) {
	v, ok := j.f.Value()
	if !ok {
		return nil, false
	}
	return j.read(v)
}

// isEventStream reports whether resp is a server-sent event stream.
func isEventStream(resp *http.Response) bool {
	t, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	return t == "text/event-stream"
}

// minuteBurst returns lim with a zero Burst made one minute of its Rate.
func minuteBurst(lim Limit) Limit {
	if lim.Burst == 0 {
		lim.Burst = math.Max(1, math.Round(lim.Rate*60))
	}
	return lim
}

// policies reads the IETF RateLimit-Policy field: the quota of each
// policy it names, as a rate a second (`"output_tokens";q=8000;w=60` is
// 133.3/s), for the policies with both a quota and a window.
func policies(h http.Header) map[string]float64 {
	var out map[string]float64
	for _, field := range h.Values("RateLimit-Policy") {
		for _, item := range strings.Split(field, ",") {
			policy, _, _ := strings.Cut(strings.TrimSpace(item), ";")
			policy = strings.Trim(policy, `"`)
			params := parseParams(item)
			q, w := params["q"], params["w"]
			if policy == "" || !(q >= 0) || !(w > 0) {
				continue
			}
			if out == nil {
				out = map[string]float64{}
			}
			out[policy] = q / w
		}
	}
	return out
}

// remaining reads the headers named in meters, each the count left of a
// Meter, and the IETF RateLimit field's items whose policy names a Meter
// (`"output_tokens";r=500;t=30`).
func remaining(h http.Header, meters map[string]string) map[string]float64 {
	out := map[string]float64{}
	for header, meter := range meters {
		if v := strings.TrimSpace(h.Get(header)); v != "" {
			if n, err := strconv.ParseFloat(v, 64); err == nil && n >= 0 {
				out[meter] = n
			}
		}
	}
	known := map[string]bool{}
	for _, m := range meters {
		known[m] = true
	}
	for _, field := range h.Values("RateLimit") {
		for _, item := range strings.Split(field, ",") {
			policy, _, _ := strings.Cut(strings.TrimSpace(item), ";")
			policy = strings.Trim(policy, `"`)
			if r, ok := parseParams(item)["r"]; ok && known[policy] && r >= 0 {
				if old, seen := out[policy]; !seen || r < old {
					out[policy] = r
				}
			}
		}
	}
	return out
}
