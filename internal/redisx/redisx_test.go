package redisx

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
)

func newMini(t *testing.T) (*miniredis.Miniredis, *redis.Client) {
	t.Helper()
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr(), MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	return m, rdb
}

// counter counts the commands a client sends, by name.
type counter struct {
	mu sync.Mutex
	n  map[string]int
}

func (c *counter) DialHook(next redis.DialHook) redis.DialHook { return next }
func (c *counter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.mu.Lock()
		c.n[cmd.Name()]++
		c.mu.Unlock()
		return next(ctx, cmd)
	}
}
func (c *counter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (c *counter) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

// TestScriptSendsItsSourceOnce: however many callers start at once, the
// source goes once with EVAL; then EVALSHA, and EVAL again only after the
// server forgot it.
func TestScriptSendsItsSourceOnce(t *testing.T) {
	_, rdb := newMini(t)
	c := &counter{n: map[string]int{}}
	rdb.AddHook(c)
	s := NewScript(rdb, "return tonumber(ARGV[1]) + 1")
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Go(func() {
			cmd, _ := s.Run(context.Background(), nil, i)
			if v, err := cmd.Int(); err != nil || v != i+1 {
				t.Errorf("Run(%d) = %v, %v", i, v, err)
			}
		})
	}
	wg.Wait()
	if got := c.get("eval"); got != 1 {
		t.Errorf("%d EVALs for 50 concurrent first calls, want 1", got)
	}
	if got := c.get("evalsha"); got != 49 {
		t.Errorf("%d EVALSHAs, want 49", got)
	}
	if err := rdb.ScriptFlush(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	cmd, trips := s.Run(context.Background(), nil, 1)
	if v, err := cmd.Int(); err != nil || v != 2 || trips != 2 {
		t.Errorf("after SCRIPT FLUSH: %v, %v in %d trips; want 2 in 2 (EVALSHA, then EVAL)", v, err, trips)
	}
}

// TestScriptPrimesAgainAfterAnOutage: a first call that found no server
// leaves the next to send the source.
func TestScriptPrimesAgainAfterAnOutage(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1, DialerRetries: 1, DialTimeout: 100 * time.Millisecond})
	defer rdb.Close()
	s := NewScript(rdb, "return 1")
	if cmd, _ := s.Run(context.Background(), nil); cmd.Err() == nil {
		t.Fatal("a call to no server succeeded")
	}
	if s.primed.Load() {
		t.Error("primed by a call that reached no server")
	}
}

// replyErr is an error reply of the server.
type replyErr string

func (e replyErr) Error() string { return string(e) }
func (replyErr) RedisError()     {}

func TestClassify(t *testing.T) {
	live := context.Background()
	cancelled, cancel := context.WithCancel(live)
	cancel()
	past, cancel2 := context.WithDeadline(live, time.Now().Add(-time.Second))
	defer cancel2()
	for _, tc := range []struct {
		name    string
		ctx     context.Context
		err     error
		cluster bool
		want    Class
	}{
		{"refused", live, errors.New("dial tcp: connection refused"), false, Unavailable},
		{"loading", live, replyErr("LOADING Redis is loading"), false, Unavailable},
		{"moved on a cluster client", live, replyErr("MOVED 1 127.0.0.1:7000"), true, Unavailable},
		{"moved on a plain client", live, replyErr("MOVED 1 127.0.0.1:7000"), false, NotCluster},
		{"noperm", live, replyErr("NOPERM no rights"), false, NoPermission},
		{"wrong password", live, replyErr("WRONGPASS invalid username-password pair or user is disabled."), false, NoPermission},
		{"no password", live, replyErr("NOAUTH Authentication required."), false, NoPermission},
		{"a command refused in a script, Redis 7.0", live, replyErr("ERR The user executing the script can't run this command or subcommand script: 0a1b, on @user_script:14."), false, NoPermission},
		{"a publish refused in a script, Redis 7.0", live, replyErr("ERR The user executing the script can't publish to the channel mentioned in the command script: 0a1b, on @user_script:580."), false, NoPermission},
		{"a command refused in a script, Redis 6", live, replyErr("ERR Error running script (call to f_0a1b): @user_script:14: @user_script: 14: The user executing the script can't run this command or subcommand"), false, NoPermission},
		{"a command refused in a script, Redis 7.2", live, replyErr("ERR ACL failure in script: User limiter has no permissions to run the 'time' command script: 0a1b, on @user_script:14."), false, NoPermission},
		{"the script's own error quoting a caller", live, replyErr("quota: refund of 1|1|0||The user executing the script can't  from 1 layers"), false, Rejected},
		{"not a reply", live, errors.New("NOPERM in a message of the client"), false, Unavailable},
		{"script error", live, replyErr("ERR user_script:1: oops"), false, Rejected},
		{"bad reply", live, fmt.Errorf("%w: {1 2}", ErrReply), false, BadReply},
		{"cancelled", cancelled, errors.New("i/o timeout"), false, Ended},
		{"deadline passed", past, errors.New("i/o timeout"), false, Ended},
	} {
		if got := Classify(tc.ctx, tc.err, tc.cluster); got != tc.want {
			t.Errorf("%s: Classify = %v, want %v", tc.name, got, tc.want)
		}
	}
	if Outage(live, nil, false) != nil {
		t.Error("Outage(nil) is not nil")
	}
}

