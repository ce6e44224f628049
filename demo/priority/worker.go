package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/demo/internal/workers"
)

// workerEnv carries a worker's spec, as JSON, to the worker process;
// workerArg, as the first argument, makes the binary a worker.
const (
	workerEnv = "QUOTA_PRIORITY_DEMO_WORKER"
	workerArg = "-worker"
)

// batchHeader marks the backfill's requests, which WithPriority serves at
// priority 0.
const batchHeader = "X-Batch"

// A workerSpec tells a worker process what to do.
type workerSpec struct {
	URL         string        `json:"url"`
	Redis       string        `json:"redis"`
	Prefix      string        `json:"prefix"` // of the phase's bucket in Redis
	Goroutines  int           `json:"goroutines"`
	Interactive bool          `json:"interactive"` // a user's requests, one goroutine, one every Every; the backfill's otherwise
	Every       time.Duration `json:"every"`
	Priority    int           `json:"priority"` // of the user's requests
	Start       time.Time     `json:"start"`
	End         time.Time     `json:"end"`
}

// A sample is one request: when it was asked for, seconds since the
// phase started, and how long it waited for its token.
type sample struct {
	At   float64 `json:"at"`
	Wait float64 `json:"wait"`
}

// A workerReport is what a worker writes to its stdout when it ends.
type workerReport struct {
	Interactive bool     `json:"interactive"`
	Samples     []sample `json:"samples"`
	Failed      int      `json:"failed"` // requests that failed, not counting the phase's end
}

// runWorker is a worker process: it sends its requests between the spec's
// start and end through a Transport on the shared bucket, and writes a
// workerReport to stdout.
func runWorker() error {
	var spec workerSpec
	if err := json.Unmarshal([]byte(os.Getenv(workerEnv)), &spec); err != nil {
		return fmt.Errorf("worker: bad %s: %w", workerEnv, err)
	}
	redis.SetLogger(quiet{})
	// The limiter's options, but a second to read: the demo's processes
	// share one machine with its Redis, where a reply can take longer
	// than 100 ms, and a refused request would count against the verdict.
	opts := quota.RedisOptions(spec.Redis)
	opts.ReadTimeout, opts.WriteTimeout = time.Second, time.Second
	rdb := redis.NewClient(opts)
	defer rdb.Close()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	tr := quota.NewTransport(rdb, limit, quota.WithPrefix(spec.Prefix), quota.WithLogger(logger),
		quota.WithBase(&http.Transport{MaxIdleConnsPerHost: spec.Goroutines}),
		quota.WithPriority(func(req *http.Request) int {
			if req.Header.Get(batchHeader) != "" {
				return 0 // the backfill, first come first served
			}
			return spec.Priority // a user waits for this one
		}))
	client := &http.Client{Transport: tr}

	ctx, cancel := context.WithDeadline(context.Background(), spec.End)
	defer cancel()
	time.Sleep(time.Until(spec.Start))
	var mu sync.Mutex
	rep := workerReport{Interactive: spec.Interactive}
	// one sends a request, and reports whether the phase goes on: a wait
	// that would outlast the phase fails at once, and ends it.
	one := func() bool {
		asked := time.Now()
		waited, err := send(ctx, client, spec)
		mu.Lock()
		defer mu.Unlock()
		switch {
		case err == nil:
			rep.Samples = append(rep.Samples, sample{At: asked.Sub(spec.Start).Seconds(), Wait: waited.Seconds()})
		case ctx.Err() != nil, !time.Now().Before(spec.End), errors.Is(err, quota.ErrWouldExceedDeadline):
			// The phase's end: a call may fail with its deadline a moment
			// before ctx reports it.
			return false
		default:
			rep.Failed++
		}
		return true
	}
	var wg sync.WaitGroup
	if spec.Interactive {
		// The user sends every Every, whether the last request has its
		// answer or not.
		tick := time.NewTicker(spec.Every)
		defer tick.Stop()
		for ctx.Err() == nil {
			wg.Go(func() { one() })
			select {
			case <-ctx.Done():
			case <-tick.C:
			}
		}
	} else {
		for range spec.Goroutines {
			wg.Go(func() {
				for one() {
				}
			})
		}
	}
	wg.Wait()
	return json.NewEncoder(os.Stdout).Encode(rep)
}

// send makes one request and returns how long it waited for its token:
// until the provider, which answers at once, had its answer written.
func send(ctx context.Context, client *http.Client, spec workerSpec) (time.Duration, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, spec.URL, nil)
	if err != nil {
		return 0, err
	}
	if !spec.Interactive {
		req.Header.Set(batchHeader, "1")
	}
	start := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return time.Since(start), nil
}

// startFleet runs one worker process per spec (see workers.Run).
func startFleet(ctx context.Context, specs []workerSpec, logs io.Writer) ([]workerReport, error) {
	return workers.Run[workerSpec, workerReport](ctx, workerEnv, workerArg, specs, logs)
}

// quiet discards go-redis's own log lines.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}
