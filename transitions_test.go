package quota

import (
	"context"
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
