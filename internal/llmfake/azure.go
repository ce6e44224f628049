package llmfake

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// Azure OpenAI
//
// An Azure Server answers a deployment's Chat Completions API, POST
// /openai/deployments/{deployment}/chat/completions?api-version=..., with
// OpenAI's bodies and streams, and meters it as OpenAI: one request, and
// input plus max_tokens (or max_completion_tokens) of tokens at
// admission, never given back. Azure checks a deployment's rate over
// windows of 1 or 10 seconds: give Requests and Tokens the Burst of such
// a window. Its answers carry x-ratelimit-{limit,remaining,reset}-{requests,tokens}
// as OpenAI's do; a 429 carries retry-after-ms (the exact wait, rounded up
// to the millisecond) beside retry-after (whole seconds, at least 1), and
// Azure's error body, {"error":{"code":"429","message":...}}. A request
// to another path, or without an api-version, is answered 404 Resource
// not found, as Azure does.

// azureRoute reports whether r is to a deployment's chat completions
// with an api-version, answering 404 when it is not.
func (s *Server) azureRoute(w http.ResponseWriter, r *http.Request) bool {
	deployment, ok := strings.CutPrefix(r.URL.Path, "/openai/deployments/")
	if ok {
		deployment, ok = strings.CutSuffix(deployment, "/chat/completions")
	}
	if ok && deployment != "" && !strings.Contains(deployment, "/") && r.URL.Query().Get("api-version") != "" {
		return true
	}
	writeAzureError(w, http.StatusNotFound, "404", "Resource not found")
	return false
}

// refuseAzure writes the 429 answer to a refused Azure request.
func (s *Server) refuseAzure(w http.ResponseWriter, a admission) {
	h := w.Header()
	copyHeader(h, a.headers)
	k, v := s.requestID(a.seq)
	h.Set(k, v)
	h.Set("retry-after", strconv.Itoa(a.retryAfter))
	h.Set("retry-after-ms", strconv.FormatInt(int64(math.Max(1, math.Ceil(a.wait*1000))), 10))
	limit := "token rate limit"
	if a.by == "requests" {
		limit = "call rate limit"
	}
	writeAzureError(w, http.StatusTooManyRequests, "429", fmt.Sprintf("Requests to the ChatCompletions_Create Operation under Azure OpenAI API "+
		"have exceeded %s of your current AIServices S0 pricing tier. Please retry after %d seconds.", limit, a.retryAfter))
}

// writeAzureError writes Azure's error body.
func writeAzureError(w http.ResponseWriter, status int, code, msg string) {
	type detail struct {
		Code    string `json:"code"`
		Message string `json:"message"`
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(marshal(struct {
		Error detail `json:"error"`
	}{detail{code, msg}}))
}
