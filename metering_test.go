package quota

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/logtest"
	"github.com/sharedquota/quota/internal/redistest"
)

// meteredClient returns a client of a Transport WithMetering(m) on srv,
// sending with base (nil: http.DefaultTransport), and its commands.
func meteredClient(t *testing.T, srv *redistest.Server, m Metering, base http.RoundTripper, opts ...TransportOption) (*http.Client, *Transport, *cmdCounter) {
	t.Helper()
	rdb := srv.Client(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	if base == nil {
		base = http.DefaultTransport
	}
	tr := NewTransport(rdb, Limit{Rate: 100, Burst: 100}, append([]TransportOption{WithMetering(m), WithBase(base)}, opts...)...)
	return &http.Client{Transport: tr}, tr, cmds
}

// post sends an Anthropic request of maxTokens through c to url, reads
// its body whole unless cut, in which case it reads cut bytes and closes
// it, and returns what it read.
func post(t *testing.T, c *http.Client, url string, maxTokens int, stream bool, cut int) ([]byte, *http.Response) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, bytes.NewReader(llmRequest("anthropic", 1, maxTokens, stream)))
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var b []byte
	if cut > 0 {
		b = make([]byte, cut)
		n, _ := io.ReadFull(resp.Body, b)
		b = b[:n]
	} else {
		b, _ = io.ReadAll(resp.Body)
	}
	return b, resp
}

// outputLeft returns what the output meter of the bucket of url holds
// now, as a reservation with a deadline learns it: the most of n output
// tokens granted without a wait, to within step.
func meterLevel(t *testing.T, tr *Transport, name string, meter string, step float64) float64 {
	t.Helper()
	m := tr.cfg.metering
	meters := append([]Meter{{Name: MeterRequests, Limit: Limit{Rate: 100, Burst: 100}}}, m.Meters...)
	l := tr.Limiter()
	var lim Limit
	for _, mt := range meters {
		if mt.Name == meter {
			lim = mt.Limit
		}
	}
	lo, hi := 0.0, lim.Burst
	for hi-lo > step {
		mid := (lo + hi) / 2
		ctx, cancel := context.WithTimeout(context.Background(), time.Millisecond)
		r, err := l.Reserve(ctx, name, meters, Usage{meter: mid})
		cancel()
		if err == nil {
			r.Cancel()
			if err := l.Flush(context.Background()); err != nil {
				t.Fatal(err)
			}
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo
}

// TestMeteredBodies: a metered Transport hands the caller every byte of
// the answer, body or stream; settles from the usage it read; keeps the
// reservation of an answer closed before its usage; and hands back that
// of a request that never reached the provider. The output meter refills
// 1 token a second, so what it holds tells what was settled.
func TestMeteredBodies(t *testing.T) {
	srv := redistest.Start(t)
	m := Anthropic(AnthropicLimits{
		InputTokens:  Limit{Rate: 1, Burst: 100000},
		OutputTokens: Limit{Rate: 1, Burst: 10000},
	})
	p := &llmfake.Server{Kind: llmfake.Anthropic, Latency: 20 * time.Millisecond, Used: func(int) int { return 100 }}
	provider := httptest.NewServer(p)
	defer provider.Close()
	url := provider.URL + "/v1/messages"
	name := provider.Listener.Addr().String()

	for _, stream := range []bool{false, true} {
		c, tr, cmds := meteredClient(t, srv, m, nil, WithPrefix("quota:"+map[bool]string{false: "body", true: "stream"}[stream]+":"))
		direct, _ := post(t, http.DefaultClient, url, 1000, stream, 0)
		got, resp := post(t, c, url, 1000, stream, 0)
		if resp.StatusCode != 200 || len(got) != len(direct) {
			t.Fatalf("stream %v: %s, %d bytes through the Transport, %d direct", stream, resp.Status, len(got), len(direct))
		}
		if err := tr.Limiter().Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		if n := cmds.byOp()["adjust"]; n != 1 {
			t.Errorf("stream %v: %d settle calls for one answer, want 1", stream, n)
		}
		if left := meterLevel(t, tr, name, MeterOutputTokens, 20); left < 10000-100-50 {
			t.Errorf("stream %v: %.0f output tokens left after an answer of 100 reserved 1000, want about 9900: the settle did not give back", stream, left)
		}
		cmds.reset()
		post(t, c, url, 1000, stream, 10) // closed before its usage
		time.Sleep(50 * time.Millisecond)
		if err := tr.Limiter().Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
		if n := cmds.byOp()["adjust"]; n != 0 {
			t.Errorf("stream %v: %d settle calls for an answer closed before its usage, want 0: it keeps its reservation", stream, n)
		}
		if left := meterLevel(t, tr, name, MeterOutputTokens, 20); left > 10000-100-1000+50 {
			t.Errorf("stream %v: %.0f output tokens left after an answer closed before its usage, want about 8900", stream, left)
		}
	}

	// A request that fails before it is written hands its reservation back.
	refused := roundTripFunc(func(r *http.Request) (*http.Response, error) { return nil, errors.New("dial: refused") })
	c, tr, _ := meteredClient(t, srv, m, refused, WithPrefix("quota:unsent:"))
	req, _ := http.NewRequest("POST", url, bytes.NewReader(llmRequest("anthropic", 1, 5000, false)))
	if _, err := c.Do(req); err == nil {
		t.Fatal("a request through a failing base did not fail")
	}
	if err := tr.Limiter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if left := meterLevel(t, tr, name, MeterOutputTokens, 20); left < 10000-50 {
		t.Errorf("%.0f output tokens left after a request that was never sent, want 10000: its reservation stays taken", left)
	}
}

// TestMeteringMeetsSlotsAndOutages: a metered Transport with concurrency
// slots takes its slot and its meters in one call, never sends more than
// its slots at once, and settles; with Redis down under FallbackLocal,
// its requests go on the process's share of each meter, and a request
// whose output reservation exceeds the share's burst is refused with
// ErrUnavailable rather than sent.
func TestMeteringMeetsSlotsAndOutages(t *testing.T) {
	srv := redistest.Start(t)
	m := Anthropic(AnthropicLimits{
		InputTokens:  Limit{Rate: 100000, Burst: 100000},
		OutputTokens: Limit{Rate: 100000, Burst: 10000},
	})
	var inFlight, most atomic.Int32
	p := &llmfake.Server{Kind: llmfake.Anthropic, Latency: 30 * time.Millisecond}
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inFlight.Add(1)
		defer inFlight.Add(-1)
		for old := most.Load(); n > old && !most.CompareAndSwap(old, n); old = most.Load() {
		}
		p.ServeHTTP(w, r)
	}))
	defer provider.Close()
	url := provider.URL + "/v1/messages"
	c, tr, cmds := meteredClient(t, srv, m, nil, WithConcurrency(2), WithPolicy(FallbackLocal(2)), WithLogger(discardLogger()))
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			if _, resp := post(t, c, url, 1000, false, 0); resp.StatusCode != 200 {
				t.Errorf("through slots: %s", resp.Status)
			}
		})
	}
	wg.Wait()
	if err := tr.Limiter().Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := most.Load(); n > 2 {
		t.Errorf("%d requests in flight at once, with 2 slots", n)
	}
	if n := cmds.byOp()["adjust"]; n != 8 {
		t.Errorf("%d settles for 8 answers through slots, want 8", n)
	}

	srv.Kill()
	// The share of each meter is half the bucket: 5,000 output tokens of
	// burst. A reservation of 1,000 goes; one of 6,000 cannot.
	if _, resp := post(t, c, url, 1000, false, 0); resp.StatusCode != 200 {
		t.Errorf("with Redis down, on the local share: %s", resp.Status)
	}
	if mode := tr.Limiter().Mode(); mode != ModeLocal {
		t.Errorf("mode %v with Redis down under FallbackLocal", mode)
	}
	req, _ := http.NewRequest("POST", url, bytes.NewReader(llmRequest("anthropic", 1, 6000, false)))
	if _, err := c.Do(req); !errors.Is(err, ErrUnavailable) {
		t.Errorf("a reservation beyond the local share's burst: %v, want ErrUnavailable", err)
	}
}

