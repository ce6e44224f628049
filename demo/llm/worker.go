package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/demo/internal/workers"
	"github.com/sharedquota/quota/llm"
)

// workerEnv carries a worker's spec, as JSON, to the worker process;
// workerArg, as the first argument, makes the binary a worker.
const (
	workerEnv = "QUOTA_LLM_DEMO_WORKER"
	workerArg = "-worker"
)

// How a worker's Transport meters its requests.
const (
	modeOwn       = "own"       // settled, on buckets of its own
	modeUnsettled = "unsettled" // shared buckets, reservations never settled
	modeSettled   = "settled"   // shared buckets, settled from the answers
)

// A workerSpec tells a worker process what to do.
type workerSpec struct {
	ID         int       `json:"id"`
	Mode       string    `json:"mode"`
	URL        string    `json:"url"`
	Redis      string    `json:"redis"`
	Prefix     string    `json:"prefix"` // of the worker's buckets in Redis
	Goroutines int       `json:"goroutines"`
	Start      time.Time `json:"start"`
	End        time.Time `json:"end"`
}

// A workerReport is what a worker writes to its stdout when it ends.
type workerReport struct {
	ID     int `json:"id"`
	Sent   int `json:"sent"`   // answers read to their end
	Failed int `json:"failed"` // requests refused by the limiter or lost, not counting the phase's end
}

// fleetLimits returns the Transport's share of the provider's limits.
func fleetLimits() (requests quota.Limit, m llm.AnthropicLimits) {
	scale := func(b float64) quota.Limit { return quota.Limit{Rate: share * b, Burst: share * b} }
	return scale(limits.Requests.Rate), llm.AnthropicLimits{
		InputTokens:  scale(limits.InputTokens.Rate),
		OutputTokens: scale(limits.OutputTokens.Rate),
	}
}

// runWorker is a worker process: it sends requests from its goroutines
// between the spec's start and end through a metered Transport, and
// writes a workerReport to stdout. The quota package's logs go to stderr.
func runWorker() error {
	var spec workerSpec
	if err := json.Unmarshal([]byte(os.Getenv(workerEnv)), &spec); err != nil {
		return fmt.Errorf("worker: bad %s: %w", workerEnv, err)
	}
	requests, lim := fleetLimits()
	m := llm.Anthropic(lim)
	if spec.Mode == modeUnsettled {
		m.Usage = nil // every reservation stays whole
	}
	redis.SetLogger(quiet{}) // the quota package reports what matters
	rdb := redis.NewClient(quota.RedisOptions(spec.Redis))
	defer rdb.Close()
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	tr := quota.NewTransport(rdb, requests, quota.WithMetering(m), quota.WithPrefix(spec.Prefix), quota.WithLogger(logger),
		quota.WithBase(&http.Transport{MaxIdleConnsPerHost: spec.Goroutines}))
	client := &http.Client{Transport: tr}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := time.AfterFunc(time.Until(spec.End), cancel)
	defer stop.Stop()
	time.Sleep(time.Until(spec.Start))
	var sent, failed atomic.Int64
	var wg sync.WaitGroup
	for g := range spec.Goroutines {
		wg.Go(func() {
			for seq := g; ctx.Err() == nil; seq += spec.Goroutines {
				if err := send(ctx, client, spec, seq); err != nil {
					if ctx.Err() == nil {
						failed.Add(1)
						time.Sleep(10 * time.Millisecond)
					}
					continue
				}
				sent.Add(1)
			}
		})
	}
	wg.Wait()
	fctx, fcancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = tr.Limiter().Flush(fctx) // the settles still running go before the exit
	fcancel()
	return json.NewEncoder(os.Stdout).Encode(workerReport{ID: spec.ID, Sent: int(sent.Load()), Failed: int(failed.Load())})
}

// send posts one message, its length varying with seq, and reads the
// answer to its end; the odd seqs stream.
func send(ctx context.Context, client *http.Client, spec workerSpec, seq int) error {
	text := strings.Repeat("quota shares one limit across a fleet. ", 40)[:300+seq*137%900]
	body, _ := json.Marshal(map[string]any{
		"model":      "claude-demo",
		"max_tokens": maxTokens,
		"stream":     seq%2 == 1,
		"messages":   []map[string]any{{"role": "user", "content": text}},
	})
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, spec.URL, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Quota-Worker", strconv.Itoa(spec.ID))
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body) // the usage is settled as it is read
	return err
}

// startFleet runs one worker process per spec (see workers.Run).
func startFleet(ctx context.Context, specs []workerSpec, logs io.Writer) ([]workerReport, error) {
	return workers.Run[workerSpec, workerReport](ctx, workerEnv, workerArg, specs, logs)
}

// quiet discards go-redis's own log lines.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}
