package llmfake

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"strings"
)

// Gemini's API, as the Gemini kind answers it
// (https://ai.google.dev/api/generate-content):
//
//   - POST /v1beta/models/{model}:generateContent (or /v1/...) answers one
//     GenerateContentResponse, its usageMetadata telling the tokens used;
//   - POST .../{model}:streamGenerateContent?alt=sse answers a server-sent
//     event stream, a "data:" chunk a piece of text, each chunk with the
//     usageMetadata so far and the last one final;
//   - without alt=sse, streamGenerateContent answers the same chunks as a
//     JSON array, streamed.
//
// Gemini's tokens a minute count the input tokens
// (https://ai.google.dev/gemini-api/docs/rate-limits: "Tokens per minute
// (input)"), charged at admission and never given back; the answer's
// output is not metered. Gemini sends no rate-limit headers, and its 429
// is a google.rpc error, RESOURCE_EXHAUSTED, with a QuotaFailure naming
// the quota and a RetryInfo whose retryDelay is the wait, in whole
// seconds rounded up, and no Retry-After header.

// geminiDefaultMax is what a Gemini request that sets no maxOutputTokens
// may answer.
const geminiDefaultMax = 8192

// geminiRequest holds the fields of a Gemini request body the server
// looks at.
type geminiRequest struct {
	Contents         []geminiContent `json:"contents"`
	GenerationConfig *struct {
		MaxOutputTokens *int `json:"maxOutputTokens"`
	} `json:"generationConfig"`
}

// geminiContent is one content of a Gemini request or answer.
type geminiContent struct {
	Role  string       `json:"role,omitempty"`
	Parts []geminiPart `json:"parts"`
}

// geminiPart is one part of a content; only text counts.
type geminiPart struct {
	Text string `json:"text,omitempty"`
}

// countContents counts the input tokens of Gemini contents, as
// [InputTokens] does: one per 4 bytes of the text of their parts, rounded
// up, plus 3 per content.
func countContents(contents []geminiContent) int {
	n := 0
	for _, c := range contents {
		for _, p := range c.Parts {
			n += len(p.Text)
		}
	}
	return (n+3)/4 + 3*len(contents)
}

// geminiMethod returns the method a Gemini path calls, generateContent or
// streamGenerateContent, or "" for a path that is not one of the API's.
func geminiMethod(path string) string {
	rest, ok := strings.CutPrefix(path, "/v1beta/models/")
	if !ok {
		rest, ok = strings.CutPrefix(path, "/v1/models/")
	}
	model, method, found := strings.Cut(rest, ":")
	if !ok || !found || model == "" || strings.Contains(model, "/") {
		return ""
	}
	if method == "generateContent" || method == "streamGenerateContent" {
		return method
	}
	return ""
}

// serveGemini answers one request to Gemini's API, as ServeHTTP does the
// other kinds'.
func (s *Server) serveGemini(w http.ResponseWriter, r *http.Request) {
	method := geminiMethod(r.URL.Path)
	if method == "" {
		geminiError(w, http.StatusNotFound, "NOT_FOUND", "Method not found: "+r.Method+" "+r.URL.Path, nil)
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		geminiError(w, http.StatusMethodNotAllowed, "INVALID_ARGUMENT", "Method not allowed: "+r.Method, nil)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		geminiError(w, http.StatusBadRequest, "INVALID_ARGUMENT", "reading the request body: "+err.Error(), nil)
		return
	}
	var req geminiRequest
	if err := json.Unmarshal(body, &req); err != nil {
		geminiError(w, http.StatusBadRequest, "INVALID_ARGUMENT", "Invalid JSON payload received. "+err.Error(), nil)
		return
	}
	maxTokens := geminiDefaultMax
	if c := req.GenerationConfig; c != nil && c.MaxOutputTokens != nil {
		maxTokens = *c.MaxOutputTokens
	}
	if maxTokens < 1 {
		geminiError(w, http.StatusBadRequest, "INVALID_ARGUMENT", "max_output_tokens must be positive.", nil)
		return
	}
	stream := method == "streamGenerateContent"
	a := s.admit(countContents(req.Contents), maxTokens, stream, r.Header.Get("X-Quota-Worker"))
	if !a.ok {
		s.refuseGemini(w, a)
		return
	}
	model := strings.TrimSuffix(r.URL.Path[strings.LastIndex(r.URL.Path, "/")+1:], ":"+method)
	done := func() {}
	switch {
	case !stream:
		s.answer(r.Context(), w, a, geminiBody(a, model), done)
	case r.URL.Query().Get("alt") == "sse":
		s.stream(r.Context(), w, a, geminiEvents(a, model), done)
	default:
		w.Header().Set("Content-Type", "application/json")
		s.stream(r.Context(), w, a, geminiArray(a, model), done)
	}
}

// The JSON shapes of Gemini answers.
type (
	geminiResponse struct {
		Candidates    []geminiCandidate `json:"candidates"`
		UsageMetadata geminiUsage       `json:"usageMetadata"`
		ModelVersion  string            `json:"modelVersion"`
		ResponseID    string            `json:"responseId"`
	}
	geminiCandidate struct {
		Content      geminiContent `json:"content"`
		FinishReason string        `json:"finishReason,omitempty"`
		Index        int           `json:"index"`
	}
	geminiUsage struct {
		PromptTokenCount     int `json:"promptTokenCount"`
		CandidatesTokenCount int `json:"candidatesTokenCount,omitempty"`
		TotalTokenCount      int `json:"totalTokenCount"`
	}
)

