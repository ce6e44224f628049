package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/logtest"
	"github.com/sharedquota/quota/internal/redistest"
)

// logRecorder keeps the records logged.
type logRecorder = logtest.Recorder

// limiterOptions are the go-redis options a limiter's client should have:
// short timeouts and no retries, so that an outage is detected within one
// call's timeout.
func limiterOptions(addr string) *redis.Options {
	return &redis.Options{
		Addr:                  addr,
		DialTimeout:           100 * time.Millisecond,
		ReadTimeout:           100 * time.Millisecond,
		WriteTimeout:          100 * time.Millisecond,
		PoolTimeout:           100 * time.Millisecond,
		MaxRetries:            -1,
		DialerRetries:         1,
		ContextTimeoutEnabled: true,
	}
}

// degradedMini returns a Limiter on a miniredis with policy p and its log.
func degradedMini(t *testing.T, p Policy) (*miniredis.Miniredis, *Limiter, *logRecorder) {
	t.Helper()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(limiterOptions(mr.Addr()))
	t.Cleanup(func() { rdb.Close() })
	logs := &logRecorder{}
	return mr, NewLimiter(rdb, WithPolicy(p), WithLogger(slog.New(logs))), logs
}

// waitForMode polls l until it is in mode m or d has passed.

func TestPolicies(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 10}
	for _, tc := range []struct {
		policy Policy
		mode   Mode
		level  slog.Level
		check  func(t *testing.T, l *Limiter)
	}{
		{FailClosed, ModeClosed, slog.LevelError, func(t *testing.T, l *Limiter) {
			start := time.Now()
			for range 100 {
				if err := l.Wait(ctx, "k", lim); !errors.Is(err, ErrUnavailable) {
					t.Fatalf("err = %v, want ErrUnavailable", err)
				}
			}
			if d := time.Since(start); d > 100*time.Millisecond {
				t.Errorf("100 refusals took %v: the breaker still pays Redis", d)
			}
		}},
		{Policy{}, ModeClosed, slog.LevelError, func(t *testing.T, l *Limiter) {
			if err := l.Wait(ctx, "k", lim); !errors.Is(err, ErrUnavailable) {
				t.Fatalf("the zero Policy: err = %v, want ErrUnavailable", err)
			}
		}},
		{FailOpen, ModeOpen, slog.LevelError, func(t *testing.T, l *Limiter) {
			for range 1000 {
				if err := l.Wait(ctx, "k", lim); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{FallbackLocal(4), ModeLocal, slog.LevelWarn, func(t *testing.T, l *Limiter) {
			// A quarter of the limit, 25 a second, starting empty: 7
			// tokens take 280ms.
			start := time.Now()
			for range 7 {
				if err := l.Wait(ctx, "k", lim); err != nil {
					t.Fatal(err)
				}
			}
			if d := time.Since(start); d < 150*time.Millisecond || d > 500*time.Millisecond {
				t.Errorf("7 tokens from an empty local 25/s bucket took %v, want about 280ms", d)
			}
		}},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			mr, l, logs := degradedMini(t, tc.policy)
			if err := l.Wait(ctx, "k", lim); err != nil {
				t.Fatal(err)
			}
			mr.Close()
			// The request that finds Redis gone is served by the policy too.
			err := l.Wait(ctx, "k", lim)
			if tc.mode == ModeClosed != errors.Is(err, ErrUnavailable) {
				t.Fatalf("first request after the outage: err = %v", err)
			}
			if l.Mode() != tc.mode {
				t.Fatalf("Mode() = %v, want %v", l.Mode(), tc.mode)
			}
			tc.check(t, l)
			if err := mr.Restart(); err != nil {
				t.Fatal(err)
			}
			took := waitForMode(t, l, ModeShared, 3*time.Second)
			t.Logf("shared again %v after Redis came back", took)
			if n := logs.Count(tc.level, "Redis unavailable"); n != 1 {
				t.Errorf("%d records at %v of the outage, want 1:\n%s", n, tc.level, logs)
			}
			if n := logs.Count(slog.LevelInfo, "available again"); n != 1 {
				t.Errorf("%d recovery records, want 1:\n%s", n, logs)
			}
			if err := l.Wait(ctx, "k", lim); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestOutageLogRecord(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	mr, l, logs := degradedMini(t, FallbackLocal(3))
	addr := mr.Addr()
	mr.Close()
	_ = l.Wait(context.Background(), "api.example.com", PerSecond(10))
	r, ok := logs.First("Redis unavailable")
	if !ok {
		t.Fatal("no record of the outage")
	}
	attrs := map[string]string{}
	r.Attrs(func(a slog.Attr) bool { attrs[a.Key] = a.Value.String(); return true })
	for k, want := range map[string]string{"redis": addr, "bucket": "api.example.com", "policy": "fallback local (3 workers)", "mode": "local"} {
		if attrs[k] != want {
			t.Errorf("record attribute %s = %q, want %q", k, attrs[k], want)
		}
	}
	if attrs["cause"] == "" {
		t.Error("the record does not say what failed")
	}
}

func TestScriptErrorDoesNotSwitchMode(t *testing.T) {
	mr, l, logs := degradedMini(t, FailOpen)
	mr.Set("quota:{k}", "not a number")
	mr.HSet("quota:{h}", "f", "v")
	for _, key := range []string{"k", "h"} {
		if err := l.Wait(context.Background(), key, PerSecond(1)); !errors.Is(err, ErrScript) {
			t.Errorf("%s: err = %v, want ErrScript", key, err)
		}
	}
	if l.Mode() != ModeShared || logs.Count(slog.LevelError, "") != 0 {
		t.Errorf("a script error switched the mode to %v:\n%s", l.Mode(), logs)
	}
}

func TestCallerCancelIsNotAnOutage(t *testing.T) {
	mr, l, logs := degradedMini(t, FailOpen)
	mr.SetTime(time.Now())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := l.Wait(ctx, "k", PerSecond(1)); !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if l.Mode() != ModeShared || logs.Len() != 0 {
		t.Errorf("a cancelled caller switched the mode to %v", l.Mode())
	}
}

type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

func TestClassify(t *testing.T) {
	_, l, _ := degradedMini(t, FailClosed)
	ctx := context.Background()
	for _, tc := range []struct {
		err  error
		want error
	}{
		{replyError("LOADING Redis is loading the dataset in memory"), ErrUnavailable},
		{replyError("CLUSTERDOWN The cluster is down"), ErrUnavailable},
		{replyError("READONLY You can't write against a read only replica."), ErrUnavailable},
		{replyError("MASTERDOWN Link with MASTER is down"), ErrUnavailable},
		{replyError("TRYAGAIN Multiple keys request during rehashing of slot"), ErrUnavailable},
		{replyError("BUSY Redis is busy running a script"), ErrUnavailable},
		{redis.ErrPoolTimeout, ErrUnavailable},
		{redis.ErrClosed, ErrUnavailable},
		{errors.New("dial tcp 127.0.0.1:1: connect: connection refused"), ErrUnavailable},
		{replyError("ERR user_script:1: Script attempted to access nonexistent global variable"), ErrScript},
		{replyError("WRONGTYPE Operation against a key holding the wrong kind of value"), ErrScript},
		{replyError("NOPERM User quota has no permissions to run the 'evalsha' command"), ErrNoPermission},
	} {
		if got := l.classify(ctx, tc.err); !errors.Is(got, tc.want) {
			t.Errorf("classify(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if got := l.classify(cancelled, context.Canceled); got != context.Canceled {
		t.Errorf("classify of the caller's cancellation = %v", got)
	}
	// The connection's deadline, taken from the context's, can fire a moment
	// before the context reports it: still the caller's deadline.
	expiring := pastDeadline{ctx}
	if got := l.classify(expiring, errors.New("read tcp: i/o timeout")); got != context.DeadlineExceeded {
		t.Errorf("classify of a timeout at the caller's deadline = %v, want context.DeadlineExceeded", got)
	}
}

func TestCountingWorkers(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	mr := miniredis.RunT(t)
	policy := FallbackLocal(2).CountingWorkers()
	var ls []*Limiter
	for range 5 {
		rdb := redis.NewClient(limiterOptions(mr.Addr()))
		t.Cleanup(func() { rdb.Close() })
		ls = append(ls, NewLimiter(rdb, WithPolicy(policy), WithLogger(slog.New(&logRecorder{}))))
	}
	// A Limiter that never saw a count divides by the floor.
	if d := ls[0].workers.Divisor(policy.workers); d != 2 {
		t.Errorf("divisor before any count = %d, want the floor 2", d)
	}
	for i, l := range ls {
		if err := l.Wait(context.Background(), "k", PerSecond(100)); err != nil {
			t.Fatal(err)
		}
		// The announcements run in the background: let each land before the
		// next, so that the last Limiter counts all five.
		eventually(t, 2*time.Second, fmt.Sprintf("worker %d to announce itself", i+1), func() bool {
			m, _ := mr.ZMembers("quota:workers")
			return len(m) == i+1
		})
	}
	l := ls[len(ls)-1]
	eventually(t, 2*time.Second, "a divisor of 5 after 5 workers announced themselves", func() bool { return l.workers.Divisor(policy.workers) == 5 })
	if n, _ := mr.ZMembers("quota:workers"); len(n) != 5 {
		t.Errorf("%d announcements in Redis, want 5", len(n))
	}
	// The count never drops below the floor, and a smaller count does not
	// lower the peak while it is held.
	l.workers.Saw(1)
	if d := l.workers.Divisor(policy.workers); d != 5 {
		t.Errorf("divisor after a count of 1 = %d, want the held peak 5", d)
	}
	if d := l.workers.Divisor(8); d != 8 {
		t.Errorf("divisor with a floor of 8 = %d, want 8", d)
	}

	// In an outage, the last Limiter grants at a fifth of the rate.
	mr.Close()
	lim := Limit{Rate: 50, Burst: 5}
	start := time.Now()
	for range 6 { // from an empty local share at 10 a second
		if err := l.Wait(context.Background(), "k", lim); err != nil {
			t.Fatal(err)
		}
	}
	if d := time.Since(start); d < 400*time.Millisecond || d > 900*time.Millisecond {
		t.Errorf("6 tokens at a fifth of 50/s took %v, want about 600ms", d)
	}
	if l.Mode() != ModeLocal {
		t.Errorf("Mode() = %v, want local", l.Mode())
	}
}

func TestPolicyConstructionErrors(t *testing.T) {
	mustPanic(t, "FallbackLocal(0)", func() { FallbackLocal(0) })
	mustPanic(t, "FallbackLocal(-1)", func() { FallbackLocal(-1) })
	mustPanic(t, "FailOpen.CountingWorkers()", func() { FailOpen.CountingWorkers() })
	for p, want := range map[*Policy]string{&FailOpen: "fail open", &FailClosed: "fail closed"} {
		if p.String() != want {
			t.Errorf("String() = %q, want %q", p.String(), want)
		}
	}
	if s := FallbackLocal(3).CountingWorkers().String(); s != "fallback local (counted workers, at least 3)" {
		t.Errorf("String() = %q", s)
	}
	if s := Mode(9).String(); s != "Mode(9)" {
		t.Errorf("Mode(9).String() = %q", s)
	}
}

var _ http.RoundTripper = (*Transport)(nil)

// pastDeadline is a context whose deadline has passed but which does not
// report it yet.
type pastDeadline struct{ context.Context }

func (pastDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }
