package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/sharedquota/quota/demo/internal/chart"
	"github.com/sharedquota/quota/demo/internal/live"
	"github.com/sharedquota/quota/demo/internal/provider"
	"github.com/sharedquota/quota/demo/internal/redisproc"
)

// demo is what the phases share: the provider, Redis and the display.
type demo struct {
	cfg       config
	prov      *provider.Provider
	redis     *redisproc.Server // nil when -redis names a Redis
	redisAddr string
	display   *live.Display
}

// run runs the phases, reports them and returns the exit code: 0 when
// the shared bucket kept the provider within the limit, 1 when it did not,
// 2 when the demo could not run. Progress, logs and the table go to stdout,
// or to stderr with -json, when stdout gets the summary as JSON.
func run(ctx context.Context, cfg config, stdout, stderr io.Writer) int {
	out := stdout
	if cfg.json {
		out = stderr
	}
	d := &demo{cfg: cfg, redisAddr: cfg.redis}
	if err := d.setUp(); err != nil {
		fmt.Fprintln(stderr, "quotademo:", err)
		return 2
	}
	defer d.tearDown()
	d.display = live.New(out)
	fmt.Fprintf(out, "quota demo: %d worker processes x %d goroutines call one provider that allows %s (burst %d).\n",
		cfg.workers, cfg.goroutines, perMinute(cfg.perMinute), cfg.burst)
	fmt.Fprintf(out, "Redis %s (%s), provider %s (latency ~%v).\n", d.redisAddr, d.redisOrigin(), d.prov.URL(), cfg.latency)

	var results []phaseResult
	for _, ph := range plan(d.redis != nil, cfg.retryAfter()) {
		if len(cfg.phases) > 0 && !slices.Contains(cfg.phases, ph.num) {
			continue
		}
		res, err := d.runPhase(ctx, ph)
		if err != nil {
			d.display.Close()
			if ctx.Err() != nil {
				err = errors.New("interrupted")
			}
			fmt.Fprintf(stderr, "quotademo: phase %d: %v\n", ph.num, err)
			return 2
		}
		results = append(results, res)
	}
	d.display.Close()

	sum := summarize(cfg, results)
	if err := d.writeFiles(&sum, results); err != nil {
		fmt.Fprintln(stderr, "quotademo: writing the picture:", err)
		return 2
	}
	fmt.Fprintln(out)
	sum.writeTable(out)
	if cfg.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(sum); err != nil {
			fmt.Fprintln(stderr, "quotademo:", err)
			return 2
		}
	}
	if !sum.OK {
		return 1
	}
	return 0
}

// setUp starts Redis, unless one was given, and the provider.
func (d *demo) setUp() error {
	if d.redisAddr == "" {
		srv, err := redisproc.Start()
		if err != nil {
			return err
		}
		d.redis, d.redisAddr = srv, srv.Addr()
	}
	prov, err := provider.Start(d.cfg.ratePerSecond(), d.cfg.burst, d.cfg.latency)
	if err != nil {
		d.tearDown()
		return err
	}
	d.prov = prov
	return nil
}

// tearDown stops what setUp started.
func (d *demo) tearDown() {
	if d.prov != nil {
		_ = d.prov.Close()
	}
	if d.redis != nil {
		_ = d.redis.Stop()
	}
}

// redisOrigin says where the Redis comes from.
func (d *demo) redisOrigin() string {
	if d.redis != nil {
		return "a redis-server started for the demo"
	}
	return "given with -redis"
}

// writeFiles writes the picture and the provider's arrivals into the output
// directory and notes where in sum.
func (d *demo) writeFiles(sum *summary, results []phaseResult) error {
	if err := os.MkdirAll(d.cfg.out, 0o755); err != nil {
		return err
	}
	png := filepath.Join(d.cfg.out, "quota-demo.png")
	svg := filepath.Join(d.cfg.out, "quota-demo.svg")
	if err := chart.Write(figure(d.cfg, results, *sum), png, svg); err != nil {
		return err
	}
	sum.PNG, sum.SVG = png, svg
	sum.CSV = filepath.Join(d.cfg.out, "quota-demo.csv")
	return writeArrivals(sum.CSV, results)
}

// perMinute formats a rate given per minute, for example "600/min".
func perMinute(r float64) string {
	return strconv.FormatFloat(r, 'f', -1, 64) + "/min"
}
