// Command prioritydemo shows a user's requests jumping a backfill's queue
// across a fleet, from one shared bucket.
//
// Three worker processes run a backfill of 30 goroutines each on a bucket
// of 20 requests a second, a queue of 4.5 s. A fourth process sends one
// user request every half second. In the first phase every request has
// priority 0, and each user request waits out the backfill's queue. In
// the second, a Transport WithPriority serves the user's requests at
// priority 5: they wait the commit horizon (100 ms) and their own token,
// and the backfill takes the rest of the rate.
//
// It prints a table and writes a picture of every request's wait (PNG and
// SVG). It exits 1 if, with priorities, the user's requests waited more
// than 5 token intervals (250 ms) at the 99th percentile.
//
// Usage:
//
//	go run ./priority [-workers 3] [-goroutines 30] [-duration 10s] [-out demo-out]
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
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/demo/internal/chart"
	"github.com/sharedquota/quota/demo/internal/redisproc"
	"github.com/sharedquota/quota/demo/internal/workers"
)

// limit is the shared bucket's: 50 ms a token.
var limit = quota.Limit{Rate: 20, Burst: 5}

// maxInteractive is the p99 wait the user's requests are held to with
// priorities: 5 token intervals.
const maxInteractive = 250 * time.Millisecond

// userEvery is how often the user sends a request.
const userEvery = 500 * time.Millisecond

func main() {
	workers.Main("prioritydemo", workerArg, runWorker, parseFlags, run)
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
	fs := flag.NewFlagSet("prioritydemo", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.IntVar(&c.workers, "workers", 3, "backfill worker `processes`")
	fs.IntVar(&c.goroutines, "goroutines", 30, "goroutines sending requests in each backfill worker")
	fs.DurationVar(&c.duration, "duration", 10*time.Second, "length of each phase (at least 4s)")
	fs.StringVar(&c.out, "out", "demo-out", "`directory` for the picture (PNG and SVG)")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	switch {
	case fs.NArg() > 0:
		return c, fmt.Errorf("unexpected arguments: %v", fs.Args())
	case c.workers < 1, c.goroutines < 1:
		return c, errors.New("-workers and -goroutines must be at least 1")
	case c.duration < 4*time.Second:
		return c, errors.New("-duration must be at least 4s: the user starts 1s in and stops 1s before the end")
	}
	return c, nil
}

// A phase is the priority of the user's requests.
type phase struct {
	priority int
	title    string
}

var phases = []phase{
	{0, "One queue: the user's requests at priority 0, as the backfill's"},
	{5, "WithPriority: the user's requests at priority 5"},
}

// A result is what one phase measured.
type result struct {
	phase
	user, batch []sample
	rate        float64 // requests a second the provider received
	failed      int
}

// p returns the q-th quantile of the waits of ss.
func p(ss []sample, q float64) time.Duration {
	if len(ss) == 0 {
		return 0
	}
	w := make([]float64, len(ss))
	for i, s := range ss {
		w[i] = s.Wait
	}
	slices.Sort(w)
	return time.Duration(w[min(len(w)-1, int(q*float64(len(w))))] * float64(time.Second))
}

// run runs the phases, writes the picture and returns the exit code.
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	rs, err := redisproc.Start()
	if err != nil {
		fmt.Fprintln(stderr, "prioritydemo:", err)
		return 2
	}
	defer rs.Stop()
	fmt.Fprintf(stdout, "priority demo: %d backfill processes x %d goroutines and one user, who sends a request every %v,\n", cfg.workers, cfg.goroutines, userEvery)
	fmt.Fprintf(stdout, "share one bucket of %.0f requests a second (burst %.0f).\n", limit.Rate, limit.Burst)
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
			fmt.Fprintf(stderr, "prioritydemo: phase %d: %v\n", i+1, err)
			return 2
		}
		fmt.Fprintf(stdout, "  the user's %d requests waited %v at the median, %v at p99; the backfill's %v at the median; the provider received %.1f/s\n",
			len(r.user), p(r.user, 0.5).Round(time.Millisecond), p(r.user, 0.99).Round(time.Millisecond),
			p(r.batch, 0.5).Round(10*time.Millisecond), r.rate)
		results = append(results, r)
	}
	png, svg := filepath.Join(cfg.out, "priority-demo.png"), filepath.Join(cfg.out, "priority-demo.svg")
	if err := os.MkdirAll(cfg.out, 0o755); err != nil {
		fmt.Fprintln(stderr, "prioritydemo:", err)
		return 2
	}
	if err := figure(cfg, results).Write(png, svg); err != nil {
		fmt.Fprintln(stderr, "prioritydemo: writing the picture:", err)
		return 2
	}
	fmt.Fprintf(stdout, "\nThe picture: %s (and %s)\n", png, svg)
	for _, r := range results {
		if err := verdict(r); err != nil {
			fmt.Fprintln(stdout, err)
			return 1
		}
	}
	return 0
}