// TestListener: a listener hears what is published once it is ready,
// tells when it started, and stops once unused for its idle time.
func TestListener(t *testing.T) {
	redistest.Long(t)
	m, rdb := newMini(t)
	ls := NewListener(rdb, "ch", 200*time.Millisecond)
	got := make(chan string, 10)
	var started, stopped atomic.Int32
	ls.Handle(Handlers{
		Message: func(p string) { got <- p },
		Started: func() { started.Add(1) },
		Stopped: func() { stopped.Add(1) },
	})
	if ls.Use() {
		t.Error("Use reported listening before the first use")
	}
	<-ls.Ready()
	if ls.Since().IsZero() || started.Load() != 1 {
		t.Errorf("ready, but Since %v and %d starts", ls.Since(), started.Load())
	}
	m.Publish("ch", "hello")
	select {
	case p := <-got:
		if p != "hello" {
			t.Errorf("heard %q", p)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing heard in 2s")
	}
	release := ls.Hold()
	time.Sleep(500 * time.Millisecond)
	if stopped.Load() != 0 {
		t.Error("stopped while held")
	}
	release()
	deadline := time.Now().Add(2 * time.Second)
	for stopped.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if stopped.Load() != 1 {
		t.Error("still listening 2s after its last use, idle 200ms")
	}
	if ls.Use() {
		t.Error("Use after it stopped reported listening")
	}
}

// TestListenerListensAgain: when its connection breaks and go-redis
// subscribes again, what was published meanwhile is lost: the listener
// tells its Started handler again, and hears what is published after.
// The connection breaks at a proxy, the server staying up: a miniredis
// restarted under a reconnecting client may take a command before it
// knows it, and leave the subscription unanswered.
func TestListenerListensAgain(t *testing.T) {
	m := miniredis.RunT(t)
	p := faultproxy.New(t, m.Addr())
	rdb := redis.NewClient(&redis.Options{Addr: p.Addr(), MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	ls := NewListener(rdb, "ch", time.Minute)
	got := make(chan string, 10)
	var started atomic.Int32
	ls.Handle(Handlers{
		Message: func(p string) { got <- p },
		Started: func() { started.Add(1) },
	})
	defer ls.Hold()()
	<-ls.Ready()
	first := ls.Since()
	p.ResetAll()
	deadline := time.Now().Add(2 * time.Second)
	for started.Load() < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := started.Load(); n != 2 || !ls.Since().After(first) {
		t.Fatalf("%d starts and Since %v (first %v) 2s after the connection broke, want 2 and later", n, ls.Since(), first)
	}
	m.Publish("ch", "again")
	select {
	case p := <-got:
		if p != "again" {
			t.Errorf("heard %q", p)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("nothing heard in 2s after listening again")
	}
}

func TestNum(t *testing.T) {
	for x, want := range map[float64]string{0: "0", 1: "1", 0.5: "0.5", 1e-7: "1e-07", 1e21: "1e+21", 123456789: "123456789"} {
		if got := Num(x); got != want {
			t.Errorf("Num(%v) = %q, want %q", x, got, want)
		}
	}
}
