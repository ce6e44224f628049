package llmfake

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"

	"github.com/sharedquota/quota/internal/eventstream"
)

// Amazon Bedrock
//
// A Bedrock Server answers POST /model/{modelId}/converse (Converse),
// /converse-stream (ConverseStream) and /invoke (InvokeModel, with an
// Anthropic Messages body), and meters them as Bedrock documents: one
// request, and one tokens meter charged the input plus the maximum
// output (Converse's inferenceConfig.maxTokens, 4096 when it names none;
// InvokeModel's max_tokens, required) times Limits.OutputBurndown at
// admission, the output the answer did not use, times the burndown, given
// back when it ends: at the end, a request has been charged its input and
// its output times the burndown, as Bedrock counts. (AWS's quota
// reference gives the reservation at the start without the burndown; the
// fake charges it with, the stricter reading.) Converse answers with its usage object
// (inputTokens, outputTokens, totalTokens), InvokeModel with Anthropic's
// and the X-Amzn-Bedrock-Input-Token-Count and -Output-Token-Count
// headers, and ConverseStream with AWS event-stream messages
// (application/vnd.amazon.eventstream): messageStart, a
// contentBlockDelta a piece of text, contentBlockStop, messageStop, and
// metadata with the usage. Bedrock sends no rate-limit headers; a refused
// request is answered 429 with X-Amzn-ErrorType: ThrottlingException and
// {"message":...}, and no Retry-After. Errors are Bedrock's:
// X-Amzn-ErrorType and a JSON message.

// bedrockRequest holds the fields of a Converse or InvokeModel body the
// server looks at.
type bedrockRequest struct {
	Messages  []message `json:"messages"`
	MaxTokens *int      `json:"max_tokens"`
	Inference *struct {
		MaxTokens *int `json:"maxTokens"`
	} `json:"inferenceConfig"`
}