// verdict returns an error if r, a phase with priorities, kept the user
// waiting more than maxInteractive at p99, or failed requests.
func verdict(r result) error {
	switch {
	case r.failed > 0:
		return fmt.Errorf("%d requests failed", r.failed)
	case r.priority > 0 && (len(r.user) == 0 || p(r.user, 0.99) > maxInteractive):
		return fmt.Errorf("at priority %d the user's %d requests waited %v at p99: want at most %v",
			r.priority, len(r.user), p(r.user, 0.99), maxInteractive)
	}
	return nil
}

// runPhase runs one phase with a fresh bucket and a fresh fleet.
func runPhase(ctx context.Context, cfg config, redisAddr string, num int, ph phase, stderr io.Writer) (result, error) {
	var received atomic.Int64
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return result{}, err
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(http.ResponseWriter, *http.Request) { received.Add(1) })}
	go srv.Serve(ln)
	defer srv.Close()

	start := time.Now().Add(400 * time.Millisecond) // the workers start meanwhile
	end := start.Add(cfg.duration)
	base := workerSpec{URL: "http://" + ln.Addr().String() + "/", Redis: redisAddr,
		Prefix: fmt.Sprintf("priority-demo:phase%d:", num), Start: start, End: end}
	var specs []workerSpec
	for range cfg.workers {
		s := base
		s.Goroutines = cfg.goroutines
		specs = append(specs, s)
	}
	user := base
	user.Goroutines, user.Interactive, user.Every, user.Priority = 1, true, userEvery, ph.priority
	user.Start, user.End = start.Add(time.Second), end.Add(-time.Second)
	specs = append(specs, user)
	reports, err := startFleet(ctx, specs, stderr)
	if err != nil {
		return result{}, err
	}
	r := result{phase: ph, rate: float64(received.Load()) / cfg.duration.Seconds()}
	for _, rep := range reports {
		r.failed += rep.Failed
		if rep.Interactive {
			for _, s := range rep.Samples {
				s.At++ // the user's phase starts a second in
				r.user = append(r.user, s)
			}
		} else {
			r.batch = append(r.batch, rep.Samples...)
		}
	}
	return r, nil
}

// figure draws every request's wait in each phase.
func figure(cfg config, results []result) chart.Waits {
	w := chart.Waits{
		Title: fmt.Sprintf("How long each request waited: %d backfill processes x %d goroutines and one user, %.0f requests/s shared",
			cfg.workers, cfg.goroutines, limit.Rate),
		Seconds: cfg.duration.Seconds(),
	}
	for i, r := range results {
		var batch, user chart.Series
		batch.Name, user.Name, user.Marked = "the backfill's requests (priority 0)", fmt.Sprintf("the user's (priority %d)", r.priority), true
		for _, s := range r.batch {
			batch.T, batch.Wait = append(batch.T, s.At), append(batch.Wait, s.Wait)
			w.Top = max(w.Top, s.Wait)
		}
		for _, s := range r.user {
			user.T, user.Wait = append(user.T, s.At), append(user.Wait, s.Wait)
			w.Top = max(w.Top, s.Wait)
		}
		w.Panels = append(w.Panels, chart.WaitPanel{
			Title:  fmt.Sprintf("%d. %s: the user waited %v at p99", i+1, r.title, p(r.user, 0.99).Round(time.Millisecond)),
			Series: []chart.Series{batch, user},
		})
	}
	w.Top *= 1.15 // room for the legend
	return w
}
