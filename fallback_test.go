package quota

import (
	"context"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of FallbackLocal (fallback.go): each process's local share of a
// bucket while Redis is unavailable, and the hand-over back to the shared
// bucket, which the fleet makes together, through kills, hangs and restarts
// of a real redis-server and across worker processes. The policies' modes
// are tested in policy_test.go.

// TestLocalQueuesKeyedByTheBoundedKey: what FallbackLocal remembers of
// each bucket's queue is keyed by the bucket's key, which is bounded, not
// by its name, which is not.
func TestLocalQueuesKeyedByTheBoundedKey(t *testing.T) {
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t), WithPolicy(FallbackLocal(2)))
	ctx := context.Background()
	lim := Limit{Rate: 1000, Burst: 1}
	for i := range 20 {
		name := fmt.Sprintf("%d-%s", i, strings.Repeat("n", 100_000))
		for range 3 { // a queue: the second and third wait
			if err := l.Wait(ctx, name, lim); err != nil {
				t.Fatal(err)
			}
		}
	}
	longest, n := 0, 0
	for _, k := range l.locals.QueueKeys() {
		longest, n = max(longest, len(k)), n+1
	}
	t.Logf("20 names of 100 kB with a queue: %d queues remembered, the longest key %d bytes", n, longest)
	if n == 0 {
		t.Fatal("no queue remembered: the test shows nothing")
	}
	if bound := len(l.cfg.prefix) + len("{}") + store.MaxNameLen + 2; longest > bound {
		t.Errorf("a queue kept under %d bytes, bound %d", longest, bound)
	}
}

// transition is a change in Redis during a run, and when it happened.
type transition struct {
	what string
	at   time.Time
}

// TestTransitionsAcrossProcesses: 4 worker processes on FallbackLocal(4)
// send through Transports while Redis is killed and restarted empty, hung
// with SIGSTOP and let go, and killed, restarted and killed again before
// the fleet has resumed. In any window of 1 s or 2 s, the seconds around
// every transition included, the provider sees at most Burst + Rate x W
// plus the local shares' bursts, and a jitter allowance of a tenth of a
// second's rate for the callers' wake-ups on two busy cores.
func TestTransitionsAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		lim        Limit
		goroutines int
	}{
		{Limit{Rate: 100, Burst: 10}, 20},
		{Limit{Rate: 10, Burst: 4}, 5},
	} {
		t.Run(tc.lim.String(), func(t *testing.T) {
			t.Parallel()
			const procs = 4
			srv := redistest.Start(t)
			prov := newProvider(t)
			w := startWorkers(t, procs, workerSpec{Addr: srv.Addr(), Key: "transitions", URL: prov.URL, Limit: tc.lim,
				Goroutines: tc.goroutines, Duration: 14 * time.Second, Fallback: procs, Faults: true})
			var events []transition
			at := func(offset time.Duration, what string, do func()) {
				time.Sleep(time.Until(w.start.Add(offset)))
				do()
				events = append(events, transition{what, time.Now()})
			}
			at(2*time.Second, "killed", srv.Kill)
			at(4*time.Second, "restarted empty", srv.Restart)
			at(6*time.Second, "hung (SIGSTOP)", srv.Pause)
			at(7500*time.Millisecond, "let go (SIGCONT)", srv.Resume)
			at(9500*time.Millisecond, "killed", srv.Kill)
			at(10200*time.Millisecond, "restarted empty", srv.Restart)
			at(10900*time.Millisecond, "killed before the fleet resumed", srv.Kill)
			at(11900*time.Millisecond, "restarted empty", srv.Restart)
			w.wait(t)

			arrivals := prov.between(w.start, w.start.Add(w.spec.Duration))
			localBursts := procs * int(math.Max(1, math.Floor(tc.lim.Burst/procs)))
			jitter := int(math.Ceil(tc.lim.Rate/10)) + 1
			for _, win := range []time.Duration{time.Second, 2 * time.Second} {
				limit := bound(tc.lim, win) + localBursts + jitter
				got := maxInWindow(arrivals, win)
				t.Logf("%d requests; at most %d in any %v window (bound %d: Burst + Rate x W %d, local bursts %d, jitter %d)",
					len(arrivals), got, win, limit, bound(tc.lim, win), localBursts, jitter)
				if got > limit {
					t.Errorf("%d requests in a %v window, bound %d; per 100ms: %v", got, win, limit, histogram(arrivals, w.start, 100*time.Millisecond))
				}
			}
			for _, e := range events {
				near := prov.between(e.at.Add(-1500*time.Millisecond), e.at.Add(1500*time.Millisecond))
				t.Logf("%5.1fs  %-32s  busiest 1s window around it: %d", e.at.Sub(w.start).Seconds(), e.what, maxInWindow(near, time.Second))
			}
			// The fleet kept moving: at least 80% of the rate over the run.
			if want := int(0.8 * tc.lim.Rate * w.spec.Duration.Seconds()); len(arrivals) < want {
				t.Errorf("%d requests in %v, want at least %d", len(arrivals), w.spec.Duration, want)
			}
		})
	}
}

