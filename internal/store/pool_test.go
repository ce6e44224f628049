package store

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redistest"
)

// poolOf returns the candidates of a pool named name, one a Limit, all
// sharing the pool's hash tag, with the last lasts of them last resorts.
func poolOf(name string, lasts int, lims ...Limit) []Candidate {
	cs := make([]Candidate, len(lims))
	for i, lim := range lims {
		cs[i] = Candidate{Bucket: New("quota:", fmt.Sprintf("%s}{d%d", name, i), []Limit{lim}), Last: i >= len(lims)-lasts}
	}
	return cs
}

// At one instant a pool grants at once what its deployments hold, each
// its own burst, the one with the most room relative to its Limit first;
// then it grants from the one that grants soonest. A last resort gives
// nothing while the others hold tokens; a deployment paused gives nothing
// while it is.
func TestPoolChoosesTheDeploymentThatGrantsSoonest(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	at := time.UnixMicro(1_700_000_000_000_000)
	s := NewStore(rdb, Options{Clock: func() time.Time { return at }})
	lims := []Limit{{Rate: 60, Burst: 6}, {Rate: 30, Burst: 3}, {Rate: 10, Burst: 1}}

	takes := func(cs []Candidate, n int) (seq []int) {
		for range n {
			g, i, err := s.TakePool(ctx, cs, Tokens(1), 0)
			if err != nil {
				t.Fatal(err)
			}
			if !g.Granted() {
				i = -1
			}
			seq = append(seq, i)
		}
		return seq
	}
	// The most room first, relative to each Limit: 6, 3 and 1 share out
	// as their bursts, in step.
	got := takes(poolOf("even", 0, lims...), 11)
	count := map[int]int{}
	for _, i := range got {
		count[i]++
	}
	if count[0] != 6 || count[1] != 3 || count[2] != 1 || count[-1] != 1 {
		t.Errorf("11 takes of one instant from bursts 6, 3, 1 went %v, want 6, 3, 1 then a refusal", got)
	}
	if got[0] != 0 || got[1] != 1 || got[2] != 2 {
		t.Errorf("the first three takes went to %v: each to the one with the most room, want 0, 1, 2", got[:3])
	}
	// A last resort gives only when the others cannot.
	got = takes(poolOf("last", 1, lims...), 10)
	for j, i := range got {
		if (j < 9) != (i != 2) {
			t.Errorf("takes %v: the last resort (2) gave take %d", got, j)
			break
		}
	}
	// Once none grants at once, the soonest: at 60/s the first deployment
	// has a token in 16.7ms, the others later.
	g, i, err := s.TakePool(ctx, poolOf("even", 0, lims...), Tokens(1), time.Second)
	if err != nil || !g.Granted() || i != 0 || g.Wait < 16*time.Millisecond || g.Wait > 17*time.Millisecond {
		t.Errorf("a take from the emptied pool: %+v from %d, %v; want the first's in 16.7ms", g, i, err)
	}
	// A paused deployment gives nothing while it is paused.
	cs := poolOf("paused", 0, lims...)
	us := at.UnixMicro()
	if err := rdb.HSet(ctx, cs[0].Call[1], "since", us-1, "until", us+5_000_000).Err(); err != nil {
		t.Fatal(err)
	}
	got = takes(cs, 5)
	if fmt.Sprint(got) != "[1 2 1 1 -1]" {
		t.Errorf("takes from a pool whose first is paused went to %v, want [1 2 1 1 -1]", got)
	}
}

