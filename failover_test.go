package quota

import (
	"log/slog"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// The failover tests kill the master that holds a busy bucket while
// workers drive a provider through it, and measure the gap until a
// promoted replica serves the shared bucket again. During the gap the
// policy applies; the workers are never restarted.

// failover runs the workers for a while, calls kill with the Redis key of
// the provider's bucket, and reports the gap until every worker is back on
// the shared bucket. The provider sees at most Burst + Rate in any second,
// around the failover too, plus the local shares' bursts and a jitter
// allowance.
func failover(t *testing.T, ws []worker, kill func(rkey string)) {
	t.Helper()
	prov := newProvider(t)
	name, err := Host(httptest.NewRequest("GET", prov.URL, nil))
	if err != nil {
		t.Fatal(err)
	}
	rkey, _ := bucketKey(ws[0].tr.Limiter().cfg.prefix, name)
	lim := ws[0].tr.limit
	stop := make(chan struct{})
	done := make(chan []result)
	start := time.Now()
	go func() { done <- drive(ws, 5, prov.URL, stop) }()

	time.Sleep(1500 * time.Millisecond)
	kill(rkey)
	killed := time.Now()
	var gap time.Duration
	for i, w := range ws {
		for w.logs.Count(slog.LevelInfo, "available again") == 0 {
			if time.Since(killed) > 30*time.Second {
				t.Fatalf("worker %d: not back on the shared bucket 30s after the kill (mode %v):\n%s", i, w.tr.Limiter().Mode(), w.logs)
			}
			time.Sleep(time.Millisecond)
		}
		r, _ := w.logs.Last("available again")
		up := r.Time.Sub(killed)
		gap = max(gap, up)
		t.Logf("worker %d: outage found %v and shared again %v after the kill",
			i, logTime(t, w.logs, "Redis unavailable").Sub(killed), up)
	}
	time.Sleep(1500 * time.Millisecond)
	close(stop)
	res := <-done
	end := time.Now()

	failed := 0
	for _, r := range res {
		if r.err != nil {
			failed++
		}
	}
	all := prov.between(start, end)
	during := prov.between(killed, killed.Add(gap))
	localBursts := len(ws) * int(max(1, lim.Burst/float64(len(ws))))
	got, limit := maxInWindow(all, time.Second), bound(lim, time.Second)+localBursts+int(lim.Rate/10)+1
	around := maxInWindow(prov.between(killed.Add(-time.Second), killed.Add(gap+time.Second)), time.Second)
	t.Logf("gap %v: the provider got %d requests during it, %d in all, at most %d in any 1s window, %d around the failover (bound %d); %d requests failed",
		gap.Round(time.Millisecond), len(during), len(all), got, around, limit, failed)
	if got > limit {
		t.Errorf("%d requests in a 1s window, bound %d; per 100ms: %v", got, limit, histogram(all, start, 100*time.Millisecond))
	}
	if failed > 0 {
		t.Errorf("%d requests failed under FallbackLocal", failed)
	}
	if after := prov.between(end.Add(-time.Second), end); len(after) < int(0.5*lim.Rate) {
		t.Errorf("%d requests in the last second, want the shared bucket's rate", len(after))
	}
	checkTransitions(t, ws, slog.LevelWarn)
}

func TestClusterFailover(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 1)
	ws := newWorkersOn(t, 4, Limit{Rate: 20, Burst: 8}, FallbackLocal(4), func() redis.Scripter {
		return cluster.Client(t, func(o *redis.ClusterOptions) {
			o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
			o.MaxRetries, o.DialerRetries, o.ContextTimeoutEnabled = -1, 1, true
		})
	})
	failover(t, ws, func(rkey string) {
		cluster.WaitInSync(rkey) // a replica that has not caught up cannot take over
		cluster.MasterFor(rkey).Kill()
	})
}

func TestSentinelFailover(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	s := redistest.StartSentinel(t)
	ws := newWorkersOn(t, 4, Limit{Rate: 20, Burst: 8}, FallbackLocal(4), func() redis.Scripter {
		return s.FailoverClient(t, func(o *redis.FailoverOptions) {
			o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
			o.MaxRetries, o.DialerRetries, o.ContextTimeoutEnabled = -1, 1, true
		})
	})
	failover(t, ws, func(string) {
		s.WaitInSync()
		s.CurrentMaster().Kill()
	})
}
