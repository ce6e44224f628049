package quota

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redistest"
)

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
	tr.limiter.noJoin = !join
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
