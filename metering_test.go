package quota

import (
	"bytes"
	"context"
	"errors"
	"fmt"
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

// Tests of metered Transports (metering.go): WithMetering's bodies and
// streams settled from their usage, with slots and outages, the provider's
// RateLimit-Policy, and fleets of worker processes against fake LLM APIs.

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
	m := LLMProfiles.Anthropic(Limit{Rate: 1, Burst: 100000}, Limit{Rate: 1, Burst: 10000})
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
		if left := meterLevel(t, tr, name, outputTokens, 20); left < 10000-100-50 {
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
		if left := meterLevel(t, tr, name, outputTokens, 20); left > 10000-100-1000+50 {
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
	if left := meterLevel(t, tr, name, outputTokens, 20); left < 10000-50 {
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
	m := LLMProfiles.Anthropic(Limit{Rate: 100000, Burst: 100000}, Limit{Rate: 100000, Burst: 10000})
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
		tr := NewTransport(rdb, PerSecond(50), WithBase(base), WithLogger(slog.New(rec)),
			WithMetering(LLMProfiles.Anthropic(Limit{Rate: 40000.0 / 60, Burst: 40000}, Limit{Rate: 8000.0 / 60, Burst: 8000})))
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

// llmRun is one fleet's run against a fake LLM API, and what came of it.
type llmRun struct {
	api      string // "anthropic", "openai" or "gemini"
	stream   bool
	noSettle bool    // the profile without its Usage
	quantile float64 // above zero: reserve this of the output in place of max_tokens
	ownLimit bool    // per-process limiters: each worker a prefix of its own
	run      time.Duration
	at       time.Time // when its workers start, once ready

	binding  float64 // of the binding limit's rate, in the steady window
	refused  int     // 429s
	requests int
	perReq   map[string]float64 // script calls a request, by operation
}

// llmFleet runs 4 worker processes x 8 goroutines through Transports
// WithMetering of the run's profile against a fake provider that meters
// as that provider documents, with the fleet's limits at 95% of the
// provider's. Anthropic: 100 requests, 40,000 input and 8,000 output
// tokens a second, the output binding; OpenAI: 100 requests and 20,000
// tokens (input and max_tokens, at admission) a second; Gemini: 100
// requests and 10,000 input tokens (at admission) a second, the input
// binding at about 50 requests a second. Every request
// asks for 1,000 output tokens and uses 10 to 60% of them; the provider
// takes 100 ms to answer. The steady window leaves out the first 2.5 s
// and the last 0.3 s: the 32 first reservations queue at their whole
// max_tokens, 4 s of output at the fleet's rate, and the callers asleep
// in that queue learn of the settles that move it from their Limiters'
// reads of the record, every 0.5 s (see docs/llm.md).
func llmFleet(t *testing.T, srv *redistest.Server, r *llmRun) {
	t.Helper()
	p := &llmfake.Server{Latency: 100 * time.Millisecond}
	fleet := llmLimits{}
	switch r.api {
	case "anthropic":
		p.Kind = llmfake.Anthropic
		p.Limits = llmfake.Limits{
			Requests:     llmfake.Bucket{Rate: 100, Burst: 100},
			InputTokens:  llmfake.Bucket{Rate: 40000, Burst: 40000},
			OutputTokens: llmfake.Bucket{Rate: 8000, Burst: 8000},
		}
		fleet.Input, fleet.Output = Limit{Rate: 38000, Burst: 38000}, Limit{Rate: 7600, Burst: 7600}
	case "openai":
		p.Kind = llmfake.OpenAI
		p.Limits = llmfake.Limits{
			Requests: llmfake.Bucket{Rate: 100, Burst: 100},
			Tokens:   llmfake.Bucket{Rate: 20000, Burst: 20000},
		}
		fleet.Tokens = Limit{Rate: 19000, Burst: 19000}
	case "gemini":
		p.Kind = llmfake.Gemini
		p.Limits = llmfake.Limits{
			Requests:    llmfake.Bucket{Rate: 100, Burst: 100},
			InputTokens: llmfake.Bucket{Rate: 10000, Burst: 10000},
		}
		fleet.Input = Limit{Rate: 9500, Burst: 9500}
	case "azure", "bedrock":
		azureBedrockLimits(r.api, p, &fleet)
	}
	provider := httptest.NewServer(p)
	defer provider.Close()
	path := "/v1/messages"
	requests := Limit{Rate: 95, Burst: 95}
	switch {
	case r.api == "openai":
		path = "/v1/chat/completions"
	case r.api == "gemini" && r.stream:
		path = "/v1beta/models/model-1:streamGenerateContent?alt=sse"
	case r.api == "gemini":
		path = "/v1beta/models/model-1:generateContent"
	case r.api == "azure", r.api == "bedrock":
		path, requests = azureBedrockPath(r.api, r.stream, fleet)
	}
	spec := workerSpec{Addr: srv.Addr(), Key: provider.Listener.Addr().String(), Limit: requests,
		Goroutines: 8, Duration: r.run, At: r.at, Deadline: true, URL: provider.URL + path, LLM: r.api, LLMLimits: fleet,
		Stream: r.stream, MaxTokens: 1000, NoSettle: r.noSettle, OwnPrefix: r.ownLimit, ReserveOutput: r.quantile}
	w := startWorkers(t, 4, spec)
	reps := w.wait(t)
	from, to := w.start.Add(2500*time.Millisecond), w.start.Add(r.run-300*time.Millisecond)
	var used, limit float64
	for _, rec := range p.Records() {
		if rec.At.Before(from) || !rec.At.Before(to) {
			continue
		}
		switch r.api {
		case "anthropic":
			used += float64(rec.Output)
		case "openai", "azure", "bedrock":
			used += float64(rec.Charged)
		case "gemini":
			used += float64(rec.Input)
		}
	}
	switch r.api {
	case "anthropic":
		limit = p.Limits.OutputTokens.Rate
	case "openai", "azure", "bedrock":
		limit = p.Limits.Tokens.Rate
	case "gemini":
		limit = p.Limits.InputTokens.Rate
	}
	r.binding = used / to.Sub(from).Seconds() / limit
	r.refused = p.Refused()
	r.requests = len(p.Records()) + r.refused
	ops := map[string]int{}
	for _, rep := range reps {
		for op, n := range rep.Ops {
			ops[op] += n
		}
	}
	r.perReq = map[string]float64{}
	for op, n := range ops {
		r.perReq[op] = float64(n) / float64(max(1, r.requests))
	}
	t.Logf("%s: %d requests, %d refused with 429 (%v), %.2f of the binding limit's rate in the steady window; script calls a request: %v",
		r.name(), r.requests, r.refused, p.RefusedBy(), r.binding, r.perReq)
}

func (r *llmRun) name() string {
	s := r.api
	if r.stream {
		s += " stream"
	} else {
		s += " body"
	}
	switch {
	case r.noSettle:
		s += ", never settled (control)"
	case r.ownLimit:
		s += ", per-process limiters (control)"
	case r.quantile > 0:
		s += fmt.Sprintf(", reserving %g output tokens, not max_tokens", r.quantile)
	}
	return s
}

// TestLLMFleet: 4 processes x 8 goroutines through metered Transports at
// 95% of a fake provider's limits, for each provider, body and stream: no
// 429, at least 0.9 of the binding limit's rate in the steady window, at
// most one take call and one settle call a request.
func TestLLMFleet(t *testing.T) {
	redistest.Long(t)
	// Alone, not beside the parallel tests, so that the machine is not too
	// loaded for the fleets' timing: a grant that reaches the provider
	// late counts there in a later window than in the fleet's bucket.
	// The fleets run 10 s, so that their steady window of 7 s holds the
	// noise of the answers' spread of usage to about 0.02 of the limit.
	// They run in two waves of five, starting half a second apart, so
	// that no two cold starts meet: a fleet hands off its burst at once,
	// and when those first requests reach the provider later than the
	// ones granted after them, the provider's bucket, full meanwhile,
	// loses to its cap the refill the fleet's bucket counts on. The
	// fleets' 5% (400 output tokens of Anthropic's) covers 53 ms of that;
	// with four fleets' 16 workers starting together on 2 cores, the
	// first requests took 50 to 300 ms from the Transport to the
	// provider, and later ones 2 ms. All ten at once, on a busy machine,
	// met a 429 in one run of two.
	srv := redistest.Start(t)
	waves := [][]*llmRun{
		{{api: "anthropic"}, {api: "anthropic", stream: true}, {api: "openai"}, {api: "openai", stream: true}, {api: "bedrock"}},
		{{api: "gemini"}, {api: "gemini", stream: true}, {api: "azure"}, {api: "azure", stream: true}, {api: "bedrock", stream: true}},
	}
	for _, fleets := range waves {
		runLLM(t, srv, fleets, 10*time.Second, 500*time.Millisecond)
		checkFleets(t, fleets)
	}
}

// checkFleets checks that each of the fleets rs met no 429, used at least
// 0.9 of the binding limit's rate in the steady window, and made at most
// one take call and one settle call a request.
func checkFleets(t *testing.T, rs []*llmRun) {
	for _, r := range rs {
		if r.refused > 0 {
			t.Errorf("%s: %d requests refused with 429", r.name(), r.refused)
		}
		if r.binding < 0.9 {
			t.Errorf("%s: %.2f of the binding limit's rate, want at least 0.9", r.name(), r.binding)
		}
		// Each goroutine's last take may be refused: its grant would
		// come after the run's end, its deadline.
		if n := r.perReq["take"]; n > 1.05+32/float64(max(1, r.requests)) {
			t.Errorf("%s: %.2f take calls a request, want at most 1", r.name(), n)
		}
		if n := r.perReq["adjust"]; n > 1.05 {
			t.Errorf("%s: %.2f settle calls a request, want at most 1", r.name(), n)
		}
	}
}

// TestLLMFleetControls are TestLLMFleet's negative controls, 5 s each:
// per-process limiters meet 429s, a fleet that never settles stays well
// below the settled fleet's rate, and one that reserves the 90th
// percentile of the usage in place of max_tokens meets 429s (Anthropic
// charges max_tokens on arrival). Load only makes each more likely, so
// they run beside the parallel tests.
func TestLLMFleetControls(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	controls := []*llmRun{
		{api: "anthropic", ownLimit: true}, {api: "anthropic", noSettle: true},
		{api: "anthropic", quantile: 550}, // the usage's 90th percentile
		{api: "gemini", ownLimit: true},
		{api: "azure", ownLimit: true}, {api: "bedrock", ownLimit: true},
	}
	runLLM(t, srv, controls, 5*time.Second, 0)
	for _, r := range controls {
		switch {
		case r.ownLimit && r.refused == 0:
			t.Errorf("%s: no 429: the provider's limits do not bind the fleet, and the test shows nothing", r.name())
		case r.noSettle && r.binding > 0.6:
			t.Errorf("%s: %.2f of the binding limit's rate, want well below the settled fleet's", r.name(), r.binding)
		case r.quantile > 0 && r.refused == 0:
			t.Errorf("%s: no 429: reserving less than max_tokens went unpunished, and the test shows nothing", r.name())
		}
		checkRefusalPauses(t, r)
	}
}

// runLLM runs the fleets rs side by side, each for d, the i-th starting
// i×stagger after the first. The first starts once every fleet's
// processes could be up (llmWarmUp): a cold start beside processes
// starting meets a loaded machine, and its first requests reach the
// provider late.
func runLLM(t *testing.T, srv *redistest.Server, rs []*llmRun, d, stagger time.Duration) {
	var wg sync.WaitGroup
	first := time.Now().Add(llmWarmUp)
	for i, r := range rs {
		r.run, r.at = d, first.Add(time.Duration(i)*stagger)
		wg.Go(func() { llmFleet(t, srv, r) })
	}
	wg.Wait()
}

// llmWarmUp is how long runLLM gives its fleets' processes to start: 40
// of them took 3.4 s to be ready on a 2-core machine, 20 about half.
const llmWarmUp = 3 * time.Second
