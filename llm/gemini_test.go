package llm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
)

// geminiBody is a generateContent request body of one user content of
// 300 bytes and maxOutputTokens.
func geminiBody(maxTokens int) []byte {
	b, _ := json.Marshal(map[string]any{
		"contents": []map[string]any{{"role": "user", "parts": []map[string]any{
			{"text": strings.Repeat("quota shares one limit across a fleet. ", 8)[:300]}}}},
		"generationConfig": map[string]any{"maxOutputTokens": maxTokens},
	})
	return b
}

const geminiURL = "https://generativelanguage.googleapis.com/v1beta/models/gemini-2.5-flash"

// TestGemini: the profile reserves the input a body holds, of the
// generating methods alone; reads the input tokens of usageMetadata from
// a JSON body, and from a stream, alt=sse or a JSON array, the last
// chunk's; and reads nothing of a cut stream or an error answer.
func TestGemini(t *testing.T) {
	m := Gemini(GeminiLimits{InputTokens: PerMinute(1000000)})
	if len(m.Meters) != 1 || m.Meters[0].Name != MeterInputTokens || m.Meters[0].Limit.String() != "16666.666666666668/s burst 1e+06" {
		t.Errorf("meters %v, want input tokens at PerMinute(1000000)", m.Meters)
	}
	body := geminiBody(1000)
	for _, method := range []string{":generateContent", ":streamGenerateContent?alt=sse", ":streamGenerateContent"} {
		u, err := m.Estimate(httptest.NewRequest("POST", geminiURL+method, nil), body)
		if want := (quota.Usage{MeterInputTokens: math.Ceil(float64(len(body)) / 3)}); err != nil || !maps.Equal(u, want) {
			t.Errorf("%s: estimate %v %v, want %v: maxOutputTokens reserves nothing", method, u, err, want)
		}
	}
	if u, err := m.Estimate(httptest.NewRequest("POST", geminiURL+":countTokens", nil), body); len(u) != 0 || err != nil {
		t.Errorf("countTokens: estimate %v %v, want the request alone", u, err)
	}
	if _, err := m.Estimate(httptest.NewRequest("POST", geminiURL+":generateContent", nil), []byte("not json")); err == nil {
		t.Error("an estimate of a body that is not JSON did not fail")
	}
	answer := `{"candidates":[{"content":{"parts":[{"text":"a \"usageMetadata\": {\"promptTokenCount\": 9}"}],"role":"model"}}],` +
		`"usageMetadata":{"promptTokenCount":120,"candidatesTokenCount":30,"cachedContentTokenCount":100,"thoughtsTokenCount":400,"toolUsePromptTokenCount":5,"totalTokenCount":555}}`
	got, ok := readUsage(t, m, "application/json; charset=UTF-8", answer)
	if want := (quota.Usage{MeterInputTokens: 125}); !ok || !maps.Equal(got, want) {
		t.Errorf("JSON usage %v %v, want %v (the prompt, cache included, and the tool-use prompt; no output)", got, ok, want)
	}
	chunk := func(candidates int) string {
		return fmt.Sprintf("data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"hi\"}]}}],"+
			"\"usageMetadata\":{\"promptTokenCount\":%d,\"candidatesTokenCount\":%d}}\r\n\r\n", 40+candidates/100, candidates)
	}
	got, ok = readUsage(t, m, "text/event-stream", chunk(1)+chunk(200)+chunk(300))
	if want := (quota.Usage{MeterInputTokens: 43}); !ok || !maps.Equal(got, want) {
		t.Errorf("a stream: %v %v, want %v, the last chunk's", got, ok, want)
	}
	got, ok = readUsage(t, m, "text/event-stream", "data: {\"candidates\":[{\"content\":{\"parts\":[{\"text\":\"h")
	if ok {
		t.Errorf("a stream cut before its usage: %v, want none", got)
	}
	array := "[" + strings.ReplaceAll(chunk(1), "data: ", "") + ",\r\n" + strings.ReplaceAll(chunk(300), "data: ", "")
	got, ok = readUsage(t, m, "application/json", array+"]")
	if want := (quota.Usage{MeterInputTokens: 43}); !ok || !maps.Equal(got, want) {
		t.Errorf("a stream without alt=sse, a JSON array: %v %v, want %v, the last element's", got, ok, want)
	}
	got, ok = readUsage(t, m, "application/json", " [{\"candidates\": [{\"content\": {\"parts\": [{\"text\": \"a ] or } \\\" [\"}]}}]}, "+
		"{\"usageMetadata\": {\"promptTokenCount\": 7}}]")
	if want := (quota.Usage{MeterInputTokens: 7}); !ok || !maps.Equal(got, want) {
		t.Errorf("an array whose text holds brackets: %v %v, want %v", got, ok, want)
	}
	got, ok = readUsage(t, m, "application/json", "["+strings.ReplaceAll(chunk(1), "data: ", "")[:60])
	if ok {
		t.Errorf("an array cut in its first element: %v, want none", got)
	}
	if ur := m.Usage(&http.Response{StatusCode: 429, Header: http.Header{"Content-Type": {"application/json"}}}); ur != nil {
		t.Error("a 429 is read for usage")
	}
	if m.Remaining != nil {
		t.Error("Gemini reads rate-limit headers it does not send")
	}
}

