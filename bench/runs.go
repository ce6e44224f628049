package main

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// runUncontended measures every peer's latency, allocations and throughput
// on buckets that never make anyone wait. The peers take turns in rounds,
// so that a change in the machine's other load during the run is shared
// out among them rather than charged to one; the figures are medians over
// the rounds. Each round times every peer's latency and then every peer's
// throughput, each in an order of its own: in a fixed rotation a peer would
// always follow the same one, and a latency run that follows a busy
// throughput run finds the CPUs awake and runs up to twice as fast.
func runUncontended(ctx context.Context, cfg config, addr string, results []peerResult, log io.Writer) error {
	type state struct {
		lat, tput  acquireFunc
		samples    latencySamples
		roundRates []float64
		sent       *atomic.Int64 // the commands its client sent
		acquired   int64         // by the throughput runs
		commands   int64         // sent during the throughput runs
		cpu        time.Duration // redis-server's, during the throughput runs
	}
	info := redis.NewClient(&redis.Options{Addr: addr}) // asks the server for its CPU time
	defer info.Close()
	states := make([]*state, len(results))
	for i, r := range results {
		n := new(atomic.Int64)
		rdb := newClient(addr, n)
		defer rdb.Close()
		s := &state{
			lat:  r.newAcquire(rdb, fmt.Sprintf("latency-%d", i), unlimited),
			tput: r.newAcquire(rdb, fmt.Sprintf("throughput-%d", i), unlimited),
			sent: n,
		}
		// Dial the connection and load the script before timing.
		for range max(cfg.ops/cfg.rounds/10, 10) {
			if err := s.lat(ctx); err != nil {
				return fmt.Errorf("%s: %w", r.name, err)
			}
			if err := s.tput(ctx); err != nil {
				return fmt.Errorf("%s: %w", r.name, err)
			}
		}
		states[i] = s
	}

	ops, d := max(cfg.ops/cfg.rounds, 1), cfg.throughput/time.Duration(cfg.rounds)
	order := rand.New(rand.NewPCG(1, 2)) // the same orders every run
	for round := range cfg.rounds {
		fmt.Fprintf(log, "bench: round %d of %d: %d acquisitions one after another, each peer; then %d goroutines for %v, each peer\n",
			round+1, cfg.rounds, ops, cfg.parallel, d)
		for _, i := range order.Perm(len(results)) {
			s := states[i]
			if err := s.samples.measure(ctx, s.lat, ops); err != nil {
				return fmt.Errorf("%s: %w", results[i].name, err)
			}
		}
		for _, i := range order.Perm(len(results)) {
			s := states[i]
			cpu0, err := redisCPU(ctx, info)
			if err != nil {
				return err
			}
			sent0 := s.sent.Load()
			n, elapsed, err := measureThroughput(ctx, s.tput, cfg.parallel, d)
			if err != nil {
				return fmt.Errorf("%s: %w", results[i].name, err)
			}
			s.commands += s.sent.Load() - sent0
			cpu1, err := redisCPU(ctx, info)
			if err != nil {
				return err
			}
			s.roundRates = append(s.roundRates, float64(n)/elapsed.Seconds())
			s.acquired += n
			s.cpu += cpu1 - cpu0
		}
	}
	for i, s := range states {
		results[i].lat = s.samples.result()
		results[i].perSec = median(s.roundRates)
		if results[i].redis && s.acquired > 0 {
			results[i].redisCPU = s.cpu / time.Duration(s.acquired)
			results[i].tputCmds = float64(s.commands) / float64(s.acquired)
		}
	}
	return nil
}

// runContended runs r's peer with each number of goroutines of cfg.swarms
// on a fresh low-rate bucket.
func runContended(ctx context.Context, cfg config, addr string, r *peerResult, i int, log io.Writer) error {
	for _, g := range cfg.swarms {
		fmt.Fprintf(log, "bench: %s: %d goroutines on %g/s burst %d for %v\n", r.name, g, cfg.lim.Rate, cfg.lim.Burst, cfg.contended)
		c, err := measureContention(ctx, r.peer, addr, fmt.Sprintf("contended-%d-%d", i, g), cfg.lim, g, cfg.contended)
		if err != nil {
			return err
		}
		r.swarms = append(r.swarms, c)
	}
	return nil
}

// median returns the middle of vs, or the mean of the two middle ones.
func median(vs []float64) float64 {
	s := slices.Sorted(slices.Values(vs))
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}