// serveBedrock answers one Bedrock request.
func (s *Server) serveBedrock(w http.ResponseWriter, r *http.Request) {
	rest, _ := strings.CutPrefix(r.URL.EscapedPath(), "/model/")
	model, op, _ := strings.Cut(rest, "/")
	if !strings.HasPrefix(r.URL.EscapedPath(), "/model/") || model == "" ||
		(op != "converse" && op != "converse-stream" && op != "invoke") {
		writeBedrockError(w, http.StatusNotFound, "UnknownOperationException", "Unknown operation "+r.Method+" "+r.URL.Path)
		return
	}
	if r.Method != http.MethodPost {
		writeBedrockError(w, http.StatusMethodNotAllowed, "UnknownOperationException", "Method not allowed: "+r.Method)
		return
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	if err != nil {
		writeBedrockError(w, http.StatusBadRequest, "ValidationException", "reading the request body: "+err.Error())
		return
	}
	var req bedrockRequest
	if err := json.Unmarshal(body, &req); err != nil {
		writeBedrockError(w, http.StatusBadRequest, "ValidationException", "Malformed input request: "+err.Error())
		return
	}
	maxTokens := defaultMax
	switch {
	case op == "invoke" && req.MaxTokens == nil:
		writeBedrockError(w, http.StatusBadRequest, "ValidationException", "Malformed input request: #: required key [max_tokens] not found")
		return
	case op == "invoke":
		maxTokens = *req.MaxTokens
	case req.Inference != nil && req.Inference.MaxTokens != nil:
		maxTokens = *req.Inference.MaxTokens
	}
	if maxTokens < 1 {
		writeBedrockError(w, http.StatusBadRequest, "ValidationException", "max tokens: must be at least 1")
		return
	}

	a := s.admit(countInput(req.Messages), maxTokens, op == "converse-stream", r.Header.Get("X-Quota-Worker"))
	if !a.ok {
		s.refuse(w, a)
		return
	}
	finish := s.finisher(a)
	latency := strconv.FormatInt(s.Latency.Milliseconds(), 10)
	switch op {
	case "converse":
		s.answer(r.Context(), w, a, converseBody(a, latency), finish)
	case "converse-stream":
		s.streamAs(r.Context(), w, a, "application/vnd.amazon.eventstream", converseEvents(a, latency), finish)
	default:
		a.headers = a.headers.Clone()
		a.headers.Set("X-Amzn-Bedrock-Input-Token-Count", strconv.Itoa(a.input))
		a.headers.Set("X-Amzn-Bedrock-Output-Token-Count", strconv.Itoa(a.used))
		a.headers.Set("X-Amzn-Bedrock-Invocation-Latency", latency)
		if m, err := url.PathUnescape(model); err == nil {
			model = m
		}
		s.answer(r.Context(), w, a, anthropicBody(a, model), finish)
	}
}

// burndown is how many tokens an output token takes (Bedrock).
func (s *Server) burndown() int {
	if s.Kind != Bedrock || s.Limits.OutputBurndown < 1 {
		return 1
	}
	return s.Limits.OutputBurndown
}

// converseUsage is the usage object of Bedrock's Converse answers.
type converseUsage struct {
	InputTokens  int `json:"inputTokens"`
	OutputTokens int `json:"outputTokens"`
	TotalTokens  int `json:"totalTokens"`
}

func converseUsageOf(a admission) converseUsage {
	return converseUsage{InputTokens: a.input, OutputTokens: a.used, TotalTokens: a.input + a.used}
}

// converseBody is the JSON answer to an admitted Converse request.
func converseBody(a admission, latency string) []byte {
	type text struct {
		Text string `json:"text"`
	}
	type msg struct {
		Role    string `json:"role"`
		Content []text `json:"content"`
	}
	return marshal(map[string]any{
		"output":     map[string]any{"message": msg{"assistant", []text{{answerText}}}},
		"stopReason": "end_turn",
		"usage":      converseUsageOf(a),
		"metrics":    map[string]json.Number{"latencyMs": json.Number(latency)},
	})
}

// converseEvents are the event-stream messages answering an admitted
// ConverseStream request.
func converseEvents(a admission, latency string) [][]byte {
	event := func(typ string, v any) []byte {
		return eventstream.Encode([][2]string{
			{":event-type", typ}, {":content-type", "application/json"}, {":message-type", "event"},
		}, marshal(v))
	}
	events := [][]byte{event("messageStart", map[string]string{"role": "assistant"})}
	for _, p := range answerPieces {
		events = append(events, event("contentBlockDelta", map[string]any{
			"contentBlockIndex": 0, "delta": map[string]string{"text": p},
		}))
	}
	return append(events,
		event("contentBlockStop", map[string]int{"contentBlockIndex": 0}),
		event("messageStop", map[string]string{"stopReason": "end_turn"}),
		event("metadata", map[string]any{
			"usage":   converseUsageOf(a),
			"metrics": map[string]json.Number{"latencyMs": json.Number(latency)},
		}),
	)
}

// refuseBedrock writes the 429 answer to a refused Bedrock request: a
// ThrottlingException, without Retry-After.
func (s *Server) refuseBedrock(w http.ResponseWriter, a admission) {
	k, v := s.requestID(a.seq)
	w.Header().Set(k, v)
	msg := "Too many tokens, please wait before trying again."
	if a.by == "requests" {
		msg = "Too many requests, please wait before trying again."
	}
	writeBedrockError(w, http.StatusTooManyRequests, "ThrottlingException", msg)
}

// writeBedrockError writes Bedrock's error answer: the error's type in
// X-Amzn-ErrorType, and its message in the JSON body.
func writeBedrockError(w http.ResponseWriter, status int, typ, msg string) {
	w.Header().Set("X-Amzn-ErrorType", typ+":http://internal.amazon.com/coral/com.amazon.bedrock/")
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(marshal(map[string]string{"message": msg}))
}
