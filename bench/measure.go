package main

import (
	"context"
	"fmt"
	"math"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// stampSlack widens the 1-second window of the exactness bound, as the
// library's own tests do: a grant is stamped when its caller wakes, which
// a loaded machine delays by up to a few tens of milliseconds.
const stampSlack = 25 * time.Millisecond

// latency is one peer's uncontended acquisitions, one goroutine.
type latency struct {
	p50, p99 time.Duration
	allocs   float64 // heap allocations per acquisition, whole process
}

// contention is one peer's run with many goroutines on a low-rate bucket.
type contention struct {
	goroutines int
	grants     int
	commands   int64   // Redis commands, connection set-up excluded
	maxIn1s    int     // most grants in any 1-second window
	bound      int     // Burst + Rate over 1 s plus stampSlack
	excess     float64 // the most grants in any window above Burst + Rate x its length; see overIssue
}

// perGrant returns the Redis commands sent per grant.
func (c contention) perGrant() float64 {
	if c.grants == 0 {
		return math.NaN()
	}
	return float64(c.commands) / float64(c.grants)
}

// newClient returns a client on addr with go-redis's defaults, counting
// the commands it sends into n.
func newClient(addr string, n *atomic.Int64) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	rdb.AddHook(countHook{n})
	return rdb
}

// latencySamples collects one peer's uncontended acquisitions across the
// rounds of a run.
type latencySamples struct {
	p50s, p99s []float64 // nanoseconds, one a round
	ops        int
	mallocs    uint64
}

// measure times ops acquisitions one after another on a bucket that
// never makes anyone wait, and counts the heap allocations they make.
func (s *latencySamples) measure(ctx context.Context, acquire acquireFunc, ops int) error {
	times := make([]time.Duration, ops)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := range times {
		start := time.Now()
		if err := acquire(ctx); err != nil {
			return err
		}
		times[i] = time.Since(start)
	}
	runtime.ReadMemStats(&after)
	slices.Sort(times)
	s.p50s = append(s.p50s, float64(times[len(times)/2]))
	s.p99s = append(s.p99s, float64(times[int(math.Ceil(0.99*float64(len(times))))-1]))
	s.ops += ops
	s.mallocs += after.Mallocs - before.Mallocs
	return nil
}

// result returns the median over the rounds of each round's median and
// 99th percentile, and the allocations per acquisition of every round.
// A round's own percentiles, not those of all samples pooled, because the
// machine's other load changes between rounds: on a shared 2-core machine
// the round trip to Redis is sometimes 25 µs and sometimes 60 µs for a
// whole round, and pooled samples would rank the peers by which of them
// happened to draw more fast rounds.
func (s *latencySamples) result() latency {
	return latency{
		p50:    time.Duration(median(s.p50s)),
		p99:    time.Duration(median(s.p99s)),
		allocs: float64(s.mallocs) / float64(s.ops),
	}
}

// measureThroughput runs goroutines that acquire from one never-waiting
// bucket for d and returns how many acquisitions they made and in how long.
func measureThroughput(ctx context.Context, acquire acquireFunc, goroutines int, d time.Duration) (int64, time.Duration, error) {
	var (
		stop  atomic.Bool
		total atomic.Int64
		wg    sync.WaitGroup
		errs  = make(chan error, goroutines)
	)
	start := time.Now()
	for range goroutines {
		wg.Go(func() {
			n := int64(0)
			defer func() { total.Add(n) }()
			for !stop.Load() {
				if err := acquire(ctx); err != nil {
					errs <- err
					return
				}
				n++
			}
		})
	}
	timer := time.AfterFunc(d, func() { stop.Store(true) })
	defer timer.Stop()
	wg.Wait()
	elapsed := time.Since(start)
	close(errs)
	if err := <-errs; err != nil {
		return 0, 0, err
	}
	return total.Load(), elapsed, nil
}

// redisCPU returns the CPU time redis-server has used so far, user and
// system, as its INFO reports it (to the microsecond, on every platform).
func redisCPU(ctx context.Context, rdb *redis.Client) (time.Duration, error) {
	info, err := rdb.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var total time.Duration
	for _, field := range []string{"used_cpu_user:", "used_cpu_sys:"} {
		i := strings.Index(info, "\n"+field)
		if i < 0 {
			return 0, fmt.Errorf("INFO cpu has no %s", strings.TrimSuffix(field, ":"))
		}
		v, _, _ := strings.Cut(info[i+1+len(field):], "\r\n")
		secs, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
		if err != nil {
			return 0, fmt.Errorf("INFO cpu %s: %w", field, err)
		}
		total += time.Duration(secs * float64(time.Second))
	}
	return total, nil
}

