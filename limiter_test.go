package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of the Limiter (limiter.go): Allow and AllowN, a call's input
// checked before any Redis call, one subscription to the control channel
// per Limiter, the scripts loaded again after NOSCRIPT, and what it keeps
// per bucket name. Its kinds of Redis client are tested in
// limiter_clients_test.go.

// allowAtOnce runs allow in goroutines goroutines released together, and
// returns how many were allowed and the longest a call took.
func allowAtOnce(t *testing.T, goroutines int, allow func() (bool, error)) (allowed int, slowest time.Duration) {
	t.Helper()
	var wg sync.WaitGroup
	var mu sync.Mutex
	start := make(chan struct{})
	for range goroutines {
		wg.Go(func() {
			<-start
			begun := time.Now()
			ok, err := allow()
			took := time.Since(begun)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				t.Errorf("Allow: %v", err)
			}
			if ok {
				allowed++
			}
			slowest = max(slowest, took)
		})
	}
	close(start)
	wg.Wait()
	return allowed, slowest
}

// The script grants exactly the burst to Allow calls racing for it, and a
// call that is refused neither waits nor takes anything.
func TestAllowGrantsTheBurstAndNeverWaits(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb)
	ctx := context.Background()

	// A token every 20s: nothing refills while the test runs, and each
	// refused call would otherwise have waited seconds to minutes.
	lim := Limit{Rate: 0.05, Burst: 10}
	allowed, slowest := allowAtOnce(t, 200, func() (bool, error) { return l.Allow(ctx, "burst", lim) })
	t.Logf("%d of 200 concurrent Allow calls allowed, the slowest took %v", allowed, slowest)
	if allowed != 10 {
		t.Errorf("%d of 200 concurrent Allow calls allowed, want the burst, 10", allowed)
	}
	if slowest > 2*time.Second {
		t.Errorf("an Allow call took %v; it must never wait (the shortest wait was 20s)", slowest)
	}
	if ok, err := l.Allow(ctx, "burst", lim); ok || err != nil {
		t.Errorf("Allow on the empty bucket = %v, %v; want false, nil", ok, err)
	}

	// A token a second: refused calls take nothing, so the token is there
	// again once a second has passed since the last grant.
	lim = Limit{Rate: 1, Burst: 1}
	if ok, err := l.Allow(ctx, "refill", lim); !ok || err != nil {
		t.Fatalf("Allow on a full bucket = %v, %v", ok, err)
	}
	granted := time.Now()
	refused := 0
	for time.Since(granted) < 300*time.Millisecond {
		if ok, err := l.Allow(ctx, "refill", lim); ok || err != nil {
			t.Fatalf("Allow %v after the last grant = %v, %v; want false, nil until the refill", time.Since(granted), ok, err)
		}
		refused++
	}
	time.Sleep(time.Until(granted.Add(1200 * time.Millisecond)))
	if ok, err := l.Allow(ctx, "refill", lim); !ok || err != nil {
		t.Errorf("Allow 1.2s after the last grant, after %d refusals = %v, %v; want true: a refusal takes nothing", refused, ok, err)
	}
}

