package quota

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
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
