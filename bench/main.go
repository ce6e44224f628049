// Command bench measures quota's Limiter side by side with its peers, on
// one redis-server that it starts itself on a loopback port, and prints a
// table of the peers, quota's targets, and a scaling table:
//
//   - quota's Limiter.Wait, whose goroutines share a script call while one
//     for their bucket is in flight, and the same with WithNoBatching(),
//     a call each; and the same with batching on a client that answers the
//     reads of the buckets' control records itself instead of sending them,
//     what an acquisition cost Redis before runtime control;
//   - github.com/go-redis/redis_rate/v10, GCRA in Lua on the server's clock,
//     with the blocking loop its users write (Allow, sleep RetryAfter, ask
//     again);
//   - the script of the article "Distributed Rate Limiting With Redis and
//     Lua" and its Python acquire loop, ported verbatim;
//   - golang.org/x/time/rate in this process, the lower bound of cost.
//
// For each it reports the uncontended latency (median and p99), the
// acquisitions per second of 64 goroutines with the Redis commands and the
// Redis CPU time they cost per acquisition, the heap allocations per
// acquisition, and, with 50 and 200 goroutines contending for a low-rate
// bucket, the Redis commands per grant, the most grants in any 1-second
// window against the bound Burst + Rate, and whether any window held more
// grants than Burst + Rate x its length (exact). The targets compare
// quota's figures with redis_rate's, with its own without batching and
// with its own without control reads; the
// scaling table gives acquisitions per second, commands and Redis CPU per
// acquisition from 1 to 256 goroutines.
//
//	go run .          # the full run, about a minute and a half
//	go run . -short   # a smoke run of a few seconds
//
// The program exits 1 when redis-server is not on PATH.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

func main() {
	cfg, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = run(ctx, cfg, os.Stdout, os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

// peerResult is everything measured of one peer.
type peerResult struct {
	peer
	lat      latency
	perSec   float64
	tputCmds float64       // Redis commands per acquisition at acq/s
	redisCPU time.Duration // redis-server's CPU time per acquisition at acq/s
	swarms   []contention  // in the order of config.swarms
}

// report is everything one run measured.
type report struct {
	version string       // redis-server's
	peers   []peerResult // in the order of peers
	scaling []scalePoint // in the order of config.scale, then of peers
}

// run measures every peer and writes the tables to out; progress goes to
// log.
func run(ctx context.Context, cfg config, out, log io.Writer) error {
	rep, err := measureAll(ctx, cfg, log)
	if err != nil {
		return err
	}
	writeReport(out, cfg, rep)
	return nil
}

// measureAll starts redis-server, measures every peer on it and stops it.
func measureAll(ctx context.Context, cfg config, log io.Writer) (report, error) {
	srv, err := startServer(ctx, cfg.redisServer)
	if err != nil {
		return report{}, err
	}
	defer srv.stop()
	rep := report{}
	if rep.version, err = serverVersion(ctx, srv.addr); err != nil {
		return report{}, err
	}
	fmt.Fprintf(log, "bench: redis-server %s on %s\n", rep.version, srv.addr)

	rep.peers = make([]peerResult, len(peers))
	for i, p := range peers {
		rep.peers[i].peer = p
	}
	if err := runUncontended(ctx, cfg, srv.addr, rep.peers, log); err != nil {
		return report{}, err
	}
	for i := range rep.peers {
		if err := runContended(ctx, cfg, srv.addr, &rep.peers[i], i, log); err != nil {
			return report{}, err
		}
	}
	if rep.scaling, err = runScaling(ctx, cfg, srv.addr, log); err != nil {
		return report{}, err
	}
	return rep, nil
}

// writeReport writes the peer table, the targets and the scaling table.
func writeReport(w io.Writer, cfg config, rep report) {
	writeTable(w, cfg, rep.version, rep.peers)
	fmt.Fprintln(w)
	writeTargets(w, cfg, rep.peers)
	fmt.Fprintln(w)
	writeScaling(w, cfg, rep.scaling)
}

// serverVersion returns the server's redis_version.
func serverVersion(ctx context.Context, addr string) (string, error) {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer rdb.Close()
	info, err := rdb.Info(ctx, "server").Result()
	if err != nil {
		return "", err
	}
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "redis_version:"); ok {
			return v, nil
		}
	}
	return "", errors.New("INFO server has no redis_version")
}

// gomaxprocs is reported under the table: the figures depend on it.
func gomaxprocs() int { return runtime.GOMAXPROCS(0) }