func TestAllowPausedBucket(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 10}
	b, err := l.bucket("paused", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.store.Pause(ctx, b.Bucket, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	for i := range 5 {
		begun := time.Since(paused)
		ok, err := l.Allow(ctx, "paused", lim)
		if err != nil || ok && begun < 1500*time.Millisecond {
			t.Fatalf("Allow %d, called %v into a pause of 2s = %v, %v after %v; want false, nil at once", i, begun, ok, err, time.Since(paused)-begun)
		}
	}
	time.Sleep(time.Until(paused.Add(2200 * time.Millisecond)))
	if ok, err := l.Allow(ctx, "paused", lim); !ok || err != nil {
		t.Errorf("Allow after the pause = %v, %v; want true", ok, err)
	}
}

func TestAllowNLayers(t *testing.T) {
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	// The second layer binds: 3 tokens of the first layer's 5 go to
	// AllowN, and the refusals take nothing from the first layer.
	first, second := Limit{Rate: 0.05, Burst: 5}, Limit{Rate: 0.05, Burst: 3}
	allowed, _ := allowAtOnce(t, 50, func() (bool, error) { return l.AllowN(ctx, "layers", 1, first, second) })
	if allowed != 3 {
		t.Errorf("%d of 50 concurrent AllowN calls allowed, want 3, the second layer's burst", allowed)
	}
	alone, _ := allowAtOnce(t, 50, func() (bool, error) { return l.Allow(ctx, "layers", first) })
	if alone != 2 {
		t.Errorf("then %d Allow calls on the first layer alone allowed, want the 2 it has left", alone)
	}
	if ok, err := l.AllowN(ctx, "layers", 1, first, second); ok || err != nil {
		t.Errorf("AllowN on empty layers = %v, %v; want false, nil", ok, err)
	}
}

func TestAllowInvalidInput(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	lim := Limit{Rate: 1, Burst: 2}
	for _, tc := range []struct {
		name  string
		allow func() (bool, error)
		want  error
	}{
		{"zero rate", func() (bool, error) { return l.Allow(ctx, "k", Limit{}) }, ErrInvalidLimit},
		{"NaN rate", func() (bool, error) { return l.Allow(ctx, "k", Limit{Rate: math.NaN()}) }, ErrInvalidLimit},
		{"negative burst", func() (bool, error) { return l.Allow(ctx, "k", Limit{Rate: 1, Burst: -1}) }, ErrInvalidLimit},
		{"zero tokens", func() (bool, error) { return l.AllowN(ctx, "k", 0, lim) }, ErrInvalidTokens},
		{"infinite tokens", func() (bool, error) { return l.AllowN(ctx, "k", math.Inf(1), lim) }, ErrInvalidTokens},
		{"beyond the burst", func() (bool, error) { return l.AllowN(ctx, "k", 3, lim) }, ErrExceedsBurst},
		{"a layer's burst", func() (bool, error) { return l.AllowN(ctx, "k", 2, lim, Limit{Rate: 1, Burst: 1}) }, ErrExceedsBurst},
		{"empty name", func() (bool, error) { return l.Allow(ctx, "", lim) }, ErrInvalidKey},
		{"context ended", func() (bool, error) { return l.Allow(cancelled, "k", lim) }, context.Canceled},
	} {
		ok, err := tc.allow()
		if ok || !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, %v; want false and %v", tc.name, ok, err, tc.want)
		}
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid input sent %d Redis commands (%v), want none", n, cmds)
	}
}

func TestAllowPolicies(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	ctx := context.Background()
	lim := Limit{Rate: 20, Burst: 10}
	for _, tc := range []struct {
		policy Policy
		check  func(t *testing.T, l *Limiter)
	}{
		{FailOpen, func(t *testing.T, l *Limiter) {
			if allowed, _ := allowAtOnce(t, 50, func() (bool, error) { return l.Allow(ctx, "k", lim) }); allowed != 50 {
				t.Errorf("%d of 50 allowed, want all", allowed)
			}
		}},
		{FailClosed, func(t *testing.T, l *Limiter) {
			for range 10 {
				if ok, err := l.Allow(ctx, "k", lim); ok || !errors.Is(err, ErrUnavailable) {
					t.Fatalf("Allow = %v, %v; want false and ErrUnavailable", ok, err)
				}
			}
		}},
		{FallbackLocal(2), func(t *testing.T, l *Limiter) {
			// The share, 10/s and a burst of 5, starts empty and fills in
			// half a second.
			time.Sleep(time.Second)
			allowed, slowest := allowAtOnce(t, 50, func() (bool, error) { return l.Allow(ctx, "k", lim) })
			t.Logf("%d of 50 allowed from the local share, the slowest call took %v", allowed, slowest)
			if allowed < 5 || allowed > 7 { // 5, and what accrues at 10/s meanwhile
				t.Errorf("%d of 50 allowed from the local share, want its burst, 5", allowed)
			}
			if slowest > time.Second {
				t.Errorf("an Allow call took %v; it must never wait", slowest)
			}
		}},
	} {
		t.Run(tc.policy.String(), func(t *testing.T) {
			srv, rdb := limiterServer(t)
			l := NewLimiter(rdb, WithPolicy(tc.policy), WithLogger(discardLogger()))
			if ok, err := l.Allow(ctx, "k", lim); !ok || err != nil {
				t.Fatalf("Allow with Redis up = %v, %v", ok, err)
			}
			srv.Kill()
			l.Allow(ctx, "k", lim) // finds Redis gone
			if l.Mode() != tc.policy.mode() {
				t.Fatalf("mode %v after Redis was killed, want %v", l.Mode(), tc.policy.mode())
			}
			tc.check(t, l)
		})
	}
}

