package llm

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/usage"
)

// GeminiLimits are a Gemini API project's limits for a model, as AI
// Studio shows them; the requests a minute (RPM) are the Transport's
// Limit. Gemini's tokens a minute (TPM) count a request's input tokens,
// not its output; the bucket needs a Burst that holds a request's input,
// as PerMinute's minute does (see the package's doc).
//
// The requests a day (RPD) reset at midnight Pacific time: a count, not a
// rate, which RequestsPerDay meters as a quota.Daily of its own.
type GeminiLimits struct {
	InputTokens quota.Limit // TPM, a minute, e.g. llm.PerMinute(1000000)
	// RequestsPerDay is the RPD, metered as MeterRequestsPerDay, a
	// quota.Daily that refills at midnight in America/Los_Angeles; 0: not
	// metered.
	RequestsPerDay float64
	// EstimateInput estimates a request's input tokens from its body;
	// nil: EstimateInput.
	EstimateInput func(body []byte) float64
}

// Gemini returns the Metering of Google's Gemini API (generateContent and
// streamGenerateContent), as Gemini counts: a request reserves 1 request
// and its estimated input tokens, the whole JSON body's (contents, system
// instruction and tools all count as the prompt), and is settled with the
// input tokens its answer reports, usageMetadata's promptTokenCount (with
// the cached content it includes) and toolUsePromptTokenCount, in the
// JSON body, or in the last chunk that tells them of a stream, with
// alt=sse or without (a JSON array). The output (candidatesTokenCount,
// thoughtsTokenCount) counts against no limit of Gemini's, and
// maxOutputTokens reserves nothing. A request to another method
// (countTokens, embedContent) reserves the request alone. Gemini sends
// no rate-limit headers; its 429
// RESOURCE_EXHAUSTED tells the wait in the RetryInfo of its error body,
// which pauses the shared bucket as Retry-After does. Every request
// takes one of RequestsPerDay, which no answer gives back. It panics if InputTokens has no
// Burst, if RequestsPerDay is below 0 or not finite, or if it is set and
// the time zone database has no America/Los_Angeles (import time/tzdata
// to embed it).
func Gemini(lim GeminiLimits) quota.Metering {
	estimate := lim.EstimateInput
	if estimate == nil {
		estimate = EstimateInput
	}
	meters := []quota.Meter{{Name: MeterInputTokens, Limit: tokens("Gemini", "InputTokens", lim.InputTokens)}}
	perDay := geminiDay(lim.RequestsPerDay)
	if perDay != nil {
		meters = append(meters, *perDay)
	}
	return quota.Metering{
		Meters: meters, // the usage leaves out the requests a day: kept
		Estimate: func(req *http.Request, body []byte) (quota.Usage, error) {
			u := quota.Usage{}
			if perDay != nil {
				u[MeterRequestsPerDay] = 1
			}
			if body == nil || !generates(req) {
				return u, nil
			}
			if !json.Valid(body) {
				return nil, errors.New("the body is not JSON")
			}
			u[MeterInputTokens] = estimate(body)
			return u, nil
		},
		Usage: func(resp *http.Response) quota.UsageReader {
			if resp.StatusCode/100 != 2 {
				return nil
			}
			if isEventStream(resp) {
				return newLastUsage("usageMetadata", geminiUsage)
			}
			return &geminiJSON{field: usage.NewField("usageMetadata", maxUsage)}
		},
	}
}

// geminiDay returns the Meter of n requests a day, reset at midnight
// Pacific time, or nil for n = 0.
func geminiDay(n float64) *quota.Meter {
	if n == 0 {
		return nil
	}
	if !(n > 0) || math.IsInf(n, 0) {
		panic(fmt.Sprintf("llm.Gemini: RequestsPerDay %v, want 0 (not metered) or a finite number above it", n))
	}
	pacific, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		panic(fmt.Sprintf("llm.Gemini: RequestsPerDay resets at midnight Pacific time: %v (import time/tzdata to embed the zones)", err))
	}
	return &quota.Meter{Name: MeterRequestsPerDay, Limit: quota.Daily(n, 0, pacific)}
}

// geminiJSON reads the usage of a JSON answer: an object, whose
// usageMetadata tells it, or an array, a stream without alt=sse, whose
// elements each tell the usage so far, the last one final.
type geminiJSON struct {
	field *usage.Field
	form  byte // the answer's first byte: '{', '[', or 0 before it
	depth int  // of an array: brackets open, the array's own included
	str   bool // of an array: inside a string
	esc   bool // of an array: the last byte was a backslash in a string
	used  quota.Usage
}

func (g *geminiJSON) Write(p []byte) (int, error) {
	if g.form == '{' {
		return g.field.Write(p)
	}
	for _, c := range p {
		if g.form == 0 && c != ' ' && c != '\t' && c != '\n' && c != '\r' {
			g.form = c
		}
		switch g.form {
		case '{':
			return g.field.Write(p) // the object, from its first byte on
		case '[':
			g.element(c)
		}
	}
	return len(p), nil
}

// element moves an array's scan on by c: the bytes of each element go to
// the field, reset at the element's start and read at its end.
func (g *geminiJSON) element(c byte) {
	before := g.depth
	switch {
	case g.str && g.esc:
		g.esc = false
	case g.str && c == '\\':
		g.esc = true
	case c == '"':
		g.str = !g.str
	case g.str:
	case c == '{' || c == '[':
		g.depth++
	case c == '}' || c == ']':
		g.depth--
	}
	if before == 1 && g.depth == 2 {
		g.field.Reset()
	}
	if before >= 2 || g.depth >= 2 {
		_, _ = g.field.Write([]byte{c})
	}
	if before == 2 && g.depth == 1 {
		g.read()
	}
}

// read keeps the usage the field holds, if it tells one.
func (g *geminiJSON) read() {
	if v, ok := g.field.Value(); ok {
		if u, ok := geminiUsage(v); ok {
			g.used = u
		}
	}
}

func (g *geminiJSON) Usage() (quota.Usage, bool) {
	if g.form == '{' {
		g.read()
	}
	return g.used, g.used != nil
}

// generates reports whether req calls generateContent or
// streamGenerateContent, whose input counts against the tokens a minute.
func generates(req *http.Request) bool {
	_, method, _ := strings.Cut(req.URL.Path[strings.LastIndex(req.URL.Path, "/")+1:], ":")
	return method == "generateContent" || method == "streamGenerateContent"
}

// geminiUsage reads Gemini's usageMetadata object: its input tokens, the
// prompt's (cached content included) and the tool-use prompt's.
func geminiUsage(v []byte) (quota.Usage, bool) {
	var u struct {
		Prompt  *float64 `json:"promptTokenCount"`
		ToolUse float64  `json:"toolUsePromptTokenCount"`
	}
	if json.Unmarshal(v, &u) != nil || u.Prompt == nil {
		return nil, false
	}
	return quota.Usage{MeterInputTokens: *u.Prompt + u.ToolUse}, true
}
