// Package llmfake provides a fake LLM API server for tests of client-side
// rate limiting.
//
// A [Server] is an [http.Handler], meant to be served with
// net/http/httptest. It answers either the Anthropic Messages API
// (POST /v1/messages) or the OpenAI Chat Completions API
// (POST /v1/chat/completions), or an Azure OpenAI deployment's or Amazon
// Bedrock's, as [Azure] and [Bedrock] say (azure.go, bedrock.go), meters
// every request against continuous token buckets the way the providers
// document their limits, and refuses a
// request that would take a meter below zero with 429 Too Many Requests and
// a Retry-After header. Like the real providers it reports the tokens an
// answer used only in the answer itself: in the usage object of the JSON
// body, or in the events of a server-sent-event stream. It records every
// request it admitted, so that tests can compute the rates a client
// achieved. Kind Gemini answers Google's Gemini API in its own format,
// described in gemini.go: its 429 tells the wait in the error's RetryInfo
// detail, not in a header.
//
// # Metering
//
// Each meter is a bucket that starts full, refills continuously at its
// Rate a second and holds at most its Burst. A request is admitted only if
// every limited meter can pay its charge; otherwise nothing is charged and
// the answer is a 429 whose Retry-After is the whole number of seconds
// (rounded up, at least 1) until the refill alone would cover the charge.
// When several meters are short, the one that would take longest counts.
// A request whose charge exceeds a meter's Burst is refused every time.
// The 429's JSON error is Anthropic's rate_limit_error, or OpenAI's
// rate_limit_exceeded with the refusing meter's name ("requests" or
// "tokens") as its type.
//
// Anthropic charges one request, the request's input tokens (see
// [InputTokens]) and its max_tokens as output tokens at admission, and
// gives back the output tokens the answer did not use (max_tokens minus
// used) when the answer ends. OpenAI charges one request and input tokens
// plus the maximum completion tokens to a single tokens meter at admission,
// and never gives anything back.
//
// # Headers
//
// Every metered answer, admitted or refused, carries the provider's
// rate-limit headers for the limited meters (unlimited meters have none),
// describing the levels right after metering: for Anthropic
// anthropic-ratelimit-{requests,input-tokens,output-tokens}-{limit,remaining,reset},
// the reset an RFC 3339 UTC time when the bucket would be full again; for
// OpenAI x-ratelimit-{limit,remaining,reset}-{requests,tokens}, the reset
// a Go-style duration such as 6m0s or 1.5s until the bucket would be full.
// Limits and remaining counts are whole numbers, rounded down; resets are
// rounded up to the millisecond. A 429 also carries Retry-After, and for
// Anthropic x-should-retry: true. Anthropic answers carry a request-id
// header, OpenAI answers x-request-id.
//
// # Answers
//
// An admitted answer takes the server's Latency from admission to its last
// byte. A JSON answer is written whole after Latency; a stream sends its
// headers at admission and spreads its events evenly over Latency, the
// first at admission and the last at the end. The text of an answer is a
// short fixed string; its length has nothing to do with the output tokens
// reported, which come from [Server.Used].
package llmfake

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Kind selects the API a [Server] imitates.
type Kind int

const (
	// Anthropic is the Anthropic Messages API: POST /v1/messages.
	Anthropic Kind = iota
	// OpenAI is the OpenAI Chat Completions API: POST /v1/chat/completions.
	OpenAI
	// Gemini is Google's Gemini API: POST
	// /v1beta/models/{model}:generateContent and :streamGenerateContent
	// (see gemini.go).
	Gemini
	// Azure is an Azure OpenAI deployment's Chat Completions API (see
	// azure.go): POST /openai/deployments/{deployment}/chat/completions.
	Azure
	// Bedrock is Amazon Bedrock's Converse, ConverseStream and
	// InvokeModel APIs (see bedrock.go): POST /model/{modelId}/converse,
	// /converse-stream and /invoke.
	Bedrock
)