// TestRateLimitPolicyBelowTheLimit: a provider whose RateLimit-Policy
// allows a meter less than the Limit it was given is logged once, and a
// policy at the Limit or above, or of no meter, not at all.
func TestRateLimitPolicyBelowTheLimit(t *testing.T) {
	_, rdb, _ := newMini(t)
	for _, c := range []struct {
		policy string
		logs   int
	}{
		{`"output_tokens";q=60;w=60, "input_tokens";q=40000;w=60`, 1}, // 1/s, against 8000/min
		{`"output_tokens";q=8000;w=60`, 0},
		{`"other";q=1;w=60`, 0},
		{``, 0},
	} {
		rec := &logtest.Recorder{}
		base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
			h := http.Header{"Content-Type": {"application/json"}}
			if c.policy != "" {
				h.Set("RateLimit-Policy", c.policy)
			}
			return &http.Response{StatusCode: 200, Header: h, Request: r,
				Body: io.NopCloser(strings.NewReader(`{"usage":{"input_tokens":5,"output_tokens":5}}`))}, nil
		})
		tr := NewTransport(rdb, PerMinute(50), WithBase(base), WithLogger(slog.New(rec)),
			WithMetering(Anthropic(AnthropicLimits{InputTokens: PerMinute(40000), OutputTokens: PerMinute(8000)})))
		c2 := &http.Client{Transport: tr}
		for range 3 {
			post(t, c2, "https://api.anthropic.com/v1/messages", 10, false, 0)
		}
		if n := rec.Count(slog.LevelWarn, "quota: the provider's RateLimit-Policy allows a meter less than its Limit"); n != c.logs {
			t.Errorf("RateLimit-Policy %q: %d warnings in 3 responses, want %d", c.policy, n, c.logs)
		}
	}
}

// TestWithMeteringRefusesWhatCannotBe: a Metering whose Meters cannot be
// is refused when the option is made, not on every request.
func TestWithMeteringRefusesWhatCannotBe(t *testing.T) {
	estimate := func(*http.Request, []byte) (Usage, error) { return nil, nil }
	lim := PerMinute(60)
	for _, m := range []Metering{
		{},
		{Estimate: estimate, Meters: []Meter{{Name: "a:b", Limit: lim}}},
		{Estimate: estimate, Meters: []Meter{{Name: "a", Limit: lim}, {Name: "a", Limit: lim}}},
		{Estimate: estimate, Meters: []Meter{{Name: MeterRequests, Limit: lim}}},
		{Estimate: estimate, Meters: []Meter{{Name: "a", Limit: lim}}, NoGiveBack: []string{"b"}},
	} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("WithMetering(%+v) did not panic", m)
				}
			}()
			WithMetering(m)
		}()
	}
	WithMetering(Metering{Estimate: estimate, Meters: []Meter{{Name: "a", Limit: lim}}, NoGiveBack: []string{"a"}})
}