// TestGeminiSettledInRedis: through a Transport on a real Redis, a
// request to the Gemini fake, its answer a JSON body, an alt=sse stream
// or a JSON array, reserves its estimated input and is settled with the
// input tokens the answer reports. The meter refills a token a second, so what it holds tells what was
// settled.
func TestGeminiSettledInRedis(t *testing.T) {
	srv := redistest.Start(t)
	const burst = 10000
	for i, method := range []string{":generateContent", ":streamGenerateContent?alt=sse", ":streamGenerateContent"} {
		p := &llmfake.Server{Kind: llmfake.Gemini, Latency: 10 * time.Millisecond, Used: func(int) int { return 100 }}
		provider := httptest.NewServer(p)
		name := fmt.Sprintf("gemini-settled-%d", i)
		m := Gemini(GeminiLimits{InputTokens: quota.Limit{Rate: 1, Burst: burst}})
		tr := quota.NewTransport(srv.Client(t), requests, quota.WithMetering(m), quota.WithKey(quota.Fixed(name)))
		body := geminiBody(1000)
		resp, err := (&http.Client{Transport: tr}).Post(provider.URL+"/v1beta/models/gemini-test"+method, "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		provider.Close()
		if err := tr.Limiter().Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		recs := p.Records()
		if resp.StatusCode != 200 || len(recs) != 1 {
			t.Fatalf("%s: %s, %d requests admitted", method, resp.Status, len(recs))
		}
		want := burst - float64(recs[0].Input)
		if got := level(t, tr, m, name, MeterInputTokens); got < want-40 || got > want+20 {
			t.Errorf("%s: the input meter holds %.0f after the settle, want about %.0f", method, got, want)
		}
	}
}

// TestGeminiRequestsPerDay: RequestsPerDay meters every request, a
// generating one or not, on a daily count that refills at midnight
// Pacific time: through a Transport on a real Redis, a day of 3 lets 3
// requests go and refuses the fourth, whose wait runs to midnight.
func TestGeminiRequestsPerDay(t *testing.T) {
	m := Gemini(GeminiLimits{InputTokens: PerMinute(1000000), RequestsPerDay: 3})
	if len(m.Meters) != 2 || m.Meters[1].Name != MeterRequestsPerDay || m.Meters[1].Limit.String() != "3 a day from 00:00 America/Los_Angeles" {
		t.Fatalf("meters %v, want the input tokens and 3 requests a day from midnight Pacific", m.Meters)
	}
	for _, method := range []string{":generateContent", ":countTokens"} {
		u, err := m.Estimate(httptest.NewRequest("POST", geminiURL+method, nil), geminiBody(10))
		if err != nil || u[MeterRequestsPerDay] != 1 {
			t.Errorf("%s: estimate %v %v, want one of the requests a day", method, u, err)
		}
	}
	for _, n := range []float64{-1, math.NaN(), math.Inf(1)} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("RequestsPerDay %v did not panic", n)
				}
			}()
			Gemini(GeminiLimits{InputTokens: PerMinute(1000), RequestsPerDay: n})
		}()
	}

	pacific, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().In(pacific)
	if midnight := time.Date(now.Year(), now.Month(), now.Day()+1, 0, 0, 0, 0, pacific); time.Until(midnight) < 10*time.Second {
		time.Sleep(time.Until(midnight) + time.Second) // the day is the one the requests fall in
	}
	srv := redistest.Start(t)
	p := &llmfake.Server{Kind: llmfake.Gemini, Latency: time.Millisecond, Used: func(int) int { return 10 }}
	provider := httptest.NewServer(p)
	defer provider.Close()
	tr := quota.NewTransport(srv.Client(t), requests, quota.WithMetering(m), quota.WithKey(quota.Fixed("gemini-day")))
	client := &http.Client{Transport: tr}
	for i := range 4 {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		req, _ := http.NewRequestWithContext(ctx, "POST", provider.URL+"/v1beta/models/gemini-test:generateContent", bytes.NewReader(geminiBody(10)))
		resp, err := client.Do(req)
		cancel()
		if i < 3 {
			if err != nil {
				t.Fatalf("request %d of a day of 3: %v", i+1, err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			continue
		}
		if !errors.Is(err, quota.ErrWouldExceedDeadline) {
			t.Errorf("request 4 of a day of 3: %v, want ErrWouldExceedDeadline", err)
		}
	}
	if n := len(p.Records()); n != 3 {
		t.Errorf("the provider admitted %d requests, want 3", n)
	}
}