// Limits are the provider's limits, as continuous token buckets: Rate a
// second, holding at most Burst (Anthropic's buckets hold a minute of rate;
// tests scale them to seconds). A zero Rate is no limit on that meter.
//
// Anthropic uses Requests, InputTokens and OutputTokens; OpenAI uses
// Requests and Tokens; Gemini uses Requests and InputTokens. The meters a
// kind does not use are ignored.
type Limits struct {
	// Requests is charged one per request, for both kinds.
	Requests Bucket
	// InputTokens is charged the request's input tokens (Anthropic,
	// Gemini).
	InputTokens Bucket
	// OutputTokens is charged max_tokens at admission and given back what
	// the answer did not use when it ends (Anthropic).
	OutputTokens Bucket
	// Tokens is charged input + max_tokens at admission, never given back
	// (OpenAI, Azure); or input + max_tokens × OutputBurndown at
	// admission, given back what the answer did not use when it ends
	// (Bedrock).
	Tokens Bucket
	// OutputBurndown is how many tokens of Tokens an output token takes
	// (Bedrock); 0 means 1.
	OutputBurndown int
}

// Bucket is one meter's limit: a bucket that refills at Rate a second and
// holds at most Burst, which is also its level when the server starts.
// A Rate of zero or less means the meter has no limit.
type Bucket struct{ Rate, Burst float64 }

// Server is a fake LLM API server. Set its fields before the first request
// and do not change them afterwards; its methods are safe for concurrent
// use. A Server must not be copied after first use.
type Server struct {
	// Kind is the API the server imitates.
	Kind Kind
	// Limits are the buckets requests are metered against.
	Limits Limits
	// Latency is how long an answer takes, from admission to its last byte
	// (a stream spreads it over its events).
	Latency time.Duration
	// Used returns the output tokens an answer uses, given the request's
	// max_tokens; nil: a deterministic pseudo-random spread from 10% to 60%
	// of max_tokens (mean 35%), at least 1. A result outside 0..max_tokens
	// is clamped into it. Used is called at admission with the server's
	// lock held, one call at a time, in admission order.
	Used func(maxTokens int) int

	mu        sync.Mutex
	meters    []*meter // the kind's meters, in charge order; nil before the first request
	output    *meter   // Anthropic's output-tokens meter, which gets tokens back
	records   []Record
	refused   int
	refusedBy map[string]int
	seq       uint64 // answers numbered so far, admitted or not, for ids
}

// Record is one admitted request.
type Record struct {
	At      time.Time // admission
	Input   int       // input tokens counted
	Max     int       // max_tokens asked
	Output  int       // output tokens used
	Charged int       // OpenAI, Azure: what the tokens meter was charged (input + max); Bedrock: input + output × burndown
	Stream  bool      // whether the answer was a stream
	Worker  string    // the request's X-Quota-Worker header
}

// Records returns a copy of the records of the requests admitted so far,
// in admission order.
func (s *Server) Records() []Record {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]Record, len(s.records))
	copy(out, s.records)
	return out
}

// Refused returns how many requests were answered 429 Too Many Requests.
func (s *Server) Refused() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.refused
}

// RefusedBy returns a copy of the counts of 429 answers by the meter that
// refused: "requests", "input_tokens", "output_tokens" or "tokens". When
// several meters were short, the one that would take longest to refill
// counts (the one Retry-After is computed from), so the counts add up to
// [Server.Refused]. Meters that refused nothing are absent.
func (s *Server) RefusedBy() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[string]int, len(s.refusedBy))
	for k, v := range s.refusedBy {
		out[k] = v
	}
	return out
}

// meter is the state of one bucket.
type meter struct {
	name   string // the meter's name in RefusedBy
	header string // the meter's name in rate-limit headers
	Bucket
	level float64   // tokens in the bucket at time at
	at    time.Time // when level was last brought up to date
}

// limited reports whether the meter has a limit.
func (m *meter) limited() bool { return m.Rate > 0 }

// refill brings the level up to date at now.
func (m *meter) refill(now time.Time) {
	if !m.limited() {
		return
	}
	if now.After(m.at) {
		m.level = math.Min(m.Burst, m.level+m.Rate*now.Sub(m.at).Seconds())
		m.at = now
	}
}

// untilFull is how long, from the last refill, the bucket takes to fill up.
func (m *meter) untilFull() time.Duration {
	if m.level >= m.Burst {
		return 0
	}
	return seconds((m.Burst - m.level) / m.Rate)
}

