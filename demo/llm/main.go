// Command llmdemo shows the quota package keeping a fleet within an LLM
// API's limits, which meter requests, input tokens and output tokens at
// once, and which charge a request's max_tokens when it arrives and give
// back what the answer did not use.
//
// Four worker processes call a fake Anthropic Messages API
// (internal/llmfake) three times. With a metered Transport each on a
// bucket of its own, every worker keeps to the limits and the provider
// receives four times them, answering 429. Sharing the buckets in Redis
// but never settling, the fleet keeps every request's max_tokens reserved
// and reaches about 0.4 of the output-token limit, which binds. Settled
// from the answers' usage, in the JSON body or in the stream (half the
// requests stream), the fleet runs just under the limit with no 429.
//
// It prints a table and writes a picture of the output tokens the
// provider admitted (PNG and SVG). It exits 1 if the settled fleet met a
// 429 or used less than 0.8 of the output limit.
//
// Usage:
//
//	go run ./llm [-workers 4] [-goroutines 8] [-duration 10s] [-out demo-out]
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/sharedquota/quota/demo/internal/chart"
	"github.com/sharedquota/quota/demo/internal/redisproc"
	"github.com/sharedquota/quota/demo/internal/workers"
	"github.com/sharedquota/quota/internal/llmfake"
)

// The provider's limits, a second: a tier's minute limits scaled so that a
// bucket holds one second of its rate and a short phase meets them.
var limits = llmfake.Limits{
	Requests:     llmfake.Bucket{Rate: 100, Burst: 100},
	InputTokens:  llmfake.Bucket{Rate: 40000, Burst: 40000},
	OutputTokens: llmfake.Bucket{Rate: 8000, Burst: 8000},
}

// share is the part of the provider's limits the fleet is given.
const share = 0.95

// maxTokens is what every request asks; the answers use 10 to 60% of it.
const maxTokens = 1000

// latency is how long the provider takes to answer.
const latency = 100 * time.Millisecond

// The settled fleet's figures the demo holds it to (see the exit code).
const minSettled = 0.8

// steadyFrom is when a phase's steady window starts: the first queue of
// reservations is behind it.
const steadyFrom = 2500 * time.Millisecond

func main() {
	workers.Main("llmdemo", workerArg, runWorker, parseFlags, run)
}

// config is the command line.
type config struct {
	workers    int
	goroutines int
	duration   time.Duration // of each phase
	out        string
	phases     []int // the phases to run, by number; all when empty. Not a flag: tests run a phase alone
}

// parseFlags parses the command line; usage and errors go to w.
func parseFlags(args []string, w io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("llmdemo", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.IntVar(&c.workers, "workers", 4, "worker `processes`")
	fs.IntVar(&c.goroutines, "goroutines", 8, "goroutines sending requests in each worker")
	fs.DurationVar(&c.duration, "duration", 10*time.Second, "length of each phase (at least 5s)")
	fs.StringVar(&c.out, "out", "demo-out", "`directory` for the picture (PNG and SVG)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments: %v", fs.Args())
	case c.workers < 1, c.goroutines < 1:
		return c, errors.New("-workers and -goroutines must be at least 1")
	case c.duration < 5*time.Second:
		return c, errors.New("-duration must be at least 5s: the steady window starts 2.5s in")
	}
	return c, nil
}

// A phase is one way the fleet limits itself.
type phase struct {
	mode  string // the workers' modeOwn, modeUnsettled or modeSettled
	title string
}

var phases = []phase{
	{modeOwn, "A metered Transport in each worker, each at the limits"},
	{modeUnsettled, "Shared buckets in Redis, every reservation kept (never settled)"},
	{modeSettled, "Shared buckets in Redis, settled from the body or the stream"},
}

// A result is what the provider saw in one phase.
type result struct {
	phase
	start    time.Time
	records  []llmfake.Record // admitted requests
	refusals []time.Time      // 429s
	used     float64          // output tokens used a second in the steady window, / the limit
	failed   int              // requests the workers' limiters refused or lost
}

// run runs the phases, writes the picture and returns the exit code.
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	rs, err := redisproc.Start()
	if err != nil {
		fmt.Fprintln(stderr, "llmdemo:", err)
		return 2
	}
	defer rs.Stop()
	fmt.Fprintf(stdout, "llm demo: %d worker processes x %d goroutines call a fake Anthropic Messages API that allows\n", cfg.workers, cfg.goroutines)
	fmt.Fprintf(stdout, "%.0f requests, %.0f input tokens and %.0f output tokens a minute (each bucket holds a second of its rate).\n",
		limits.Requests.Rate*60, limits.InputTokens.Rate*60, limits.OutputTokens.Rate*60)
	fmt.Fprintf(stdout, "Every request asks max_tokens %d and uses 10 to 60%% of it; the fleet is given %.0f%% of each limit.\n", maxTokens, share*100)

	var results []result
	for i, ph := range phases {
		if len(cfg.phases) > 0 && !slices.Contains(cfg.phases, i+1) {
			continue
		}
		fmt.Fprintf(stdout, "\nPhase %d: %s.\n", i+1, ph.title)
		r, err := runPhase(ctx, cfg, rs.Addr(), i+1, ph, stderr)
		if err != nil {
			if ctx.Err() != nil {
				err = errors.New("interrupted")
			}
			fmt.Fprintf(stderr, "llmdemo: phase %d: %v\n", i+1, err)
			return 2
		}
		fmt.Fprintf(stdout, "  %d requests admitted, %d refused with 429; %.2f of the output-token limit used from %.1fs on\n",
			len(r.records), len(r.refusals), r.used, steadyFrom.Seconds())
		results = append(results, r)
	}
	png, svg := filepath.Join(cfg.out, "llm-demo.png"), filepath.Join(cfg.out, "llm-demo.svg")
	if err := os.MkdirAll(cfg.out, 0o755); err != nil {
		fmt.Fprintln(stderr, "llmdemo:", err)
		return 2
	}
	if err := chart.Write(figure(cfg, results), png, svg); err != nil {
		fmt.Fprintln(stderr, "llmdemo: writing the picture:", err)
		return 2
	}
	fmt.Fprintf(stdout, "\nThe picture: %s (and %s)\n", png, svg)
	if err := verdict(results[len(results)-1]); err != nil {
		fmt.Fprintln(stdout, err)
		return 1
	}
	return 0
}

