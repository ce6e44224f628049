package quota

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// callerKey marks a Wait's context with the caller's number, for
// replyHook.
type callerKey struct{}

// replyHook calls seen with the caller's number, the time and the reply of
// every script call made under a context marked with callerKey.
type replyHook struct {
	seen func(caller int, at time.Time, reply any)
}

func (replyHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h replyHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if i, ok := ctx.Value(callerKey{}).(int); ok && err == nil {
			if c, ok := cmd.(*redis.Cmd); ok {
				h.seen(i, time.Now(), c.Val())
			}
		}
		return err
	}
}

func (replyHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// dueOf returns when a take's reply, received at at, grants its tokens,
// and false for a refusal or another reply.
func dueOf(at time.Time, reply any) (time.Time, bool) {
	switch v := reply.(type) {
	case int64:
		return at, v == 0
	case []any:
		if len(v) >= 2 && v[0] == int64(1) {
			wait, _ := v[1].(int64)
			return at.Add(time.Duration(wait) * time.Microsecond), true
		}
	}
	return time.Time{}, false
}

// TestOverloadKeepsFirstComeFirstServed: 150 callers on 20/s queue for
// 7.5 s, longer than MaxWait; every caller's context allows 30 s, so each
// gets its place at once and keeps it.
func TestOverloadKeepsFirstComeFirstServed(t *testing.T) {
	const callers = 150
	lim := Limit{Rate: 20, Burst: 1}
	queue := time.Duration(float64(callers-1) / lim.Rate * float64(time.Second))

	srv := redistest.Start(t)
	rdb := srv.Client(t, func(o *redis.Options) { o.PoolSize = callers })
	var mu sync.Mutex
	due := make([]time.Time, callers)       // when the server's last grant to each caller fell due
	first := make([]chan struct{}, callers) // closed on each caller's first reply
	for i := range first {
		first[i] = make(chan struct{})
	}
	rdb.AddHook(replyHook{seen: func(i int, at time.Time, reply any) {
		mu.Lock()
		defer mu.Unlock()
		if d, ok := dueOf(at, reply); ok {
			due[i] = d
		}
		select {
		case <-first[i]:
		default:
			close(first[i])
		}
	}})
	l := NewLimiter(rdb)

	start := time.Now()
	errs := make([]error, callers)
	done := make([]time.Time, callers)
	began := make([]time.Time, callers)
	var wg sync.WaitGroup
	for i := range callers {
		began[i] = time.Now()
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.WithValue(context.Background(), callerKey{}, i), 30*time.Second)
			defer cancel()
			errs[i] = l.Wait(ctx, "overload", lim)
			done[i] = time.Now()
		})
		<-first[i] // the next caller reaches Redis after this one
	}
	wg.Wait()
	t.Logf("%d callers on %v: a queue of %v, all served in %v", callers, lim, queue, time.Since(start).Round(time.Millisecond))

	var longest, lateness time.Duration
	for i := range callers {
		if errs[i] != nil {
			t.Fatalf("caller %d: %v", i, errs[i])
		}
		longest = max(longest, done[i].Sub(began[i]))
		if i > 0 && !due[i].After(due[i-1]) {
			t.Errorf("caller %d was granted for %v, not after caller %d (%v): not first come, first served",
				i, due[i].Sub(start), i-1, due[i-1].Sub(start))
		}
		late := done[i].Sub(due[i])
		if late < -time.Millisecond {
			t.Errorf("caller %d woke %v before its grant fell due", i, -late)
		}
		lateness = max(lateness, late)
	}
	t.Logf("longest wait %v (bound 1.3 x %v); latest wake-up %v after its grant fell due", longest.Round(time.Millisecond), queue, lateness.Round(time.Millisecond))
	if bound := queue * 13 / 10; longest > bound {
		t.Errorf("a caller waited %v, want at most %v", longest, bound)
	}
	// Waking up is the machine's business, not the limiter's: a bound of
	// its own, wide enough for two busy cores.
	if lateness > 500*time.Millisecond {
		t.Errorf("a caller woke %v after its grant fell due", lateness)
	}
}