// TestFleetResumesTogether: four workers find Redis again at instants
// 150 ms apart, as workers whose probes back off out of step do. They
// leave their local shares together, so no worker draws on the shared
// bucket while another still spends its share: the second around the
// recovery holds the rate, not the rate and the shares still in use.
func TestFleetResumesTogether(t *testing.T) {
	redistest.Long(t)
	got, limit, spread := staggeredRecovery(t, true)
	// Each on its own, they would resume 450 ms apart, as their probes
	// found Redis; together, as far apart as their processes wake, which
	// a loaded machine delays.
	if spread > 200*time.Millisecond {
		t.Errorf("the workers resumed %v apart, want together (on their own, 450ms)", spread)
	}
	if got > limit {
		t.Errorf("%d requests in a 1s window around the recovery, bound %d", got, limit)
	}
}

// TestFleetResumesTogetherCatchesWorkerByWorker is the negative control:
// workers that resume each on its own, as soon as each finds Redis,
// without settling the shared bucket, break the bound of the test above.
func TestFleetResumesTogetherCatchesWorkerByWorker(t *testing.T) {
	redistest.Long(t)
	t.Parallel() // a bound broken alone is broken beside the others too
	got, limit, _ := staggeredRecovery(t, false)
	if got <= limit {
		t.Errorf("workers resuming one by one stayed within the bound: %d in a 1s window, bound %d", got, limit)
	}
}

// staggeredRecovery runs four workers at 100/s into an outage that ends
// for one after the other, 150 ms apart, and returns the busiest 1s window
// at the provider around the recovery, its bound (Burst + Rate, the local
// shares' bursts, a jitter allowance) and how far apart the workers
// resumed. together false resumes each worker on its own.
func staggeredRecovery(t *testing.T, together bool) (got, limit int, spread time.Duration) {
	srv := redistest.Start(t)
	prov := newProvider(t)
	lim := Limit{Rate: 100, Burst: 10}
	const workers = 4
	var proxies []*faultproxy.Proxy
	ws := newWorkersOn(t, workers, lim, FallbackLocal(workers), func() redis.Scripter {
		p := faultproxy.New(t, srv.Addr())
		proxies = append(proxies, p)
		rdb := redis.NewClient(faultOptions(p.Addr()))
		t.Cleanup(func() { rdb.Close() })
		return rdb
	})
	if !together {
		for _, w := range ws {
			turnOff(w.tr.limiter, handOver)
		}
	}
	stop := make(chan struct{})
	done := make(chan []result)
	go func() { done <- drive(ws, 20, prov.URL, stop) }()

	time.Sleep(1500 * time.Millisecond)
	for _, p := range proxies { // Redis is gone for every worker
		p.Refuse(true)
		p.ResetAll()
	}
	time.Sleep(1500 * time.Millisecond)
	healed := time.Now()
	for _, p := range proxies { // and back for one after the other
		p.Refuse(false)
		time.Sleep(150 * time.Millisecond)
	}
	time.Sleep(2 * time.Second)
	close(stop)
	<-done

	var back []time.Time
	for i, w := range ws {
		r, ok := w.logs.Last("available again")
		if !ok {
			t.Fatalf("worker %d never found Redis again:\n%s", i, w.logs)
		}
		back = append(back, r.Time)
		t.Logf("worker %d: shared again %v after the first worker could reach Redis", i, r.Time.Sub(healed).Round(time.Millisecond))
	}
	spread = slices.MaxFunc(back, time.Time.Compare).Sub(slices.MinFunc(back, time.Time.Compare))
	around := prov.between(healed.Add(-time.Second), healed.Add(2*time.Second))
	got = maxInWindow(around, time.Second)
	limit = bound(lim, time.Second) + workers*2 + int(lim.Rate/10) + 1 // local bursts, jitter
	t.Logf("the workers resumed within %v of each other; busiest 1s window around the recovery %d (bound %d); per 100ms from 1s before: %v",
		spread.Round(time.Millisecond), got, limit, histogram(around, healed.Add(-time.Second), 100*time.Millisecond))
	return got, limit, spread
}