// geminiChunk is an answer, or a chunk of a streamed one, with text and
// the output tokens used so far; the last chunk has a finish reason.
func geminiChunk(a admission, model, text string, used int, last bool) geminiResponse {
	c := geminiCandidate{Content: geminiContent{Role: "model", Parts: []geminiPart{{Text: text}}}}
	if last {
		c.FinishReason = "STOP"
	}
	return geminiResponse{
		Candidates:    []geminiCandidate{c},
		UsageMetadata: geminiUsage{PromptTokenCount: a.input, CandidatesTokenCount: used, TotalTokenCount: a.input + used},
		ModelVersion:  model,
		ResponseID:    fmt.Sprintf("resp_%016x", a.seq),
	}
}

// geminiBody is the JSON answer to an admitted generateContent request.
func geminiBody(a admission, model string) []byte {
	return marshal(geminiChunk(a, model, answerText, a.used, true))
}

// geminiChunks are the chunks of a streamed answer: one a piece of text,
// each telling the output tokens so far, the last all of them.
func geminiChunks(a admission, model string) [][]byte {
	var out [][]byte
	for i, p := range answerPieces {
		last := i == len(answerPieces)-1
		out = append(out, marshal(geminiChunk(a, model, p, a.used*(i+1)/len(answerPieces), last)))
	}
	return out
}

// geminiEvents are the events of an alt=sse stream: a "data:" line a
// chunk.
func geminiEvents(a admission, model string) [][]byte {
	chunks := geminiChunks(a, model)
	for i, c := range chunks {
		chunks[i] = []byte("data: " + string(c) + "\r\n\r\n")
	}
	return chunks
}

// geminiArray is a stream without alt=sse: a JSON array of the chunks,
// written a chunk at a time.
func geminiArray(a admission, model string) [][]byte {
	chunks := geminiChunks(a, model)
	for i, c := range chunks {
		sep := ",\r\n"
		if i == 0 {
			sep = "["
		}
		chunks[i] = append([]byte(sep), c...)
	}
	chunks[len(chunks)-1] = append(chunks[len(chunks)-1], ']')
	return chunks
}

// The quotas a Gemini 429 names in its QuotaFailure, by the meter that
// refused.
var geminiQuotas = map[string][2]string{
	"requests": {"generativelanguage.googleapis.com/generate_content_paid_tier_requests",
		"GenerateRequestsPerMinutePerProjectPerModel"},
	"input_tokens": {"generativelanguage.googleapis.com/generate_content_paid_tier_input_token_count",
		"GenerateContentPaidTierInputTokensPerModelPerMinute"},
}

// geminiRefusal is the message of a Gemini 429 refused by meter m, which
// was short of need (m's level is up to date). s.mu is held.
func geminiRefusal(m *meter, need float64) string {
	wait := (need - m.level) / m.Rate
	return fmt.Sprintf("You exceeded your current quota, please check your plan and billing details. "+
		"For more information on this error, head to: https://ai.google.dev/gemini-api/docs/rate-limits.\n"+
		"* Quota exceeded for metric: %s, limit: %g (%d remaining, %g requested)\nPlease retry in %.9fs.",
		geminiQuotas[m.name][0], m.Burst, int(math.Floor(math.Max(0, m.level))), need, wait)
}

// refuseGemini writes the 429 answer to a refused Gemini request: its
// wait is in the RetryInfo of the error's details, not in a header.
func (s *Server) refuseGemini(w http.ResponseWriter, a admission) {
	q := geminiQuotas[a.by]
	geminiError(w, http.StatusTooManyRequests, "RESOURCE_EXHAUSTED", a.message, []any{
		map[string]any{
			"@type": "type.googleapis.com/google.rpc.QuotaFailure",
			"violations": []map[string]any{{
				"quotaMetric":     q[0],
				"quotaId":         q[1],
				"quotaDimensions": map[string]string{"location": "global"},
			}},
		},
		map[string]any{
			"@type": "type.googleapis.com/google.rpc.Help",
			"links": []map[string]string{{
				"description": "Learn more about Gemini API quotas",
				"url":         "https://ai.google.dev/gemini-api/docs/rate-limits",
			}},
		},
		map[string]any{
			"@type":      "type.googleapis.com/google.rpc.RetryInfo",
			"retryDelay": fmt.Sprintf("%ds", a.retryAfter),
		},
	})
}

// geminiError writes a google.rpc error answer: the HTTP status as its
// code, the canonical status name, the message and the details, if any.
func geminiError(w http.ResponseWriter, code int, status, msg string, details []any) {
	type rpcError struct {
		Code    int    `json:"code"`
		Message string `json:"message"`
		Status  string `json:"status"`
		Details []any  `json:"details,omitempty"`
	}
	w.Header().Set("Content-Type", "application/json; charset=UTF-8")
	w.WriteHeader(code)
	_, _ = w.Write(marshal(struct {
		Error rpcError `json:"error"`
	}{rpcError{code, msg, status, details}}))
}