// seconds converts a number of seconds to a Duration, saturating instead
// of overflowing.
func seconds(f float64) time.Duration {
	const most = float64(math.MaxInt64 / 2)
	ns := f * float64(time.Second)
	if ns >= most {
		return time.Duration(most)
	}
	return time.Duration(ns)
}

// maxBody bounds the request bodies the server reads.
const maxBody = 32 << 20

// defaultMax is OpenAI's charge for the completion when the request sets
// neither max_completion_tokens nor max_tokens.
const defaultMax = 4096

// request holds the fields of a request body the server looks at.
type request struct {
	Model               string    `json:"model"`
	Messages            []message `json:"messages"`
	MaxTokens           *int      `json:"max_tokens"`
	MaxCompletionTokens *int      `json:"max_completion_tokens"`
	Stream              bool      `json:"stream"`
	StreamOptions       *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options"`
}

// message is one message of a request; only its content counts.
type message struct {
	Content json.RawMessage `json:"content"`
}

// InputTokens is how the server counts a request's input tokens: one per 4
// bytes of the text of its messages' content (string content, or the
// "text" of content blocks), rounded up, plus 3 per message. Exported so
// tests know the true count.
//
// A Gemini request's contents count the same way: the text of their
// parts, plus 3 per content. The bytes of all messages are added up
// before rounding. Other fields, such as Anthropic's top-level "system",
// do not count. A body that is not a JSON object counts 0.
func InputTokens(body []byte) int {
	var req struct {
		Messages []message       `json:"messages"`
		Contents []geminiContent `json:"contents"` // Gemini's
	}
	if json.Unmarshal(body, &req) != nil {
		return 0
	}
	return countInput(req.Messages) + countContents(req.Contents)
}

// countInput counts the input tokens of messages, as [InputTokens] does.
func countInput(msgs []message) int {
	n := 0
	for _, m := range msgs {
		n += textBytes(m.Content)
	}
	return (n+3)/4 + 3*len(msgs)
}

// textBytes is the length in bytes of the text of one message's content:
// the string itself, or the sum of the "text" members of an array of
// content blocks. Anything else has no text.
func textBytes(content json.RawMessage) int {
	var s string
	if json.Unmarshal(content, &s) == nil {
		return len(s)
	}
	var blocks []json.RawMessage
	if json.Unmarshal(content, &blocks) != nil {
		return 0
	}
	n := 0
	for _, b := range blocks {
		var block struct {
			Text string `json:"text"`
		}
		if json.Unmarshal(b, &block) == nil {
			n += len(block.Text)
		}
	}
	return n
}

// answerPieces are the pieces of the text of every answer; a stream sends
// one piece an event.
var answerPieces = []string{"Hello", " from the", " fake", " server."}

// answerText is the text of every answer.
var answerText = strings.Join(answerPieces, "")

// admission is the outcome of metering one request.
type admission struct {
	ok      bool
	seq     uint64      // the answer's number, for ids
	at      time.Time   // when the request was metered
	headers http.Header // rate-limit headers, as of right after metering

	// An admitted request.
	input    int // input tokens
	max      int // max_tokens asked
	used     int // output tokens the answer uses
	giveBack int // output tokens to give back when the answer ends

	// A refused request.
	retryAfter int     // seconds
	wait       float64 // seconds until the refill alone covers the charge
	by         string  // the meter that refused
	message    string  // the error message
}