func TestInvalidInputMakesNoRedisCall(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		key  string
		lim  Limit
		n    float64
		want error
	}{
		{"zero rate", "k", Limit{}, 1, ErrInvalidLimit},
		{"negative rate", "k", Limit{Rate: -1}, 1, ErrInvalidLimit},
		{"NaN rate", "k", Limit{Rate: math.NaN()}, 1, ErrInvalidLimit},
		{"infinite rate", "k", Limit{Rate: math.Inf(1)}, 1, ErrInvalidLimit},
		{"huge rate", "k", Limit{Rate: math.MaxFloat64}, 1, ErrInvalidLimit},
		{"negative burst", "k", Limit{Rate: 1, Burst: -1}, 1, ErrInvalidLimit},
		{"NaN burst", "k", Limit{Rate: 1, Burst: math.NaN()}, 1, ErrInvalidLimit},
		{"infinite burst", "k", Limit{Rate: 1, Burst: math.Inf(1)}, 1, ErrInvalidLimit},
		{"zero tokens", "k", PerSecond(1), 0, ErrInvalidTokens},
		{"negative tokens", "k", PerSecond(1), -1, ErrInvalidTokens},
		{"NaN tokens", "k", PerSecond(1), math.NaN(), ErrInvalidTokens},
		{"more than burst", "k", Limit{Rate: 1, Burst: 2}, 3, ErrExceedsBurst},
		{"empty key", "", PerSecond(1), 1, ErrInvalidKey},
	} {
		done := make(chan error, 1)
		go func() { done <- l.WaitN(ctx, tc.key, tc.n, tc.lim) }()
		select {
		case err := <-done:
			if !errors.Is(err, tc.want) {
				t.Errorf("%s: err = %v, want %v", tc.name, err, tc.want)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%s: WaitN did not return", tc.name)
		}
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid input sent %d Redis commands, want 0", n)
	}
}

func TestNoScriptFallsBackToEval(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	if err := l.Wait(ctx, "k", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	// Once it listens, the Limiter reads the record again in the
	// background: let that read land before the script goes, so that the
	// waits below are the first to find it gone.
	<-l.events.Ready()
	listening := l.events.Since()
	e := l.controls.Lookup("quota:{k}")
	eventually(t, 5*time.Second, "the read after listening", func() bool {
		return !e.Reading() && e.Load().ReadAt().After(listening)
	})
	if err := rdb.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	cmds.reset()
	for i := 0; i < 3; i++ {
		if err := l.Wait(ctx, "k", PerSecond(100)); err != nil {
			t.Fatal(err)
		}
	}
	if n := cmds.total(); n != 4 { // EVALSHA, EVAL, then EVALSHA twice
		t.Errorf("%d commands for 3 waits after the script was lost, want 4", n)
	}
}

// TestOneSubscriptionPerLimiter: however many buckets a Limiter uses, with
// sleepers, slot waiters and pauses, it holds one pub/sub connection; and
// Transports that share it through WithLimiter add none.
func TestOneSubscriptionPerLimiter(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := NewLimiter(rdb)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	provider := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {}))
	defer provider.Close()
	var trs []*Transport
	for range 3 {
		trs = append(trs, NewTransport(nil, PerSecond(100), WithLimiter(l), WithConcurrency(1)))
	}
	var wg sync.WaitGroup
	for i := range 40 {
		name := fmt.Sprintf("bucket-%d", i%20)
		wg.Go(func() {
			_ = l.Wait(ctx, name, Limit{Rate: 5, Burst: 1}) // sleepers
			slot, err := l.AcquireSlot(ctx, name, 1)        // slot waiters
			if err == nil {
				time.Sleep(50 * time.Millisecond)
				slot.Release()
			}
		})
	}
	for _, tr := range trs {
		wg.Go(func() {
			if resp, err := (&http.Client{Transport: tr}).Get(provider.URL); err == nil {
				resp.Body.Close()
			}
		})
	}
	if err := l.Pause(ctx, "bucket-3", 200*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond)
	admin := srv.Client(t)
	subs, err := admin.PubSubNumSub(ctx, l.cfg.prefix+control.Channel).Result()
	if err != nil {
		t.Fatal(err)
	}
	channels, err := admin.PubSubChannels(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	t.Logf("20 buckets, sleepers, slot waiters, a pause and 3 Transports on one Limiter: %d subscribers of %s; channels %v",
		subs[l.cfg.prefix+control.Channel], l.cfg.prefix+control.Channel, channels)
	if n := subs[l.cfg.prefix+control.Channel]; n != 1 {
		t.Errorf("%d subscriptions, want 1", n)
	}
	if len(channels) != 1 {
		t.Errorf("channels subscribed: %v, want the control channel alone", channels)
	}
}