// verdict returns an error unless r, the settled fleet's phase, met no 429
// and used at least minSettled of the output limit.
func verdict(r result) error {
	if r.mode != modeSettled {
		return nil
	}
	if len(r.refusals) > 0 || r.used < minSettled {
		return fmt.Errorf("the settled fleet met %d 429s and used %.2f of the output limit: want none, and at least %.1f",
			len(r.refusals), r.used, minSettled)
	}
	return nil
}

// runPhase runs one phase with a fresh provider and a fresh fleet.
func runPhase(ctx context.Context, cfg config, redisAddr string, num int, ph phase, stderr io.Writer) (result, error) {
	prov := &provider{fake: &llmfake.Server{Kind: llmfake.Anthropic, Limits: limits, Latency: latency}}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return result{}, err
	}
	srv := &http.Server{Handler: prov}
	go srv.Serve(ln)
	defer srv.Close()

	start := time.Now().Add(400 * time.Millisecond) // the workers start meanwhile
	var specs []workerSpec
	for id := 1; id <= cfg.workers; id++ {
		prefix := fmt.Sprintf("llm-demo:phase%d:", num)
		if ph.mode == modeOwn {
			prefix = fmt.Sprintf("llm-demo:phase%d:worker%d:", num, id)
		}
		specs = append(specs, workerSpec{ID: id, Mode: ph.mode, URL: "http://" + ln.Addr().String() + "/v1/messages",
			Redis: redisAddr, Prefix: prefix, Goroutines: cfg.goroutines, Start: start, End: start.Add(cfg.duration)})
	}
	reports, err := startFleet(ctx, specs, stderr)
	if err != nil {
		return result{}, err
	}
	r := result{phase: ph, start: start, records: prov.fake.Records(), refusals: prov.refused()}
	for _, rep := range reports {
		r.failed += rep.Failed
	}
	from, to := start.Add(steadyFrom), start.Add(cfg.duration-300*time.Millisecond)
	var used float64
	for _, rec := range r.records {
		if !rec.At.Before(from) && rec.At.Before(to) {
			used += float64(rec.Output)
		}
	}
	r.used = used / to.Sub(from).Seconds() / limits.OutputTokens.Rate
	return r, nil
}

// provider is the fake API, noting when it answers 429.
type provider struct {
	fake *llmfake.Server

	mu       sync.Mutex
	refusals []time.Time
}

func (p *provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	at := time.Now()
	sw := &statusWriter{ResponseWriter: w}
	p.fake.ServeHTTP(sw, r)
	if sw.status == http.StatusTooManyRequests {
		p.mu.Lock()
		p.refusals = append(p.refusals, at)
		p.mu.Unlock()
	}
}

func (p *provider) refused() []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]time.Time(nil), p.refusals...)
}

// statusWriter notes the status of an answer.
type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	if w.status == 0 {
		w.status = code
	}
	w.ResponseWriter.WriteHeader(code)
}

// Flush passes a stream's events on as the fake writes them.
func (w *statusWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		f.Flush()
	}
}

// step is the spacing of the picture's points.
const step = 100 * time.Millisecond

// figure draws the output tokens the provider admitted in each phase.
func figure(cfg config, results []result) chart.Figure {
	lim := limits.OutputTokens
	f := chart.Figure{
		Title: fmt.Sprintf("What the LLM API admitted: %d workers x %d goroutines, output-token limit %.0f/min",
			cfg.workers, cfg.goroutines, lim.Rate*60),
		Unit:    "output tokens",
		Refused: "asked by the requests refused (429)",
		Limit:   lim.Rate * 60,
		Allowed: (lim.Rate + lim.Burst) * 60,
		Seconds: cfg.duration.Seconds(),
	}
	for i, r := range results {
		p := chart.Panel{Title: fmt.Sprintf("%d. %s: %.2fx the limit used from %.1f s, %d refused (429)",
			i+1, r.title, r.used, steadyFrom.Seconds(), len(r.refusals))}
		for at := step; at <= cfg.duration; at += step {
			now := r.start.Add(at)
			var used, refused float64
			for _, rec := range r.records {
				if rec.At.After(now.Add(-time.Second)) && !rec.At.After(now) {
					used += float64(rec.Output)
				}
			}
			for _, t := range r.refusals {
				if t.After(now.Add(-time.Second)) && !t.After(now) {
					refused += maxTokens // what the refused request asked
				}
			}
			p.T = append(p.T, at.Seconds())
			p.Received = append(p.Received, used*60)
			p.Refused = append(p.Refused, refused*60)
		}
		f.Panels = append(f.Panels, p)
	}
	return f
}