// A grant is one acquisition of a contended run: when it was called and
// when it returned. The bucket granted it at some instant in between.
type grant struct{ called, granted time.Time }

// swarm runs goroutines that each acquire in a loop until d has passed,
// all starting together, and returns their grants, in the order they were
// granted. An acquisition in flight at the end is waited for and counted.
func swarm(ctx context.Context, goroutines int, d time.Duration, acquire acquireFunc) ([]grant, error) {
	var (
		mu     sync.Mutex
		grants []grant
		wg     sync.WaitGroup
		errs   = make(chan error, goroutines)
	)
	start := time.Now().Add(50 * time.Millisecond) // every goroutine is up
	end := start.Add(d)
	for range goroutines {
		wg.Go(func() {
			time.Sleep(time.Until(start))
			for time.Now().Before(end) {
				called := time.Now()
				if err := acquire(ctx); err != nil {
					errs <- err
					return
				}
				g := grant{called: called, granted: time.Now()}
				mu.Lock()
				grants = append(grants, g)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	slices.SortFunc(grants, func(a, b grant) int { return a.granted.Compare(b.granted) })
	return grants, <-errs
}

// measureContention runs a swarm of goroutines on a fresh bucket of lim
// and counts the Redis commands and the grants.
func measureContention(ctx context.Context, p peer, addr, key string, lim limit, goroutines int, d time.Duration) (contention, error) {
	var n atomic.Int64
	rdb := newClient(addr, &n)
	defer rdb.Close()
	if err := warmPool(ctx, rdb); err != nil {
		return contention{}, err
	}
	n.Store(0)
	grants, err := swarm(ctx, goroutines, d, p.newAcquire(rdb, key, lim))
	if err != nil {
		return contention{}, fmt.Errorf("%s, %d goroutines: %w", p.name, goroutines, err)
	}
	return contention{
		goroutines: goroutines,
		grants:     len(grants),
		commands:   n.Load(),
		maxIn1s:    maxInWindow(grants, time.Second),
		bound:      bound(lim, time.Second+stampSlack),
		excess:     overIssue(grants, lim),
	}, nil
}

// warmPool fills rdb's connection pool with PINGs from as many goroutines
// as it holds connections, as a client that has been running for a while
// has it: the acquisitions of a contended run then take their tokens at
// once instead of dialling first, which would loosen the windows overIssue
// checks by the time the dials took.
func warmPool(ctx context.Context, rdb *redis.Client) error {
	var wg sync.WaitGroup
	errs := make(chan error, rdb.Options().PoolSize)
	for range rdb.Options().PoolSize {
		wg.Go(func() { errs <- rdb.Ping(ctx).Err() })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// overIssue returns the most grants, in any window [a, b], above what a
// bucket of lim may grant in it, Burst + Rate x (b - a), counting only the
// grants known to lie in the window: those called at a or later and
// returned by b. It is at most 0 for an exact limiter, however late its
// callers wake, since a grant returns after the bucket granted it and is
// called before. A window that starts at a grant's return instead, as
// maxInWindow's do, is shortened when that caller wakes late, and on a
// loaded machine holds more than the bound without any over-issue.
func overIssue(grants []grant, lim limit) float64 {
	byCall := slices.SortedFunc(slices.Values(grants), func(a, b grant) int { return a.called.Compare(b.called) })
	worst := math.Inf(-1)
	var returned []time.Time // of the grants called at a or later, sorted
	for i := len(byCall) - 1; i >= 0; i-- {
		a := byCall[i].called
		at, _ := slices.BinarySearchFunc(returned, byCall[i].granted, time.Time.Compare)
		returned = slices.Insert(returned, at, byCall[i].granted)
		for n, b := range returned {
			worst = max(worst, float64(n+1)-float64(lim.Burst)-lim.Rate*b.Sub(a).Seconds())
		}
	}
	return worst
}

// maxInWindow returns the largest number of grants in any window of length
// w, closed at both ends.
func maxInWindow(grants []grant, w time.Duration) int {
	best, j := 0, 0
	for i := range grants {
		for j < len(grants) && grants[j].granted.Sub(grants[i].granted) <= w {
			j++
		}
		best = max(best, j-i)
	}
	return best
}

// bound is the most grants a bucket of lim may issue in a window of w.
func bound(lim limit, w time.Duration) int {
	return int(math.Floor(float64(lim.Burst) + lim.Rate*w.Seconds()))
}