// ServeHTTP answers one API request. A request to another path than the
// kind's is answered 404 Not Found, one with another method than POST 405
// Method Not Allowed, and one whose body is not JSON, lacks Anthropic's
// required max_tokens or asks for fewer than 1 token 400 Bad Request; none
// of these is metered or recorded. Otherwise the request is metered: a
// refused one is answered 429 Too Many Requests at once, an admitted one
// 200 OK over the server's Latency (see the package documentation).
// Errors have the kind's JSON error shape.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	var path string
	switch s.Kind {
	case Gemini:
		s.serveGemini(w, r)
		return
	case Anthropic:
		path = "/v1/messages"
	case OpenAI:
		path = "/v1/chat/completions"
	case Azure:
		if !s.azureRoute(w, r) {
			return
		}
		path = r.URL.Path
	case Bedrock:
		s.serveBedrock(w, r)
		return
	default:
		http.Error(w, fmt.Sprintf("llmfake: unknown Kind %d", int(s.Kind)), http.StatusInternalServerError)
		return
	}
	if r.URL.Path != path {
		typ := "not_found_error"
		if s.Kind != Anthropic {
			typ = "invalid_request_error"
		}
		s.writeError(w, http.StatusNotFound, typ, "unknown_url", "Unknown request URL: "+r.Method+" "+r.URL.Path)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		s.writeError(w, http.StatusMethodNotAllowed, "invalid_request_error", "method_not_allowed", "Method not allowed: "+r.Method)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		s.writeError(w, http.StatusBadRequest, "invalid_request_error", "", "reading the request body: "+err.Error())
		return
	}
	var req request
	if err := json.Unmarshal(body, &req); err != nil {
		s.writeError(w, http.StatusBadRequest, "invalid_request_error", "", "The request body is not valid JSON: "+err.Error())
		return
	}
	var maxTokens int
	switch {
	case s.Kind == Anthropic && req.MaxTokens == nil:
		s.writeError(w, http.StatusBadRequest, "invalid_request_error", "", "max_tokens: Field required")
		return
	case s.Kind == Anthropic:
		maxTokens = *req.MaxTokens
	case req.MaxCompletionTokens != nil:
		maxTokens = *req.MaxCompletionTokens
	case req.MaxTokens != nil:
		maxTokens = *req.MaxTokens
	default:
		maxTokens = defaultMax
	}
	if maxTokens < 1 {
		s.writeError(w, http.StatusBadRequest, "invalid_request_error", "", "max_tokens: must be at least 1")
		return
	}

	a := s.admit(countInput(req.Messages), maxTokens, req.Stream, r.Header.Get("X-Quota-Worker"))
	if !a.ok {
		s.refuse(w, a)
		return
	}

	finish := s.finisher(a)
	includeUsage := req.StreamOptions != nil && req.StreamOptions.IncludeUsage
	switch {
	case s.Kind == Anthropic && req.Stream:
		s.stream(r.Context(), w, a, anthropicEvents(a, req.Model), finish)
	case s.Kind == Anthropic:
		s.answer(r.Context(), w, a, anthropicBody(a, req.Model), finish)
	case req.Stream:
		s.stream(r.Context(), w, a, openAIEvents(a, req.Model, includeUsage), finish)
	default:
		s.answer(r.Context(), w, a, openAIBody(a, req.Model), finish)
	}
}

// finisher returns what runs when the answer to a ends: right before its
// last byte is written, or at its planned end if the client went away
// before. It gives back the output a's answer did not use.
func (s *Server) finisher(a admission) func() {
	if a.giveBack <= 0 {
		return func() {}
	}
	var once sync.Once
	give := func() { once.Do(func() { s.giveBackOutput(a.giveBack) }) }
	timer := time.AfterFunc(time.Until(a.at.Add(s.Latency)), give)
	return func() {
		timer.Stop()
		give()
	}
}

// admit meters a request of input tokens asking for maxTokens: it charges
// every meter and records the request, or charges nothing if a limited
// meter is short.
func (s *Server) admit(input, maxTokens int, stream bool, worker string) admission {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	s.start(now)
	s.seq++
	a := admission{seq: s.seq, at: now, input: input, max: maxTokens}

	var charges []float64
	switch s.Kind {
	case Anthropic:
		charges = []float64{1, float64(input), float64(maxTokens)}
	case OpenAI, Azure:
		charges = []float64{1, float64(input + maxTokens)}
	case Gemini:
		charges = []float64{1, float64(input)}
	case Bedrock:
		charges = []float64{1, float64(input + maxTokens*s.burndown())}
	}

	// Find the meter that would take longest to cover its charge.
	var short *meter
	var need, wait float64
	for i, m := range s.meters {
		m.refill(now)
		if !m.limited() || m.level-charges[i] >= 0 {
			continue
		}
		if w := (charges[i] - m.level) / m.Rate; short == nil || w > wait {
			short, need, wait = m, charges[i], w
		}
	}
	if short != nil {
		s.refused++
		if s.refusedBy == nil {
			s.refusedBy = make(map[string]int)
		}
		s.refusedBy[short.name]++
		a.by = short.name
		a.retryAfter = int(math.Max(1, math.Min(math.Ceil(wait), math.MaxInt32)))
		a.wait = wait
		a.message = s.refusal(short, need, a.retryAfter)
		a.headers = s.rateHeaders(now)
		return a
	}

	for i, m := range s.meters {
		if m.limited() {
			m.level -= charges[i]
		}
	}
	a.ok = true
	a.used = s.used(maxTokens)
	if s.output != nil && s.output.limited() {
		a.giveBack = (maxTokens - a.used) * s.burndown()
	}
	rec := Record{At: now, Input: input, Max: maxTokens, Output: a.used, Stream: stream, Worker: worker}
	switch s.Kind {
	case OpenAI, Azure:
		rec.Charged = input + maxTokens
	case Bedrock:
		rec.Charged = input + a.used*s.burndown()
	}
	s.records = append(s.records, rec)
	a.headers = s.rateHeaders(now)
	return a
}

