package llm

import (
	"encoding/json"
	"fmt"
	"math"
	"mime"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/eventstream"
	"github.com/sharedquota/quota/internal/usage"
)

// BedrockLimits are an AWS account's Amazon Bedrock quotas for a model in
// a Region, as Service Quotas shows them; its requests a minute are the
// Transport's Limit. Input and output count against one tokens-a-minute
// quota; a Limit with no Burst is refused (see the package's doc).
type BedrockLimits struct {
	Tokens quota.Limit // a minute, input and output, e.g. llm.PerMinute(200000)
	// OutputBurndown returns how many tokens of the quota an output token
	// of the model takes, by its model ID (or inference profile) in the
	// request's path: Bedrock's burndown rate, 5 for the Anthropic Claude
	// models its quota page lists (Claude Opus 4 and Sonnet 4 among them)
	// and 1 for the others (see docs/llm.md). Nil: 1 for every model. A result below 1 or not
	// finite fails the request, wrapped in quota.ErrInvalidTokens.
	OutputBurndown func(model string) float64
	// EstimateInput estimates a request's input tokens from its body;
	// nil: EstimateInput.
	EstimateInput func(body []byte) float64
	// MaxTokens is what a request that names no maximum (Converse's
	// inferenceConfig.maxTokens, an Anthropic body's max_tokens) reserves
	// for its answer; 0 means 4096. Bedrock then reserves the model's
	// maximum, which may be far more: name one.
	MaxTokens float64
}

// Bedrock returns the Metering of Amazon Bedrock's Converse,
// ConverseStream and InvokeModel APIs (POST /model/{modelId}/converse,
// /converse-stream, /invoke), as Bedrock counts: a request reserves its
// estimated input and its maximum output, times the model's burndown,
// when it is sent, and is settled with its input, cache writes and
// output times the burndown, what it gave back included, from the
// X-Amzn-Bedrock-Input-Token-Count and -Output-Token-Count headers, else
// the body's usage (Converse's inputTokens and outputTokens, or an
// Anthropic body's input_tokens and output_tokens), or a ConverseStream's
// metadata event. Bedrock's ThrottlingException carries no Retry-After,
// so its 429 pauses nothing (see docs/llm.md). It panics if Tokens has no
// Burst, or MaxTokens is below 0 or not finite.
func Bedrock(lim BedrockLimits) quota.Metering {
	estimate := lim.EstimateInput
	if estimate == nil {
		estimate = EstimateInput
	}
	maxTokens := maxTokensOr("Bedrock", lim.MaxTokens)
	burndown := func(r *http.Request) (float64, error) {
		if lim.OutputBurndown == nil || r == nil {
			return 1, nil
		}
		model := bedrockModel(r.URL)
		b := lim.OutputBurndown(model)
		if !(b >= 1) || math.IsInf(b, 0) {
			return 0, fmt.Errorf("OutputBurndown(%q) = %v, want a finite number of 1 or more", model, b)
		}
		return b, nil
	}
	return quota.Metering{
		Meters: []quota.Meter{{Name: MeterTokens, Limit: tokens("Bedrock", "Tokens", lim.Tokens)}},
		Estimate: func(req *http.Request, body []byte) (quota.Usage, error) {
			if body == nil {
				return nil, nil
			}
			var r struct {
				Inference struct {
					MaxTokens *float64 `json:"maxTokens"`
				} `json:"inferenceConfig"`
				MaxTokens *float64 `json:"max_tokens"`
			}
			if err := json.Unmarshal(body, &r); err != nil {
				return nil, err
			}
			b, err := burndown(req)
			if err != nil {
				return nil, err
			}
			out := maxTokens
			for _, p := range []*float64{r.MaxTokens, r.Inference.MaxTokens} {
				if p != nil {
					out = *p
				}
			}
			return quota.Usage{MeterTokens: estimate(body) + out*b}, nil
		},
		Usage: func(resp *http.Response) quota.UsageReader {
			if resp.StatusCode/100 != 2 {
				return nil
			}
			b, err := burndown(resp.Request)
			if err != nil {
				return nil // cannot be: the request's estimate failed first
			}
			if u, ok := bedrockHeaders(resp.Header, b); ok {
				return told{u}
			}
			if t, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); t == "application/vnd.amazon.eventstream" {
				return newBedrockStream(b)
			}
			return &jsonUsage{f: usage.NewField("usage", maxUsage), read: func(v []byte) (quota.Usage, bool) {
				return bedrockUsage(v, b)
			}}
		},
	}
}

