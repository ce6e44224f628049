package main

import (
	"context"
	"fmt"
	"io"
	"slices"
	"sync/atomic"
	"time"
)

// runUncontended measures every peer's latency, allocations and throughput
// on buckets that never make anyone wait. The peers take turns in rounds,
// each starting with the next peer, so that a change in the machine's
// other load during the run is shared out among them rather than charged
// to one: latency is taken over the samples of every round, throughput is
// the median of the rounds.
func runUncontended(ctx context.Context, cfg config, addr string, results []peerResult, log io.Writer) error {
	type state struct {
		lat, tput  acquireFunc
		samples    latencySamples
		roundRates []float64
	}
	states := make([]*state, len(results))
	for i, r := range results {
		var n atomic.Int64
		rdb := newClient(addr, &n)
		defer rdb.Close()
		s := &state{
			lat:  r.newAcquire(rdb, fmt.Sprintf("latency-%d", i), unlimited),
			tput: r.newAcquire(rdb, fmt.Sprintf("throughput-%d", i), unlimited),
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
	for round := range cfg.rounds {
		fmt.Fprintf(log, "bench: round %d of %d: %d acquisitions one after another, then %d goroutines for %v, each peer\n",
			round+1, cfg.rounds, ops, cfg.parallel, d)
		for k := range results {
			i := (k + round) % len(results)
			s := states[i]
			if err := s.samples.measure(ctx, s.lat, ops); err != nil {
				return fmt.Errorf("%s: %w", results[i].name, err)
			}
			rate, err := measureThroughput(ctx, s.tput, cfg.parallel, d)
			if err != nil {
				return fmt.Errorf("%s: %w", results[i].name, err)
			}
			s.roundRates = append(s.roundRates, rate)
		}
	}
	for i, s := range states {
		results[i].lat = s.samples.result()
		results[i].perSec = median(s.roundRates)
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