// start sets up the meters, full, on the first request. s.mu is held.
func (s *Server) start(now time.Time) {
	if s.meters != nil {
		return
	}
	mk := func(name, header string, b Bucket) *meter {
		return &meter{name: name, header: header, Bucket: b, level: b.Burst, at: now}
	}
	switch s.Kind {
	case Anthropic:
		s.output = mk("output_tokens", "output-tokens", s.Limits.OutputTokens)
		s.meters = []*meter{
			mk("requests", "requests", s.Limits.Requests),
			mk("input_tokens", "input-tokens", s.Limits.InputTokens),
			s.output,
		}
	case OpenAI, Azure, Bedrock:
		s.meters = []*meter{
			mk("requests", "requests", s.Limits.Requests),
			mk("tokens", "tokens", s.Limits.Tokens),
		}
		if s.Kind == Bedrock {
			s.output = s.meters[1] // Bedrock gives back to its one tokens meter
		}
	case Gemini:
		s.meters = []*meter{
			mk("requests", "requests", s.Limits.Requests),
			mk("input_tokens", "input-tokens", s.Limits.InputTokens),
		}
	}
}

// used is the output tokens the answer to a request asking for maxTokens
// uses. s.mu is held.
func (s *Server) used(maxTokens int) int {
	var n int
	if s.Used != nil {
		n = s.Used(maxTokens)
	} else {
		// The fraction is uniform in [0.1, 0.6), drawn from the number of
		// requests admitted before this one.
		u := float64(splitmix64(uint64(len(s.records)))>>11) / (1 << 53)
		n = max(1, int(math.Round(float64(maxTokens)*(0.1+0.5*u))))
	}
	return min(max(n, 0), maxTokens)
}

// splitmix64 is the SplitMix64 mixing function: distinct inputs give
// well-spread, distinct outputs.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// refusal is the error message of a 429 refused by meter m, which was short
// of need. s.mu is held.
func (s *Server) refusal(m *meter, need float64, retryAfter int) string {
	if s.Kind == Gemini {
		return geminiRefusal(m, need)
	}
	if s.Kind == OpenAI {
		return fmt.Sprintf("Rate limit reached on %s: Limit %g, Remaining %d, Requested %g. Please try again in %ds.",
			m.name, m.Burst, int(math.Floor(math.Max(0, m.level))), need, retryAfter)
	}
	return fmt.Sprintf("This request would exceed the rate limit of %g %s (refilled at %g a second; %d remaining, %g requested). Please retry after %d seconds.",
		m.Burst, strings.ReplaceAll(m.name, "_", " "), m.Rate, int(math.Floor(math.Max(0, m.level))), need, retryAfter)
}

// giveBackOutput returns n tokens to Anthropic's output-tokens meter, or
// Bedrock's tokens meter.
func (s *Server) giveBackOutput(n int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.output.refill(time.Now())
	s.output.level = math.Min(s.output.Burst, s.output.level+float64(n))
}

