package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/sharedquota/quota/demo/internal/provider"
)

// config is the demo's command line.
type config struct {
	workers    int
	goroutines int
	perMinute  float64 // the provider's limit
	burst      int
	duration   time.Duration // of each phase
	latency    time.Duration
	out        string
	redis      string // an existing Redis to use instead of starting one
	json       bool
	pause      time.Duration // the pause the provider asks for in a fourth phase; 0 for no fourth phase
	phases     []int         // the phases to run, by number; all when empty. Not a flag: tests run a phase alone
}

// ratePerSecond returns the limit in requests per second.
func (c config) ratePerSecond() float64 { return c.perMinute / 60 }

// retryAfter returns the pause the provider asks for in the fourth phase as
// its Retry-After says it, in whole seconds; 0 without -pause.
func (c config) retryAfter() time.Duration {
	if c.pause == 0 {
		return 0
	}
	return time.Duration(provider.RetryAfter(c.pause)) * time.Second
}

// parseFlags parses the command line; usage and errors go to w.
func parseFlags(args []string, w io.Writer) (config, error) {
	var c config
	fs := flag.NewFlagSet("quotademo", flag.ContinueOnError)
	fs.SetOutput(w)
	fs.Usage = func() {
		fmt.Fprint(w, `Usage: go run . [flags]

Shows a fleet of worker processes calling one rate-limited provider, three
times: with a local limiter in each worker (the provider gets N times the
limit and answers 429), with one shared quota bucket in Redis (exactly the
limit), and with the shared bucket while Redis is killed and restarted
(still within the limit). With -pause, a fourth time with the shared bucket,
in which the provider answers one request with 429 and Retry-After. Exits 1
if the shared bucket let the provider see more than the limit allows.

Flags:
`)
		fs.PrintDefaults()
	}
	fs.IntVar(&c.workers, "workers", 4, "worker `processes`")
	fs.IntVar(&c.goroutines, "goroutines", 8, "goroutines sending requests in each worker")
	fs.Float64Var(&c.perMinute, "rate", 600, "the provider's limit in requests per `minute`, as providers publish it")
	fs.IntVar(&c.burst, "burst", 0, "`requests` the provider accepts at once on top of the rate; 0 means one second of rate (at least 1)")
	fs.DurationVar(&c.duration, "duration", 12*time.Second, "length of each phase")
	fs.DurationVar(&c.latency, "latency", 200*time.Millisecond, "the provider's typical response time")
	fs.StringVar(&c.out, "out", "demo-out", "`directory` for the picture (PNG and SVG), relative to the working directory")
	fs.StringVar(&c.redis, "redis", "", "use the Redis at `host:port` instead of starting a redis-server; phase 3 then cannot kill it and runs without an outage")
	fs.BoolVar(&c.json, "json", false, "print the summary as JSON on stdout; progress, logs and the table go to stderr")
	fs.DurationVar(&c.pause, "pause", 0, "add a fourth phase in which the provider answers one request, 40% into the phase, with 429 and Retry-After: this pause in whole seconds (at least 1, at most half the phase); 0 means no fourth phase")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected arguments: %v", fs.Args())
	}
	if c.burst == 0 {
		c.burst = int(math.Max(1, math.Ceil(c.ratePerSecond())))
	}
	switch {
	case c.workers < 1, c.goroutines < 1:
		return c, errors.New("-workers and -goroutines must be at least 1")
	case !(c.perMinute > 0) || math.IsInf(c.perMinute, 0):
		return c, errors.New("-rate must be above zero")
	case c.burst < 1:
		return c, errors.New("-burst must be at least 1")
	case c.duration < time.Second:
		return c, errors.New("-duration must be at least 1s")
	case c.latency < 0:
		return c, errors.New("-latency must not be negative")
	case c.pause < 0:
		return c, errors.New("-pause must not be negative")
	case c.pause > 0 && 2*c.retryAfter() > c.duration:
		return c, fmt.Errorf("-pause asks for Retry-After: %d, more than half of -duration %v: the phase would end before it shows the traffic resuming",
			provider.RetryAfter(c.pause), c.duration)
	}
	return c, nil
}
