package main

import (
	"flag"
	"time"
)

// config is what one run measures and for how long.
type config struct {
	ops         int           // uncontended acquisitions timed per peer
	rounds      int           // turns the peers take at ops and throughput
	parallel    int           // goroutines of the throughput run
	throughput  time.Duration // length of the throughput run
	swarms      []int         // goroutines of each contended run
	contended   time.Duration // length of each contended run
	lim         limit         // the contended runs' bucket
	scale       []int         // goroutines of each point of the scaling table
	scaleRounds int           // turns the peers take at each point
	scaleRun    time.Duration // length of one peer's run at one point
	redisServer string        // the redis-server binary
}

// unlimited never makes a caller wait, so the latency and throughput runs
// time the acquisition alone. Its rate is high enough that no run comes
// near it and low enough that a token is a whole microsecond, which every
// peer's arithmetic resolves: every acquisition changes the bucket and is
// written back, as in real use. (At a billion a second a token is below
// the resolution of the stored times, and some peers would skip the write.)
var unlimited = limit{Rate: 1e6, Burst: 1e9}

// defaultConfig is the full run: about a minute and a half on 2 cores.
func defaultConfig() config {
	return config{
		ops:         30000,
		rounds:      15,
		parallel:    64,
		throughput:  4500 * time.Millisecond,
		swarms:      []int{50, 200},
		contended:   3 * time.Second,
		lim:         limit{Rate: 100, Burst: 10},
		scale:       []int{1, 4, 16, 64, 256},
		scaleRounds: 3,
		scaleRun:    400 * time.Millisecond,
		redisServer: "redis-server",
	}
}

// shortConfig is a smoke run of a few seconds: every row and column, with
// figures too brief to quote. The contended bucket is faster so that 200
// goroutines are each granted once within a fraction of a second.
func shortConfig() config {
	c := defaultConfig()
	c.ops = 300
	c.rounds = 2
	c.throughput = 200 * time.Millisecond
	c.contended = 300 * time.Millisecond
	c.lim = limit{Rate: 1000, Burst: 10}
	c.scaleRounds = 1
	c.scaleRun = 100 * time.Millisecond
	return c
}

// parseFlags reads the command line: -short picks shortConfig, and the
// other flags override either preset.
func parseFlags(fs *flag.FlagSet, args []string) (config, error) {
	short := fs.Bool("short", false, "a smoke run of a few seconds")
	ops := fs.Int("ops", 0, "uncontended acquisitions timed per peer (default 20000, -short 300)")
	tput := fs.Duration("throughput", 0, "length of the 64-goroutine throughput run (default 3s, -short 200ms)")
	cont := fs.Duration("contended", 0, "length of each contended run (default 3s, -short 300ms)")
	rate := fs.Float64("rate", 0, "rate of the contended bucket, tokens per second (default 100, -short 1000)")
	burst := fs.Int("burst", 0, "burst of the contended bucket (default 10)")
	bin := fs.String("redis-server", "redis-server", "the redis-server binary to start")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	c := defaultConfig()
	if *short {
		c = shortConfig()
	}
	if *ops > 0 {
		c.ops = *ops
	}
	if *tput > 0 {
		c.throughput = *tput
	}
	if *cont > 0 {
		c.contended = *cont
	}
	if *rate > 0 {
		c.lim.Rate = *rate
	}
	if *burst > 0 {
		c.lim.Burst = *burst
	}
	c.redisServer = *bin
	return c, nil
}