// rateHeaders are the rate-limit headers describing the limited meters'
// levels at now. s.mu is held.
//
// Anthropic's are anthropic-ratelimit-<meter>-limit, -remaining and -reset,
// the last an RFC 3339 time (UTC, to the millisecond, rounded up) when the
// bucket would be full again. OpenAI's are x-ratelimit-limit-<meter>,
// x-ratelimit-remaining-<meter> and x-ratelimit-reset-<meter>, the last a
// Go-style duration (to the millisecond, rounded up) until the bucket
// would be full. Limits and remaining counts are whole numbers, rounded
// down.
func (s *Server) rateHeaders(now time.Time) http.Header {
	h := http.Header{}
	for _, m := range s.meters {
		if !m.limited() {
			continue
		}
		limit := count(m.Burst)
		remaining := count(m.level)
		reset := m.untilFull()
		switch s.Kind {
		case Anthropic:
			p := "anthropic-ratelimit-" + m.header
			h.Set(p+"-limit", limit)
			h.Set(p+"-remaining", remaining)
			h.Set(p+"-reset", ceilMillis(now.Add(reset)).UTC().Format("2006-01-02T15:04:05.000Z07:00"))
		case OpenAI, Azure:
			h.Set("x-ratelimit-limit-"+m.header, limit)
			h.Set("x-ratelimit-remaining-"+m.header, remaining)
			h.Set("x-ratelimit-reset-"+m.header, ceilDuration(reset).String())
		}
	}
	return h
}

// count formats a bucket level as a whole number, rounded down, at least 0.
func count(f float64) string {
	return strconv.FormatInt(int64(math.Floor(math.Max(0, f))), 10)
}

// ceilMillis rounds t up to a whole millisecond.
func ceilMillis(t time.Time) time.Time {
	r := t.Truncate(time.Millisecond)
	if r.Before(t) {
		r = r.Add(time.Millisecond)
	}
	return r
}

// ceilDuration rounds d up to a whole millisecond.
func ceilDuration(d time.Duration) time.Duration {
	r := d.Truncate(time.Millisecond)
	if r < d {
		r += time.Millisecond
	}
	return r
}

// requestID is the request id header's name and value for answer seq.
func (s *Server) requestID(seq uint64) (string, string) {
	switch s.Kind {
	case OpenAI, Azure:
		return "x-request-id", fmt.Sprintf("req_%016x", seq)
	case Bedrock:
		return "x-amzn-RequestId", fmt.Sprintf("00000000-0000-4000-8000-%012x", seq)
	}
	return "request-id", fmt.Sprintf("req_%016x", seq)
}

// refuse writes the 429 answer to a refused request.
func (s *Server) refuse(w http.ResponseWriter, a admission) {
	switch s.Kind {
	case Azure:
		s.refuseAzure(w, a)
		return
	case Bedrock:
		s.refuseBedrock(w, a)
		return
	}
	h := w.Header()
	copyHeader(h, a.headers)
	k, v := s.requestID(a.seq)
	h.Set(k, v)
	h.Set("Retry-After", strconv.Itoa(a.retryAfter))
	if s.Kind == Anthropic {
		h.Set("x-should-retry", "true")
		s.writeError(w, http.StatusTooManyRequests, "rate_limit_error", "", a.message)
		return
	}
	s.writeError(w, http.StatusTooManyRequests, a.by, "rate_limit_exceeded", a.message)
}

// writeError writes an error answer in the kind's format. For OpenAI, typ
// is the error's "type" and code its "code" (null when empty); Anthropic's
// errors have no code.
func (s *Server) writeError(w http.ResponseWriter, status int, typ, code, msg string) {
	var body []byte
	if s.Kind != Anthropic {
		type detail struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    *string `json:"code"`
		}
		d := detail{Message: msg, Type: typ}
		if code != "" {
			d.Code = &code
		}
		body = marshal(struct {
			Error detail `json:"error"`
		}{d})
	} else {
		type detail struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		}
		body = marshal(struct {
			Type  string `json:"type"`
			Error detail `json:"error"`
		}{"error", detail{typ, msg}})
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// copyHeader adds the values of src to dst.
func copyHeader(dst, src http.Header) {
	for k, vs := range src {
		for _, v := range vs {
			dst.Add(k, v)
		}
	}
}

