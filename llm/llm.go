// Package llm holds the Meterings of LLM APIs, for a quota Transport
// (quota.WithMetering): each request reserves its requests, input and
// output tokens at once, as its provider counts them, and is settled from
// the usage its answer reports, in the JSON body or in the event stream,
// as the caller reads it.
//
//	tr := quota.NewTransport(rdb, quota.PerMinute(50), // requests a minute
//		quota.WithMetering(llm.Anthropic(llm.AnthropicLimits{
//			InputTokens:  llm.PerMinute(40000),
//			OutputTokens: llm.PerMinute(8000),
//		})))
//	client := &http.Client{Transport: tr} // an SDK's option.WithHTTPClient(client)
//
// Anthropic, OpenAI and Gemini return their APIs' Meterings, and Azure and
// Bedrock those of Azure OpenAI and Amazon Bedrock; the Meters are named
// by MeterInputTokens, MeterOutputTokens and MeterTokens, beside
// quota.MeterRequests, and a request's input tokens are estimated from its
// body by EstimateInput or EstimateCharacters unless the Limits give an
// estimate of their own.
//
// The tokens' Limits need a Burst. A request takes its tokens at once,
// often more than the default burst of a quota.Limit holds (three
// seconds of its rate: 2,000 of 40,000 a minute), and a bucket refuses,
// every time, a request larger than its burst: the profiles panic on a
// Limit without one. PerMinute(n) holds a minute's, n. The requests a
// minute are the Transport's Limit, whose zero Burst is the default, as
// everywhere: quota.PerMinute(50) sends them smoothly, PerMinute(50) lets
// a minute's go at once.
package llm

import (
	"fmt"
	"math"
	"mime"
	"net/http"
	"strconv"
	"strings"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/ratelimit"
	"github.com/sharedquota/quota/internal/usage"
)

// The Meters of the LLM Meterings, beside quota.MeterRequests.
const (
	MeterInputTokens  = "input_tokens"  // Anthropic, Gemini: input tokens a minute
	MeterOutputTokens = "output_tokens" // Anthropic: output tokens a minute
	MeterTokens       = "tokens"        // OpenAI: tokens a minute, input and output
	// MeterRequestsPerDay: Gemini's requests a day, a quota.Daily.
	MeterRequestsPerDay = "requests_per_day"
)

// EstimateInput is the default estimate of a request's input tokens: a
// token for every 3 bytes of its JSON body. English text runs about 4
// bytes a token and the body's JSON adds its own, so it overcounts most
// requests by a third or more; what it overcounts a settle gives back.
// Text that tokenizes densely (code, some scripts) comes nearer 3.
func EstimateInput(body []byte) float64 { return math.Ceil(float64(len(body)) / 3) }

// EstimateCharacters estimates a request's input tokens as OpenAI does
// when it admits the request, from its characters: a token for every 4
// bytes of its JSON body, which the JSON's own bytes make an overcount.
func EstimateCharacters(body []byte) float64 { return math.Ceil(float64(len(body)) / 4) }

// PerMinute returns the Limit of n a minute in a bucket of n, a minute's
// worth, refilled continuously at n/60 a second: PerMinute(30000) prints
// "500/s burst 30000", where quota.PerMinute(30000), with the default
// burst, holds 1500.
func PerMinute(n float64) quota.Limit { return quota.Limit{Rate: n / 60, Burst: n} }

// tokens returns lim, the Limit of the profile's field, and panics if it
// is the zero Limit or has no Burst: a bucket of tokens with the default
// burst, three seconds of its rate, refuses every request larger than
// that. quota.WithMetering refuses an invalid Limit.
func tokens(profile, field string, lim quota.Limit) quota.Limit {
	if lim == (quota.Limit{}) {
		panic(fmt.Sprintf("llm.%s: %s is the zero Limit: give the organization's limit, as in llm.PerMinute(40000)", profile, field))
	}
	if lim.Burst == 0 && lim.Validate() == nil {
		minute := strconv.FormatFloat(math.Round(lim.Rate*60*1e6)/1e6, 'f', -1, 64)
		panic(fmt.Sprintf("llm.%s: %s %v has the default burst, three seconds of its rate, and would refuse every request "+
			"of more tokens: give llm.PerMinute(%s) for a bucket of a minute's tokens, or set the Burst",
			profile, field, lim, minute))
	}
	return lim
}

// maxUsage bounds what a UsageReader keeps of a body: a usage object, or
// one event of a stream.
const maxUsage = 64 << 10

// jsonUsage reads a JSON body's top-level usage object as it streams by.
type jsonUsage struct {
	f    *usage.Field
	read func([]byte) (quota.Usage, bool)
}

func (j *jsonUsage) Write(p []byte) (int, error) { return j.f.Write(p) }

func (j *jsonUsage) Usage() (quota.Usage, bool) {
	v, ok := j.f.Value()
	if !ok {
		return nil, false
	}
	return j.read(v)
}

// lastUsage reads the usage of an event stream whose events may each tell
// the usage so far in a top-level field, the last one final: an OpenAI
// stream's last chunk (with stream_options.include_usage), each chunk of
// a Gemini alt=sse stream.
type lastUsage struct {
	events usage.Events
	field  *usage.Field
	used   quota.Usage
}

// newLastUsage returns the lastUsage of the field called name, read by
// read.
func newLastUsage(name string, read func([]byte) (quota.Usage, bool)) *lastUsage {
	s := &lastUsage{field: usage.NewField(name, maxUsage)}
	s.events.Max = maxUsage
	s.events.On = func(_ string, data []byte) {
		s.field.Reset()
		_, _ = s.field.Write(data)
		if v, ok := s.field.Value(); ok {
			if u, ok := read(v); ok {
				s.used = u
			}
		}
	}
	return s
}

func (s *lastUsage) Write(p []byte) (int, error) { return s.events.Write(p) }

func (s *lastUsage) Usage() (quota.Usage, bool) {
	s.events.Close()
	return s.used, s.used != nil
}

// isEventStream reports whether resp is a server-sent event stream.
func isEventStream(resp *http.Response) bool {
	t, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	return t == "text/event-stream"
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
			if r, ok := ratelimit.Params(item)["r"]; ok && known[policy] && r >= 0 {
				if old, seen := out[policy]; !seen || r < old {
					out[policy] = r
				}
			}
		}
	}
	return out
}