// bedrockModel returns the model ID (or inference profile, or ARN) of a
// request to /model/{modelId}/..., unescaped; "" for another path.
func bedrockModel(u *url.URL) string {
	rest, ok := strings.CutPrefix(u.EscapedPath(), "/model/")
	if !ok {
		return ""
	}
	id, _, _ := strings.Cut(rest, "/")
	if m, err := url.PathUnescape(id); err == nil {
		return m
	}
	return id
}

// bedrockHeaders reads the usage InvokeModel's answer tells in its
// headers, output times burndown.
func bedrockHeaders(h http.Header, burndown float64) (quota.Usage, bool) {
	count := func(name string) (float64, bool) {
		n, err := strconv.ParseFloat(strings.TrimSpace(h.Get(name)), 64)
		return n, err == nil && n >= 0 && !math.IsInf(n, 0)
	}
	in, okIn := count("X-Amzn-Bedrock-Input-Token-Count")
	out, okOut := count("X-Amzn-Bedrock-Output-Token-Count")
	if !okIn || !okOut {
		return nil, false
	}
	written, _ := count("X-Amzn-Bedrock-Cache-Write-Input-Token-Count")
	return quota.Usage{MeterTokens: in + written + out*burndown}, true
}

// bedrockUsage reads a usage object, Converse's (inputTokens,
// outputTokens, cacheWriteInputTokens) or an Anthropic body's
// (input_tokens, output_tokens, cache_creation_input_tokens): its input,
// cache writes and output times burndown. Cache reads do not count.
func bedrockUsage(v []byte, burndown float64) (quota.Usage, bool) {
	var u struct {
		Input    *float64 `json:"inputTokens"`
		Output   *float64 `json:"outputTokens"`
		Written  float64  `json:"cacheWriteInputTokens"`
		InputA   *float64 `json:"input_tokens"`
		OutputA  *float64 `json:"output_tokens"`
		WrittenA float64  `json:"cache_creation_input_tokens"`
	}
	if json.Unmarshal(v, &u) != nil {
		return nil, false
	}
	for _, c := range []struct {
		in, out *float64
		written float64
	}{{u.Input, u.Output, u.Written}, {u.InputA, u.OutputA, u.WrittenA}} {
		if c.in != nil && c.out != nil {
			return quota.Usage{MeterTokens: *c.in + c.written + *c.out*burndown}, true
		}
	}
	return nil, false
}

// told is the UsageReader of a usage the headers told: the body adds
// nothing.
type told struct{ u quota.Usage }

func (told) Write(p []byte) (int, error)  { return len(p), nil }
func (t told) Usage() (quota.Usage, bool) { return t.u, true }

// bedrockStream reads the usage of a ConverseStream answer: the usage of
// its metadata event.
type bedrockStream struct {
	r    eventstream.Reader
	used quota.Usage
}

func newBedrockStream(burndown float64) *bedrockStream {
	s := &bedrockStream{}
	s.r.Max = maxUsage
	s.r.On = func(m eventstream.Message) {
		if m.Headers[":message-type"] != "event" || m.Headers[":event-type"] != "metadata" {
			return
		}
		var e struct {
			Usage json.RawMessage `json:"usage"`
		}
		if json.Unmarshal(m.Payload, &e) == nil {
			if u, ok := bedrockUsage(e.Usage, burndown); ok {
				s.used = u
			}
		}
	}
	return s
}

func (s *bedrockStream) Write(p []byte) (int, error) { return s.r.Write(p) }

// Usage reports the usage once the metadata event told it: a stream cut
// before it keeps its reservation.
func (s *bedrockStream) Usage() (quota.Usage, bool) { return s.used, s.used != nil }