// answer writes a JSON answer at the end of the server's Latency, unless
// the client goes away first.
func (s *Server) answer(ctx context.Context, w http.ResponseWriter, a admission, body []byte, finish func()) {
	if !sleepUntil(ctx, a.at.Add(s.Latency)) {
		return
	}
	finish()
	h := w.Header()
	copyHeader(h, a.headers)
	k, v := s.requestID(a.seq)
	h.Set(k, v)
	h.Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	_, _ = w.Write(body)
}

// stream writes a stream's headers at once and its events spread evenly
// over the server's Latency, the first at admission and the last at the
// end, flushing after each. It stops when the client goes away.
func (s *Server) stream(ctx context.Context, w http.ResponseWriter, a admission, events [][]byte, finish func()) {
	s.streamAs(ctx, w, a, "text/event-stream", events, finish)
}

// streamAs is stream with the Content-Type contentType.
func (s *Server) streamAs(ctx context.Context, w http.ResponseWriter, a admission, contentType string, events [][]byte, finish func()) {
	flusher, _ := w.(http.Flusher)
	flush := func() {
		if flusher != nil {
			flusher.Flush()
		}
	}
	h := w.Header()
	copyHeader(h, a.headers)
	k, v := s.requestID(a.seq)
	h.Set(k, v)
	if h.Get("Content-Type") == "" { // Gemini's JSON array sets its own
		h.Set("Content-Type", contentType)
	}
	h.Set("Cache-Control", "no-cache")
	w.WriteHeader(http.StatusOK)
	flush()
	for i, ev := range events {
		var at time.Time
		if last := len(events) - 1; last > 0 {
			at = a.at.Add(s.Latency * time.Duration(i) / time.Duration(last))
		} else {
			at = a.at.Add(s.Latency)
		}
		if !sleepUntil(ctx, at) {
			return
		}
		if i == len(events)-1 {
			finish()
		}
		if _, err := w.Write(ev); err != nil {
			return
		}
		flush()
	}
}

// sleepUntil waits until t and reports whether ctx is still live then; it
// returns false as soon as ctx is done.
func sleepUntil(ctx context.Context, t time.Time) bool {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err() == nil
	}
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// marshal encodes v, which is always encodable, as JSON.
func marshal(v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		panic("llmfake: " + err.Error())
	}
	return b
}

// The JSON shapes of Anthropic answers.
type (
	anthropicMessage struct {
		ID           string           `json:"id"`
		Type         string           `json:"type"`
		Role         string           `json:"role"`
		Model        string           `json:"model"`
		Content      []anthropicBlock `json:"content"`
		StopReason   *string          `json:"stop_reason"`
		StopSequence *string          `json:"stop_sequence"`
		Usage        anthropicUsage   `json:"usage"`
	}
	anthropicBlock struct {
		Type string `json:"type"`
		Text string `json:"text"`
	}
	anthropicUsage struct {
		InputTokens              int `json:"input_tokens"`
		CacheCreationInputTokens int `json:"cache_creation_input_tokens"`
		CacheReadInputTokens     int `json:"cache_read_input_tokens"`
		OutputTokens             int `json:"output_tokens"`
	}
)

// anthropicBody is the JSON answer to an admitted Anthropic request.
func anthropicBody(a admission, model string) []byte {
	endTurn := "end_turn"
	return marshal(anthropicMessage{
		ID:         fmt.Sprintf("msg_%016x", a.seq),
		Type:       "message",
		Role:       "assistant",
		Model:      model,
		Content:    []anthropicBlock{{Type: "text", Text: answerText}},
		StopReason: &endTurn,
		Usage:      anthropicUsage{InputTokens: a.input, OutputTokens: a.used},
	})
}