// Many callers take from a pool at once, never waiting, in one call a
// take: each deployment grants no more than its own Limit allows, and
// together they grant nearly all of their sum. Callers that ask at 0.95
// of the sum are nearly all granted at once; taking from a deployment
// chosen at random (the negative control) refuses many of them, the small
// deployment's.
func TestPoolTakesAtomically(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	lims := []Limit{{Rate: 600, Burst: 60}, {Rate: 300, Burst: 30}, {Rate: 100, Burst: 10}}
	// run has 16 callers take from the pool for d, each every every (at
	// once again when 0), and counts the grants of each deployment and
	// the refusals.
	run := func(name string, random bool, d, every time.Duration) (counts [3]int64, refused, calls int64) {
		s := NewStore(rdb, Options{})
		cs := poolOf(name, 0, lims...)
		var wg sync.WaitGroup
		start := time.Now()
		for w := range 16 {
			wg.Go(func() {
				for r := 0; ; r++ {
					next := start.Add(time.Duration(r)*every + time.Duration(w)*every/16)
					if every == 0 {
						next = time.Now()
					}
					if !next.Before(start.Add(d)) {
						return
					}
					time.Sleep(time.Until(next))
					var g Grant
					var i int
					var err error
					if random {
						i = (r + w) % 3
						g, err = s.takeOne(ctx, cs[i].Bucket, Tokens(1), 0)
					} else {
						g, i, err = s.TakePool(ctx, cs, Tokens(1), 0)
					}
					atomic.AddInt64(&calls, 1)
					if err != nil {
						t.Error(err)
						return
					}
					if g.Granted() {
						atomic.AddInt64(&counts[i], 1)
					} else {
						atomic.AddInt64(&refused, 1)
					}
				}
			})
		}
		wg.Wait()
		return
	}
	const d = time.Second
	before := evals(t, rdb)
	counts, _, calls := run("atomic", false, d, 0)
	if n := evals(t, rdb) - before; n > calls+1 {
		t.Errorf("%d takes made %d script calls, want one each", calls, n)
	}
	sum := int64(0)
	for i, n := range counts {
		sum += n
		most := lims[i].Burst + lims[i].Rate*(d.Seconds()+0.1)
		if float64(n) > most {
			t.Errorf("deployment %d granted %d, more than its Limit's %.0f", i, n, most)
		}
	}
	t.Logf("at full speed the pool granted %v, %d of %.0f", counts, sum, 1000*d.Seconds())
	if float64(sum) < 0.9*1000*d.Seconds() {
		t.Errorf("the pool granted %d, want at least 0.9 of its sum", sum)
	}
	every := 16 * time.Second / 950
	counts, refused, calls := run("paced", false, 1500*time.Millisecond, every)
	t.Logf("at 0.95 of its sum the pool granted %v and refused %d of %d", counts, refused, calls)
	if float64(refused) > 0.02*float64(calls) {
		t.Errorf("the pool refused %d of %d takes at 0.95 of its sum, want at most 2%%", refused, calls)
	}
	counts, refused, calls = run("random", true, 1500*time.Millisecond, every)
	t.Logf("at random the deployments granted %v and refused %d of %d", counts, refused, calls)
	if float64(refused) < 0.15*float64(calls) {
		t.Errorf("takes at random were refused %d of %d times, want at least 15%%: the control cannot fail", refused, calls)
	}
}

// evals returns how many script calls rdb's server has run, by EVALSHA
// or EVAL.
func evals(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	var n int64
	for line := range strings.Lines(info) {
		for _, cmd := range []string{"cmdstat_evalsha:calls=", "cmdstat_eval:calls="} {
			if rest, ok := strings.CutPrefix(line, cmd); ok {
				c, _, _ := strings.Cut(rest, ",")
				v, _ := strconv.ParseInt(c, 10, 64)
				n += v
			}
		}
	}
	return n
}

// A pool's take keeps its priority class: on deployments whose queues
// class 0 filled, a take of class 1 is granted ahead of them, from the
// deployment where it is soonest, and a take of class 0 behind them.
func TestPoolKeepsPriorities(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	at := time.UnixMicro(1_700_000_000_000_000)
	s := NewStore(rdb, Options{Clock: func() time.Time { return at }})
	cs := poolOf("classes", 0, Limit{Rate: 10, Burst: 1}, Limit{Rate: 10, Burst: 1})
	for range 10 { // a queue of half a second on each
		if g, _, err := s.TakePool(ctx, cs, Tokens(1), time.Minute); err != nil || !g.Granted() {
			t.Fatalf("a take of class 0: %+v, %v", g, err)
		}
	}
	low, _, err := s.TakePool(ctx, cs, Tokens(1), time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	high, _, err := s.TakePool(ctx, cs, Cost{N: 1, Class: 1}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("class 0 waits %v, class 1 %v", low.Wait, high.Wait)
	if !low.Granted() || !high.Granted() || high.Wait >= low.Wait/2 {
		t.Errorf("behind a queue of class 0, class 0 waits %v and class 1 %v, want class 1 well ahead", low.Wait, high.Wait)
	}
}