// TestPauseMovesSleepers: a pause recorded by one Limiter moves the grants
// another Limiter's callers are already sleeping on behind it, each by the
// pause, so that they keep their order and the bucket's rate.
func TestPauseMovesSleepers(t *testing.T) {
	srv := redistest.Start(t)
	const callers = 12
	rdb := srv.Client(t, func(o *redis.Options) { o.PoolSize = callers })
	var mu sync.Mutex
	due := make([]time.Time, callers) // when each grant fell due before the pause
	rdb.AddHook(replyHook{seen: func(i int, at time.Time, reply any) {
		mu.Lock()
		defer mu.Unlock()
		due[i], _ = dueOf(at, reply)
	}})
	a := NewLimiter(rdb)
	b := NewLimiter(srv.Client(t))
	lim := Limit{Rate: 20, Burst: 2}
	bk, _ := b.bucket("sleepers", []Limit{lim})

	// 2 callers granted at once, 10 queued 50 ms apart.
	woke := make([]time.Time, callers)
	var wg sync.WaitGroup
	for i := range callers {
		wg.Go(func() {
			if err := a.Wait(context.WithValue(context.Background(), callerKey{}, i), "sleepers", lim); err != nil {
				t.Error(err)
			}
			woke[i] = time.Now()
		})
	}
	time.Sleep(100 * time.Millisecond)
	const pause = time.Second
	pausedAt := time.Now()
	if err := b.store.pause(context.Background(), bk, pause); err != nil {
		t.Fatal(err)
	}
	wg.Wait()

	moved, escaped := 0, 0
	var lateness time.Duration
	for i := range callers {
		if !due[i].After(pausedAt.Add(50 * time.Millisecond)) {
			escaped++ // due before the pause could reach it
			continue
		}
		moved++
		late := woke[i].Sub(due[i].Add(pause))
		lateness = max(lateness, late)
		if late < 0 {
			t.Errorf("a caller due %v after the pause was recorded woke %v after it: %v before its grant moved behind the pause",
				due[i].Sub(pausedAt), woke[i].Sub(pausedAt), -late)
		}
	}
	t.Logf("%d callers moved by the pause of %v, woken at most %v after their moved grants; %d due before it", moved, pause, lateness, escaped)
	if moved < 6 {
		t.Errorf("%d callers were sleeping at the pause, want most of 10", moved)
	}
	if lateness > 500*time.Millisecond {
		t.Errorf("a caller woke %v after its moved grant: moved too far", lateness)
	}
}

// TestPauseReachesEveryProcess: one 429 with Retry-After, answered to one
// worker process, stops all of them within 50 ms, queued grants
// included, until the pause ends; then the queue resumes at the bucket's
// rate, not all at once.
func TestPauseReachesEveryProcess(t *testing.T) {
	srv := redistest.Start(t)
	var (
		mu       sync.Mutex
		arrivals []time.Time
		first429 time.Time
	)
	const pause = 2 * time.Second
	lim := Limit{Rate: 50, Burst: 5}
	prov := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		now := time.Now()
		mu.Lock()
		defer mu.Unlock()
		arrivals = append(arrivals, now)
		if len(arrivals) == 60 { // one 429, a while into the run
			first429 = now
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer prov.Close()

	runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(prov.URL, "http://"), URL: prov.URL,
		Limit: lim, Goroutines: 5, Duration: 5 * time.Second})
	mu.Lock()
	defer mu.Unlock()
	if first429.IsZero() {
		t.Fatal("the provider never answered 429")
	}
	known, end := first429.Add(50*time.Millisecond), first429.Add(pause)
	var before, during, after []time.Time
	for _, a := range arrivals {
		switch {
		case a.After(first429) && !a.After(known):
			before = append(before, a)
		case a.After(known) && a.Before(end):
			during = append(during, a)
		case !a.Before(end):
			after = append(after, a)
		}
	}
	resumed := time.Duration(0)
	if len(after) > 0 {
		resumed = after[0].Sub(first429)
	}
	t.Logf("3 processes x 5 goroutines on %v: %d requests in the 50ms after the 429, %d from then until the pause of %v ended, %d after it, the first %v after the 429",
		lim, len(before), len(during), pause, len(after), resumed.Round(time.Millisecond))
	if len(during) > 0 {
		t.Errorf("%d requests reached the provider during the pause, the first %v after the 429", len(during), during[0].Sub(first429))
	}
	// The queue resumes at the bucket's rate: in the first half second after
	// the pause, at most one token and the half second's refill (and a
	// little jitter), not the 15 callers at once.
	if n := maxInWindow(after, 500*time.Millisecond); n > 1+int(lim.Rate/2)+3 {
		t.Errorf("%d requests in a half second after the pause, want the bucket's rate", n)
	}
	if len(after) < int(lim.Rate) {
		t.Errorf("%d requests after the pause, want the traffic to resume", len(after))
	}
}
