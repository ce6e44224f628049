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

// scalePoint is one peer's throughput with some number of goroutines on a
// bucket that never makes anyone wait.
type scalePoint struct {
	goroutines int
	peer       string
	perSec     float64       // acquisitions per second, the median of the rounds
	commands   float64       // Redis commands per acquisition
	redisCPU   time.Duration // redis-server's CPU time per acquisition
}

// runScaling measures the peers marked for scaling with each number of
// goroutines of cfg.scale, taking turns in cfg.scaleRounds rounds as the
// throughput runs do. Each peer has a client of its own, with go-redis's
// default pool, and a bucket of its own at each point.
func runScaling(ctx context.Context, cfg config, addr string, log io.Writer) ([]scalePoint, error) {
	info := redis.NewClient(&redis.Options{Addr: addr})
	defer info.Close()
	type state struct {
		peer    peer
		sent    *atomic.Int64
		rdb     *redis.Client
		rates   []float64
		n, cmds int64
		cpu     time.Duration
	}
	var states []*state
	for _, p := range peers {
		if !p.scaling {
			continue
		}
		n := new(atomic.Int64)
		rdb := newClient(addr, n)
		defer rdb.Close()
		states = append(states, &state{peer: p, sent: n, rdb: rdb})
	}
	order := rand.New(rand.NewPCG(3, 4)) // the same orders every run
	var out []scalePoint
	for _, g := range cfg.scale {
		fmt.Fprintf(log, "bench: scaling: %d goroutines, %d rounds of %v, each peer\n", g, cfg.scaleRounds, cfg.scaleRun)
		acquires := make([]acquireFunc, len(states))
		for i, s := range states {
			s.rates, s.n, s.cmds, s.cpu = nil, 0, 0, 0
			acquires[i] = s.peer.newAcquire(s.rdb, fmt.Sprintf("scale-%d-%d", i, g), unlimited)
			if err := acquires[i](ctx); err != nil { // loads the script
				return nil, fmt.Errorf("%s: %w", s.peer.name, err)
			}
		}
		for range cfg.scaleRounds {
			for _, i := range order.Perm(len(states)) {
				s := states[i]
				cpu0, err := redisCPU(ctx, info)
				if err != nil {
					return nil, err
				}
				sent0 := s.sent.Load()
				n, elapsed, err := measureThroughput(ctx, acquires[i], g, cfg.scaleRun)
				if err != nil {
					return nil, fmt.Errorf("%s, %d goroutines: %w", s.peer.name, g, err)
				}
				s.cmds += s.sent.Load() - sent0
				cpu1, err := redisCPU(ctx, info)
				if err != nil {
					return nil, err
				}
				s.rates = append(s.rates, float64(n)/elapsed.Seconds())
				s.n += n
				s.cpu += cpu1 - cpu0
			}
		}
		for _, s := range states {
			p := scalePoint{goroutines: g, peer: s.peer.name, perSec: median(s.rates)}
			if s.n > 0 {
				p.commands = float64(s.cmds) / float64(s.n)
				p.redisCPU = s.cpu / time.Duration(s.n)
			}
			out = append(out, p)
		}
	}
	return out, nil
}

// writeScaling writes the scaling table: a row for each number of
// goroutines, and for each peer its acquisitions per second, Redis
// commands per acquisition and Redis CPU per acquisition; the last column
// is quota's throughput over redis_rate's.
func writeScaling(w io.Writer, cfg config, points []scalePoint) {
	var names []string
	for _, p := range points {
		if !slices.Contains(names, p.peer) {
			names = append(names, p.peer)
		}
	}
	header := []string{"goroutines"}
	for _, name := range names {
		short := shortName(name)
		header = append(header, short+" acq/s", short+" cmds/acq", short+" Redis CPU/acq")
	}
	header = append(header, "quota / redis_rate acq/s")
	rows := [][]string{header}
	for _, g := range cfg.scale {
		row := []string{fmt.Sprint(g)}
		var quota, rr float64
		for _, name := range names {
			i := slices.IndexFunc(points, func(p scalePoint) bool { return p.goroutines == g && p.peer == name })
			if i < 0 {
				row = append(row, "-", "-", "-")
				continue
			}
			p := points[i]
			row = append(row, fmtCount(p.perSec), fmtFloat(p.commands), fmtDuration(float64(p.redisCPU)))
			switch name {
			case quotaName:
				quota = p.perSec
			case redisRateName:
				rr = p.perSec
			}
		}
		ratio := "-"
		if quota > 0 && rr > 0 {
			ratio = fmtRatio(quota / rr)
		}
		rows = append(rows, append(row, ratio))
	}
	fmt.Fprintf(w, "Scaling: goroutines in one process on one bucket that never makes anyone wait, each peer on a client of its own "+
		"(go-redis's default pool, %d connections); acq/s the median of %d runs of %v, cmds/acq and Redis CPU/acq over all of them.\n\n",
		10*gomaxprocs(), cfg.scaleRounds, cfg.scaleRun)
	writeRows(w, rows)
}

// shortName names a peer in the scaling table's headers.
func shortName(name string) string {
	switch name {
	case quotaName:
		return "quota"
	case unbatchedName:
		return "unbatched"
	case redisRateName:
		return "redis_rate"
	}
	return name
}