// TestListenerResubscribes: when its connection is killed, the Limiter's
// one subscription comes back, and announcements reach it again.
func TestListenerResubscribes(t *testing.T) {
	srv := redistest.Start(t)
	l := NewLimiter(srv.Client(t))
	admin := srv.Client(t)
	ctx := context.Background()
	channel := l.cfg.prefix + control.Channel
	// subscriber returns the id of the one client subscribed, or "".
	subscriber := func() string {
		n, _ := admin.PubSubNumSub(ctx, channel).Result()
		list, _ := admin.ClientList(ctx).Result()
		for line := range strings.SplitSeq(list, "\n") {
			if strings.Contains(line, " sub=1 ") && n[channel] == 1 {
				id, _, _ := strings.Cut(line, " ")
				return id
			}
		}
		return ""
	}
	if err := l.Wait(ctx, "resubscribed", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	var first string
	eventually(t, 5*time.Second, "the subscription", func() bool { first = subscriber(); return first != "" })
	if err := admin.ClientKillByFilter(ctx, "TYPE", "pubsub").Err(); err != nil {
		t.Fatal(err)
	}
	took := eventually(t, 10*time.Second, "the subscription again", func() bool {
		id := subscriber()
		return id != "" && id != first
	})
	// An announcement reaches it: a pause that another Limiter sets is
	// known here well before a refresh would read it.
	if err := NewLimiter(srv.Client(t)).Pause(ctx, "resubscribed", time.Minute); err != nil {
		t.Fatal(err)
	}
	e := l.controls.Lookup(mustKey(t, l, "resubscribed"))
	heard := eventually(t, 5*time.Second, "the pause", func() bool {
		_, _, paused := e.Load().PausedAt(time.Now())
		return paused
	})
	t.Logf("subscribed again %v after CLIENT KILL TYPE pubsub; a pause known %v after it was set", took.Round(time.Millisecond), heard.Round(time.Millisecond))
	if heard > 500*time.Millisecond {
		t.Errorf("the pause was known after %v: not by its announcement", heard)
	}
}

func mustKey(t *testing.T, l *Limiter, name string) string {
	t.Helper()
	key, err := bucketKey(l.cfg.prefix, name)
	if err != nil {
		t.Fatal(err)
	}
	return key
}

// Every structure a Limiter keeps per bucket name is bounded: a flood of
// distinct names leaves the heap where a thousand left it, under every
// policy, with Redis answering and with Redis down.
func TestFloodOfNamesKeepsTheHeap(t *testing.T) {
	redistest.Long(t)
	for _, tc := range []struct {
		policy Policy
		down   bool
	}{
		{FailClosed, false}, {FallbackLocal(4), false}, {FallbackLocal(4).CountingWorkers(), false},
		{FailOpen, true}, {FailClosed, true}, {FallbackLocal(4), true},
	} {
		name := fmt.Sprintf("%v, Redis down %v", tc.policy, tc.down)
		t.Run(name, func(t *testing.T) {
			l := NewLimiter(fakeRedis(t, tc.down), WithPolicy(tc.policy), WithLogger(discardLogger()))
			lim := Limit{Rate: 1e6, Burst: 10}
			flood := func(from, to int) {
				var wg sync.WaitGroup
				for g := range 16 {
					wg.Go(func() {
						for i := from + g; i < to; i += 16 {
							err := l.Wait(context.Background(), fmt.Sprintf("host-%07d.example.com", i), lim)
							if err != nil && !errors.Is(err, ErrUnavailable) {
								t.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
			}
			flood(0, 1000)
			before := heap()
			flood(1000, 25_000)
			after := heap()
			locals, queues := l.locals.Len()
			t.Logf("%d queues and %d local limiters remembered", queues, locals)
			grew := (float64(after) - float64(before)) / (1 << 20)
			t.Logf("heap %.1f MB after 1,000 names, %.1f MB after 25,000", float64(before)/(1<<20), float64(after)/(1<<20))
			// 3 MB is 130 bytes a name, if each name kept some.
			if grew > 3 {
				t.Errorf("25,000 names grew the heap by %.1f MB, want at most 3", grew)
			}
		})
	}
}

func heap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// fakeRedis returns a client that never reaches a server: every script
// call is granted after a microsecond's wait, or fails as a refused
// connection when down. It serves tests of what the process keeps, never
// of the script.
func fakeRedis(t *testing.T, down bool) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(fakeScripts{down: down})
	return rdb
}

type fakeScripts struct{ down bool }

func (fakeScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f fakeScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c, ok := cmd.(*redis.Cmd)
		if !ok {
			return next(ctx, cmd)
		}
		if f.down {
			err := errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
			c.SetErr(err)
			return err
		}
		// A take granted after a microsecond's wait (at position 0: no
		// timeline to follow), or a record that holds nothing.
		c.SetVal([]any{int64(1), int64(1), int64(1), int64(0), int64(0), int64(0)})
		if args := c.Args(); len(args) > 3 {
			if numkeys, err := strconv.Atoi(fmt.Sprint(args[2])); err == nil && len(args) > 3+numkeys && fmt.Sprint(args[3+numkeys]) == "read" {
				c.SetVal(make([]any, 11))
				for i := range 11 {
					c.Val().([]any)[i] = ""
				}
			}
		}
		return nil
	}
}

func (fakeScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func TestScriptFlushMidRun(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb, admin := srv.Client(t), srv.Client(t)
	logs := &logRecorder{}
	l := NewLimiter(rdb, WithLogger(slog.New(logs)))
	lim := Limit{Rate: 50, Burst: 5}
	// Each flush is stamped once Redis has answered it: a take asked after
	// that found no script and must have loaded it again.
	var flushed [2]atomic.Int64
	for i, at := range []time.Duration{500 * time.Millisecond, time.Second} {
		time.AfterFunc(at, func() {
			if err := admin.ScriptFlush(context.Background()).Err(); err != nil {
				t.Errorf("SCRIPT FLUSH: %v", err)
			}
			flushed[i].Store(time.Now().UnixNano())
		})
	}
	grants, err := swarm(context.Background(), 10, time.Now(), 2*time.Second, func(ctx context.Context) error {
		return l.Wait(ctx, "flush", lim)
	})
	if err != nil {
		t.Fatalf("a wait failed across SCRIPT FLUSH: %v", err)
	}
	// How many grants fit in the run is the machine's business; that each
	// flush is followed by grants is the limiter's.
	for i := range flushed {
		at, after := time.Unix(0, flushed[i].Load()), 0
		for _, g := range grants {
			if g.Asked.After(at) {
				after++
			}
		}
		if flushed[i].Load() == 0 || after < 5 {
			t.Errorf("flush %d: %d grants asked after it, want at least 5 of the %d", i+1, after, len(grants))
		}
	}
	if l.Mode() != ModeShared || logs.Len() > 0 {
		t.Errorf("SCRIPT FLUSH changed the mode to %v:\n%s", l.Mode(), logs)
	}
}

var _ redis.Scripter = (*redis.Client)(nil)
