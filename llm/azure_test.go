package llm

import (
	"maps"
	"math"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota"
)

// Azure's buckets hold a Window of their rate, 1 s by default, raised to
// hold the largest request; its requests are 6 a minute for each 1,000
// tokens a minute unless given.
func TestAzureLimits(t *testing.T) {
	for _, c := range []struct {
		name             string
		lim              AzureLimits
		tokens, requests quota.Limit
	}{
		{"1 s, raised to twice MaxTokens", AzureLimits{TokensPerMinute: 30000},
			quota.Limit{Rate: 500, Burst: 8192}, quota.Limit{Rate: 3, Burst: 3}},
		{"10 s", AzureLimits{TokensPerMinute: 600000, Window: 10 * time.Second},
			quota.Limit{Rate: 10000, Burst: 100000}, quota.Limit{Rate: 60, Burst: 600}},
		{"1 s of a large deployment", AzureLimits{TokensPerMinute: 1200000},
			quota.Limit{Rate: 20000, Burst: 20000}, quota.Limit{Rate: 120, Burst: 120}},
		{"its own RPM and MaxRequest", AzureLimits{TokensPerMinute: 30000, RequestsPerMinute: 30, MaxRequest: 2000},
			quota.Limit{Rate: 500, Burst: 2000}, quota.Limit{Rate: 0.5, Burst: 1}},
		{"MaxTokens", AzureLimits{TokensPerMinute: 30000, MaxTokens: 1000},
			quota.Limit{Rate: 500, Burst: 2000}, quota.Limit{Rate: 3, Burst: 3}},
	} {
		if got := c.lim.Tokens(); got != c.tokens {
			t.Errorf("%s: Tokens %v, want %v", c.name, got, c.tokens)
		}
		if got := c.lim.Requests(); got != c.requests {
			t.Errorf("%s: Requests %v, want %v", c.name, got, c.requests)
		}
		if got := Azure(c.lim).Meters[0].Limit; got != c.tokens {
			t.Errorf("%s: the tokens meter %v, want %v", c.name, got, c.tokens)
		}
	}
	for _, c := range []struct {
		lim  AzureLimits
		want string
	}{
		{AzureLimits{}, "TokensPerMinute 0"},
		{AzureLimits{TokensPerMinute: math.Inf(1)}, "TokensPerMinute +Inf"},
		{AzureLimits{TokensPerMinute: 30000, Window: -time.Second}, "Window -1s"},
		{AzureLimits{TokensPerMinute: 30000, MaxRequest: -1}, "MaxRequest -1"},
		{AzureLimits{TokensPerMinute: 30000, MaxTokens: math.NaN()}, "MaxTokens NaN"},
		{AzureLimits{TokensPerMinute: 30000, RequestsPerMinute: -6}, "RequestsPerMinute -6"},
	} {
		func() {
			defer func() {
				if r, _ := recover().(string); !strings.Contains(r, c.want) {
					t.Errorf("%+v: panic %q, want one naming %q", c.lim, r, c.want)
				}
			}()
			Azure(c.lim)
			c.lim.Requests()
		}()
	}
}

// Azure meters as OpenAI does: the input estimate and max_tokens, kept,
// settled from the usage of the body or of the stream's last chunk, and
// lowered by the x-ratelimit-remaining headers.
func TestAzure(t *testing.T) {
	m := Azure(AzureLimits{TokensPerMinute: 30000})
	if len(m.NoGiveBack) != 1 || m.NoGiveBack[0] != MeterTokens {
		t.Errorf("NoGiveBack %v, want the tokens", m.NoGiveBack)
	}
	body := request("openai", 700, false)
	u, err := m.Estimate(httptest.NewRequest("POST", "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", nil), body)
	if want := (quota.Usage{MeterTokens: math.Ceil(float64(len(body))/4) + 700}); err != nil || !maps.Equal(u, want) {
		t.Errorf("estimate %v, %v; want %v", u, err, want)
	}
	got, ok := readUsage(t, m, "application/json", `{"id":"chatcmpl-1","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":30,"total_tokens":42}}`)
	if want := (quota.Usage{MeterTokens: 42}); !ok || !maps.Equal(got, want) {
		t.Errorf("body usage %v, %v; want %v", got, ok, want)
	}
	got, ok = readUsage(t, m, "text/event-stream", "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n"+
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30,\"total_tokens\":42}}\n\ndata: [DONE]\n\n")
	if want := (quota.Usage{MeterTokens: 42}); !ok || !maps.Equal(got, want) {
		t.Errorf("stream usage %v, %v; want %v", got, ok, want)
	}
	h := httptest.NewRecorder().Header()
	h.Set("x-ratelimit-remaining-requests", "7")
	h.Set("x-ratelimit-remaining-tokens", "1200")
	if got, want := m.Remaining(h, time.Now()), map[string]float64{quota.MeterRequests: 7, MeterTokens: 1200}; !maps.Equal(got, want) {
		t.Errorf("remaining %v, want %v", got, want)
	}
}