// anthropicEvents are the events of the stream answering an admitted
// Anthropic request.
func anthropicEvents(a admission, model string) [][]byte {
	event := func(typ string, v any) []byte {
		return []byte("event: " + typ + "\ndata: " + string(marshal(v)) + "\n\n")
	}
	type typed struct {
		Type string `json:"type"`
	}
	type indexed struct {
		Type  string `json:"type"`
		Index int    `json:"index"`
	}
	events := [][]byte{
		event("message_start", struct {
			Type    string           `json:"type"`
			Message anthropicMessage `json:"message"`
		}{"message_start", anthropicMessage{
			ID:      fmt.Sprintf("msg_%016x", a.seq),
			Type:    "message",
			Role:    "assistant",
			Model:   model,
			Content: []anthropicBlock{},
			Usage:   anthropicUsage{InputTokens: a.input, OutputTokens: 1},
		}}),
		event("content_block_start", struct {
			Type         string         `json:"type"`
			Index        int            `json:"index"`
			ContentBlock anthropicBlock `json:"content_block"`
		}{"content_block_start", 0, anthropicBlock{Type: "text"}}),
	}
	for _, p := range answerPieces {
		events = append(events, event("content_block_delta", struct {
			Type  string         `json:"type"`
			Index int            `json:"index"`
			Delta anthropicBlock `json:"delta"`
		}{"content_block_delta", 0, anthropicBlock{Type: "text_delta", Text: p}}))
	}
	endTurn := "end_turn"
	type delta struct {
		StopReason   *string `json:"stop_reason"`
		StopSequence *string `json:"stop_sequence"`
	}
	type usage struct {
		OutputTokens int `json:"output_tokens"`
	}
	return append(events,
		event("content_block_stop", indexed{"content_block_stop", 0}),
		event("message_delta", struct {
			Type  string `json:"type"`
			Delta delta  `json:"delta"`
			Usage usage  `json:"usage"`
		}{"message_delta", delta{StopReason: &endTurn}, usage{a.used}}),
		event("message_stop", typed{"message_stop"}),
	)
}

// openAIUsage is the usage object of OpenAI answers.
type openAIUsage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// usageOf is the usage object of an admitted OpenAI request's answer.
func usageOf(a admission) openAIUsage {
	return openAIUsage{PromptTokens: a.input, CompletionTokens: a.used, TotalTokens: a.input + a.used}
}

// openAIBody is the JSON answer to an admitted OpenAI request.
func openAIBody(a admission, model string) []byte {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	type choice struct {
		Index        int    `json:"index"`
		Message      msg    `json:"message"`
		FinishReason string `json:"finish_reason"`
	}
	return marshal(struct {
		ID      string      `json:"id"`
		Object  string      `json:"object"`
		Created int64       `json:"created"`
		Model   string      `json:"model"`
		Choices []choice    `json:"choices"`
		Usage   openAIUsage `json:"usage"`
	}{
		ID:      fmt.Sprintf("chatcmpl-%016x", a.seq),
		Object:  "chat.completion",
		Created: a.at.Unix(),
		Model:   model,
		Choices: []choice{{Message: msg{"assistant", answerText}, FinishReason: "stop"}},
		Usage:   usageOf(a),
	})
}

// openAIEvents are the events of the stream answering an admitted OpenAI
// request: a chunk a piece of text, a chunk with the finish reason, with
// includeUsage a chunk with the usage and no choices (every chunk then has
// a usage member, null but in the last), and [DONE].
func openAIEvents(a admission, model string, includeUsage bool) [][]byte {
	type delta struct {
		Content string `json:"content,omitempty"`
	}
	type choice struct {
		Index        int     `json:"index"`
		Delta        delta   `json:"delta"`
		FinishReason *string `json:"finish_reason"`
	}
	type chunk struct {
		ID      string          `json:"id"`
		Object  string          `json:"object"`
		Created int64           `json:"created"`
		Model   string          `json:"model"`
		Choices []choice        `json:"choices"`
		Usage   json.RawMessage `json:"usage,omitempty"`
	}
	var null json.RawMessage
	if includeUsage {
		null = json.RawMessage("null")
	}
	event := func(choices []choice, usage json.RawMessage) []byte {
		return []byte("data: " + string(marshal(chunk{
			ID:      fmt.Sprintf("chatcmpl-%016x", a.seq),
			Object:  "chat.completion.chunk",
			Created: a.at.Unix(),
			Model:   model,
			Choices: choices,
			Usage:   usage,
		})) + "\n\n")
	}
	var events [][]byte
	for _, p := range answerPieces {
		events = append(events, event([]choice{{Delta: delta{p}}}, null))
	}
	stop := "stop"
	events = append(events, event([]choice{{FinishReason: &stop}}, null))
	if includeUsage {
		events = append(events, event([]choice{}, marshal(usageOf(a))))
	}
	return append(events, []byte("data: [DONE]\n\n"))
}