// TestSleeperJoinsTheHandOver: a Limiter whose callers all sleep on their
// grants through a Redis outage takes no part in it, yet it must take part
// in the hand-over after it: its reads in the background fail, and so it
// learns of the outage; and the shared bucket grants nothing to anyone
// before the instant the fleet resumes it. The busiest second around the
// restart stays within Burst + Rate and the local shares' bursts.
func TestSleeperJoinsTheHandOver(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	got, limit := sleptThroughOutage(t, true)
	if got > limit {
		t.Errorf("%d requests in a 1s window around the restart, bound %d", got, limit)
	}
}

// TestSleeperJoinsTheHandOverCatchesTheSleeper is the negative control:
// the same fleet, whose Limiters neither learn of an outage from their
// reads nor hold the shared bucket for the resume, breaks the bound: the
// sleeper's callers draw the restarted bucket's Burst + Rate while the
// others still spend their local shares.
func TestSleeperJoinsTheHandOverCatchesTheSleeper(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	got, limit := sleptThroughOutage(t, false)
	if got <= limit {
		t.Errorf("a sleeper that does not join the hand-over stayed within the bound: %d in a 1s window, bound %d", got, limit)
	}
}

// sleptThroughOutage runs three worker processes, 20 goroutines each, and
// a fourth Limiter here, all with FallbackLocal(4) on one 50/s bucket
// (burst 10), into an outage of 0.7 s in which Redis is killed and
// restarted empty. The Limiter here sends its 20 goroutines' first
// requests just before the kill, and they are queued past the restart:
// they sleep through the outage. It returns the busiest 1s window at the
// provider around the restart and its bound. join false has every Limiter
// behave as one that joins only the hand-overs it saw.
func sleptThroughOutage(t *testing.T, join bool) (got, limit int) {
	srv := redistest.Start(t)
	prov := newProvider(t)
	lim := Limit{Rate: 50, Burst: 10}
	const fleet, goroutines = 4, 20
	w := startWorkers(t, fleet-1, workerSpec{Addr: srv.Addr(), Faults: true, URL: prov.URL, Key: prov.Listener.Addr().String(), Limit: lim,
		Goroutines: goroutines, Fallback: fleet, Duration: 5 * time.Second, NoJoin: !join})

	rdb := redis.NewClient(faultOptions(srv.Addr()))
	t.Cleanup(func() { rdb.Close() })
	tr := NewTransport(rdb, lim, WithPolicy(FallbackLocal(fleet)), WithLogger(discardLogger()))
	if !join {
		turnOff(tr.limiter, joins)
	}
	client := &http.Client{Transport: tr}
	ctx, cancel := context.WithDeadline(context.Background(), w.start.Add(w.spec.Duration))
	defer cancel()
	var wg sync.WaitGroup
	time.Sleep(time.Until(w.start.Add(1300 * time.Millisecond))) // the queue is a second long by then
	for range goroutines {
		wg.Go(func() {
			for ctx.Err() == nil {
				req, err := http.NewRequestWithContext(ctx, http.MethodGet, prov.URL, nil)
				if err != nil {
					return
				}
				if resp, err := client.Do(req); err == nil {
					resp.Body.Close()
				} else if ctx.Err() == nil {
					time.Sleep(10 * time.Millisecond)
				}
			}
		})
	}
	time.Sleep(time.Until(w.start.Add(1600 * time.Millisecond)))
	srv.Kill()
	time.Sleep(700 * time.Millisecond)
	srv.Restart()
	restarted := time.Now()
	w.wait(t)
	wg.Wait()
	fctx, fcancel := context.WithTimeout(context.Background(), 5*time.Second)
	_ = tr.Limiter().Flush(fctx)
	fcancel()

	around := prov.between(restarted.Add(-time.Second), restarted.Add(2*time.Second))
	got = maxInWindow(around, time.Second)
	shares := fleet * 3 // each local share's burst: 10 / 4, rounded up
	limit = bound(lim, time.Second) + shares + int(lim.Rate/10) + 1
	t.Logf("join %v: the Limiter here ended %v; busiest 1s window around the restart %d (bound %d); per 100ms from 1s before: %v",
		join, tr.Limiter().Mode(), got, limit, histogram(around, restarted.Add(-time.Second), 100*time.Millisecond))
	return got, limit
}

