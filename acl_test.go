package quota

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
)

// aclLimiter is the ACL rule of a Redis user that may run the package's
// scripts on its keys and nothing else. The README shows it.
const aclLimiter = "on >limiter-secret resetkeys ~quota:* resetchannels &quota:* -@all " +
	"+evalsha +eval +get +set +del +time +zadd +zremrangebyscore +pexpire +zcard +hello " +
	"+publish +subscribe +ping +zscore +zrem +zrange +rpush +lpop +lrem " +
	"+hget +hmget +hset +hdel +hgetall +hlen +persist +pttl +zcount +hincrby +hkeys +lrange +linsert"

// TestREADMEShowsTheACL: the README's ACL line is the one tested.
func TestREADMEShowsTheACL(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	var lines []string
	for _, line := range strings.Split(string(readme), "\n") {
		if rule, ok := strings.CutPrefix(line, "ACL SETUSER limiter "); ok {
			lines = append(lines, strings.Replace(rule, ">SECRET ", ">limiter-secret ", 1))
		}
	}
	if len(lines) != 1 || lines[0] != aclLimiter {
		t.Errorf("the README shows the ACL rule(s)\n%q\nwant\n%q", lines, aclLimiter)
	}
}

func TestLeastPrivilegeUser(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	setUser := func(name, rule string) {
		if err := admin.Do(ctx, append([]any{"ACL", "SETUSER", name}, splitRule(rule)...)...).Err(); err != nil {
			t.Fatalf("ACL SETUSER %s: %v", name, err)
		}
	}
	setUser("limiter", aclLimiter)
	setUser("nobody", "on >nobody-secret ~* -@all +hello")

	client := func(user, pass string) *redis.Client {
		o := limiterOptions(srv.Addr())
		o.Username, o.Password = user, pass
		rdb := redis.NewClient(o)
		t.Cleanup(func() { rdb.Close() })
		return rdb
	}

	// The limiter's user does everything the package needs, counting
	// workers included, and cannot touch other keys.
	lrdb := client("limiter", "limiter-secret")
	logs := &logRecorder{}
	l := NewLimiter(lrdb, WithPolicy(FallbackLocal(2).CountingWorkers()), WithLogger(slogOf(logs)))
	for range 3 {
		if err := l.Wait(ctx, "api.example.com", PerSecond(100)); err != nil {
			t.Fatalf("Wait as the limiter's user: %v", err)
		}
	}
	eventually(t, 2*time.Second, "the worker count", func() bool { return l.workers.Divisor(1) == 1 })
	// A pause, announced to the callers already sleeping.
	lim := Limit{Rate: 5, Burst: 1}
	if err := l.Wait(ctx, "paused", lim); err != nil {
		t.Fatal(err)
	}
	woke := make(chan time.Time)
	go func() {
		if err := l.Wait(ctx, "paused", lim); err != nil {
			t.Error(err)
		}
		woke <- time.Now()
	}()
	time.Sleep(50 * time.Millisecond) // the second caller sleeps until 200ms
	b, _ := l.bucket("paused", []Limit{lim})
	paused := time.Now()
	if err := l.store.Pause(ctx, b.Bucket, 500*time.Millisecond); err != nil {
		t.Fatalf("a pause as the limiter's user: %v", err)
	}
	if at := <-woke; at.Sub(paused) < 500*time.Millisecond {
		t.Errorf("the sleeping caller woke %v after a pause of 500ms: the announcement did not reach it", at.Sub(paused))
	}
	// Concurrency slots: held, waited for, handed off and released.
	slot, err := l.AcquireSlot(ctx, "slots", 1)
	if err != nil {
		t.Fatalf("AcquireSlot as the limiter's user: %v", err)
	}
	handed := make(chan error, 1)
	go func() {
		s, err := l.AcquireSlot(ctx, "slots", 1)
		s.Release()
		handed <- err
	}()
	time.Sleep(100 * time.Millisecond) // the second caller queues
	slot.Release()
	select {
	case err := <-handed:
		if err != nil {
			t.Fatalf("a slot handed off as the limiter's user: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the released slot did not reach the waiter as the limiter's user")
	}

	// The operator's commands, from cmd/quotactl, as the same user; a
	// Limiter in use hears of an override on the control channel.
	ops := NewLimiter(client("limiter", "limiter-secret"))
	if err := ops.Wait(ctx, "ops", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	bin := quotaBinary(t)
	url := "redis://limiter:limiter-secret@" + srv.Addr()
	quotaCmd(t, bin, url, "limit", "ops", "7/s", "3")
	opsKey, _ := bucketKey(DefaultPrefix, "ops")
	eventually(t, 500*time.Millisecond, "the override announced", func() bool {
		e := ops.controls.Lookup(opsKey)
		if e == nil {
			return false
		}
		o, ok := e.Load().Override()
		return ok && o == control.Limit{Rate: 7, Burst: 3}
	})
	quotaCmd(t, bin, url, "pause", "ops", "forever")
	if _, out := quotaCmd(t, bin, url, "-json", "status", "ops"); !strings.Contains(out, `"paused_forever":true`) ||
		!strings.Contains(out, `"override":{"rate":7,"burst":3}`) || !strings.Contains(out, `"workers":1`) {
		t.Errorf("quota -json status as the limiter's user: %s", out)
	}
	quotaCmd(t, bin, url, "resume", "ops")
	quotaCmd(t, bin, url, "limit", "ops", "off")
	if st, err := ops.Status(ctx, "ops"); err != nil || st.Paused || st.Override != nil {
		t.Errorf("Status as the limiter's user after resume and limit off: %+v, %v", st, err)
	}
	for _, op := range []func() error{
		func() error { return ops.SetLimit(ctx, "ops", PerSecond(5)) },
		func() error { return ops.Pause(ctx, "ops", time.Millisecond) },
		func() error { return ops.Resume(ctx, "ops") },
		func() error { return ops.ClearLimit(ctx, "ops") },
	} {
		if err := op(); err != nil {
			t.Errorf("an operation as the limiter's user: %v", err)
		}
	}

	if err := lrdb.Set(ctx, "other:key", "x", 0).Err(); !redis.HasErrorPrefix(err, "NOPERM") {
		t.Errorf("SET other:key as the limiter's user: %v, want NOPERM", err)
	}

	// A user without rights gets a typed error on every request, and the
	// Limiter does not switch to its policy: that would hide the mistake.
	// It logs the mistake once.
	nrdb := client("nobody", "nobody-secret")
	nlogs := &logRecorder{}
	n := NewLimiter(nrdb, WithPolicy(FailOpen), WithLogger(slogOf(nlogs)))
	for range 3 {
		err := n.Wait(ctx, "api.example.com", PerSecond(100))
		if !errors.Is(err, ErrNoPermission) || errors.Is(err, ErrUnavailable) {
			t.Fatalf("Wait without rights: err = %v, want ErrNoPermission", err)
		}
	}
	if n.Mode() != ModeShared || nlogs.Len() != 1 || nlogs.Count(slog.LevelError, "permission") != 1 {
		t.Errorf("missing rights switched the mode to %v:\n%s", n.Mode(), nlogs)
	}
	if !Permanent(n.Wait(ctx, "api.example.com", PerSecond(100))) {
		t.Error("missing rights are not a permanent error")
	}

	// A user that may run the scripts but not a command they call: Redis
	// 7.0 refuses that command inside the script with a plain ERR, not
	// NOPERM, and it is an ErrNoPermission too, which the policy does not
	// hide.
	setUser("nohset", strings.Replace(aclLimiter, " +hset ", " ", 1))
	hrdb := client("nohset", "limiter-secret")
	h := NewLimiter(hrdb, WithPolicy(FailOpen), WithLogger(slogOf(&logRecorder{})))
	err = h.Wait(ctx, "api.example.com", PerSecond(100))
	t.Logf("a command refused inside a script: %v", err)
	if !errors.Is(err, ErrNoPermission) || errors.Is(err, ErrUnavailable) || !Permanent(err) {
		t.Errorf("Wait without +hset: err = %v, want ErrNoPermission", err)
	}
}

func splitRule(rule string) []any {
	var out []any
	for _, f := range strings.Fields(rule) {
		out = append(out, f)
	}
	return out
}

func slogOf(h slog.Handler) *slog.Logger { return slog.New(h) }