func TestFaultKilledAndRestarted(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	prov := newProvider(t)
	lim := Limit{Rate: 20, Burst: 10}
	const workers = 2
	ws := newWorkers(t, workers, srv.Addr(), lim, FallbackLocal(workers), nil)

	stop := make(chan struct{})
	done := make(chan []result)
	start := time.Now()
	go func() { done <- drive(ws, 5, prov.URL, stop) }()

	time.Sleep(1500 * time.Millisecond)
	srv.Kill()
	killed := time.Now()
	time.Sleep(2 * time.Second)
	srv.Restart()
	restarted := time.Now()
	time.Sleep(2 * time.Second)
	close(stop)
	<-done
	end := time.Now()

	for i, w := range ws {
		if m := w.tr.Limiter().Mode(); m != ModeShared {
			t.Errorf("worker %d: mode %v after the restart, want shared", i, m)
		}
		t.Logf("worker %d: outage detected %v after the kill, shared again %v after the restart",
			i, logTime(t, w.logs, "Redis unavailable").Sub(killed), logTime(t, w.logs, "available again").Sub(restarted))
	}
	checkTransitions(t, ws, slog.LevelWarn)

	// The local shares start empty and the fleet hands them back to the
	// shared bucket at one instant, lowered to what they hold: the outage
	// adds nothing to Burst + Rate but the wake-ups' jitter.
	all := prov.between(start, end)
	jitter := int(lim.Rate/10) + 1
	got, limit := maxInWindow(all, time.Second), bound(lim, time.Second)+jitter
	t.Logf("provider: %d requests; at most %d in any 1s window (bound Burst+Rate = %d, and %d for jitter)", len(all), got, bound(lim, time.Second), jitter)
	if got > limit {
		t.Errorf("%d requests in a 1s window, bound %d; per 100ms: %v", got, limit, histogram(all, start, 100*time.Millisecond))
	}
	outage := prov.between(killed.Add(200*time.Millisecond), restarted)
	t.Logf("during the outage: %d requests in %v, at most %d in any 1s window", len(outage), restarted.Sub(killed), maxInWindow(outage, time.Second))
	if want := int(0.5 * lim.Rate * restarted.Sub(killed).Seconds()); len(outage) < want {
		t.Errorf("%d requests during the outage, want at least %d: the fallback stalled", len(outage), want)
	}
	if after := prov.between(restarted.Add(time.Second), end); len(after) < int(0.5*lim.Rate) {
		t.Errorf("%d requests in the last second, want the shared bucket's rate", len(after))
	}
}
