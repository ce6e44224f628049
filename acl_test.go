package quota

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of the Redis ACL a limiter's user needs (the README's ACL line): a
// least-privilege user serves every call, a Limiter WithClock needs no
// TIME, and what the ACL refuses is ErrNoPermission, not an outage. They
// run on real redis-server processes.

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

func slogOf(h slog.Handler) *slog.Logger { return slog.New(h) }

// aclServer is a real server with ACL users made for a test.
type aclServer struct {
	t     *testing.T
	srv   *redistest.Server
	admin *redis.Client
}

func newACLServer(t *testing.T) *aclServer {
	srv := redistest.Start(t)
	return &aclServer{t: t, srv: srv, admin: srv.Client(t)}
}

// user creates user with rule, which must set its password, and returns a
// client that logs in as user with pass.
func (a *aclServer) user(user, rule, pass string) *redis.Client {
	a.t.Helper()
	if err := a.admin.Do(context.Background(), append([]any{"ACL", "SETUSER", user}, splitRule(rule)...)...).Err(); err != nil {
		a.t.Fatalf("ACL SETUSER %s: %v", user, err)
	}
	o := limiterOptions(a.srv.Addr())
	o.Username, o.Password = user, pass
	rdb := redis.NewClient(o)
	a.t.Cleanup(func() { rdb.Close() })
	return rdb
}

// denied returns what the server's ACL log holds against user.
func (a *aclServer) denied(user string) []string {
	a.t.Helper()
	entries, err := a.admin.ACLLog(context.Background(), 100).Result()
	if err != nil {
		a.t.Fatalf("ACL LOG: %v", err)
	}
	var out []string
	for _, e := range entries {
		if e.Username == user {
			out = append(out, e.Reason+" "+e.Object+" in "+e.Context)
		}
	}
	return out
}

// withoutRule returns the README's ACL rule less one of its words.
func withoutRule(word string) string {
	return strings.Replace(aclLimiter, " "+word+" ", " ", 1)
}

// TestWithClockNeedsNoTIME: a Limiter WithClock passes its clock to every
// script it runs, so that a Redis user without +time serves every call:
// takes alone and in batches, of several layers and of a priority class,
// settles and cancels, refunds, probes, lowers, the resume instant,
// the control record's reads, the operator's calls, the slots and the
// roll call of the workers. The server's ACL log, which records every
// command refused, the background calls' included, stays empty.
func TestWithClockNeedsNoTIME(t *testing.T) {
	t.Parallel()
	a := newACLServer(t)
	rdb := a.user("notime", withoutRule("+time"), "limiter-secret")
	ctx := context.Background()
	l := NewLimiter(rdb, WithClock(time.Now), WithPolicy(FallbackLocal(2).CountingWorkers()),
		WithMinShare(0, 0.2), WithLogger(slogOf(&logRecorder{})))
	check := func(what string, err error) {
		t.Helper()
		if err != nil {
			t.Errorf("%s as a user without +time: %v", what, err)
		}
	}
	lim := Limit{Rate: 100, Burst: 5}
	check("Wait", l.Wait(ctx, "clock", lim))
	var wg sync.WaitGroup
	for range 8 { // takes of one bucket at once share calls
		wg.Add(1)
		go func() {
			defer wg.Done()
			check("a batched Wait", l.Wait(ctx, "clock", lim))
		}()
	}
	wg.Wait()
	check("WaitN of two layers", l.WaitN(ctx, "layers", 1, lim, PerMinute(600)))
	check("Wait of a priority class", l.Wait(ContextWithPriority(ctx, 3), "clock", lim))
	_, err := l.Allow(ctx, "clock", lim)
	check("Allow", err)

	r, err := l.Reserve(ctx, "llm", llmMeters, Usage{"requests": 1, "input_tokens": 100, "output_tokens": 100})
	check("Reserve", err)
	r.Settle(Usage{"requests": 1, "input_tokens": 20, "output_tokens": 10})
	r, err = l.Reserve(ctx, "llm", llmMeters, Usage{"requests": 1, "input_tokens": 100, "output_tokens": 100})
	check("Reserve", err)
	r.Cancel()
	check("Flush", l.Flush(ctx))

	b, err := l.bucket("clock", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	g, err := l.store.Take(ctx, b.Bucket, store.Tokens(1), time.Second)
	check("a take", err)
	if g.Tats != nil {
		check("a refund", l.store.Refund(ctx, b.Bucket, store.Tokens(1), g.Tats))
	}
	check("a probe", l.store.Probe(ctx, b.Bucket))
	check("a lower", l.store.Lower(ctx, b.Bucket, 1))
	check("a lower of each layer", l.store.LowerEach(ctx, b.Bucket, []float64{2}))
	check("a provider's pause", l.store.Pause(ctx, b.Bucket, time.Millisecond))
	check("the resume instant", l.store.Resuming(ctx, b.Bucket, time.Now().Add(time.Millisecond).UnixMicro()))
	_, _, err = l.resume.In(ctx, time.Millisecond, l.store.Now())
	check("the fleet's resume", err)
	if e := l.controls.Lookup(b.Keys[0]); e == nil {
		t.Error("no control record entry for the bucket")
	} else {
		_, err := l.controls.ReadNow(ctx, e)
		check("a read of the control record", err)
	}

	check("SetLimit", l.SetLimit(ctx, "clock", PerSecond(50)))
	_, err = l.Status(ctx, "clock")
	check("Status", err)
	check("Pause", l.Pause(ctx, "clock", 10*time.Millisecond))
	check("Resume", l.Resume(ctx, "clock"))
	check("ClearLimit", l.ClearLimit(ctx, "clock"))

	slot, err := l.AcquireSlot(ctx, "slots", 1)
	check("AcquireSlot", err)
	if err == nil {
		slot.Release()
	}
	check("Flush", l.Flush(ctx))
	eventually(t, 2*time.Second, "the worker count", func() bool { return l.workers.Divisor(1) == 1 })

	if d := a.denied("notime"); len(d) > 0 {
		t.Errorf("the server refused a Limiter WithClock commands:\n%s", strings.Join(d, "\n"))
	}
}

// TestPermissionFailures: a wrong password and a command the ACL refuses
// inside a script are ErrNoPermission, permanent, not an outage: the
// Limiter stays in shared mode whatever its policy, and logs the failure
// once, however many calls meet it.
func TestPermissionFailures(t *testing.T) {
	t.Parallel()
	a := newACLServer(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name, user, rule, pass string
	}{
		{"a wrong password", "wrongpass", aclLimiter, "not-the-secret"},
		{"a command refused inside the script", "nohset", withoutRule("+hset"), "limiter-secret"},
	} {
		rdb := a.user(tc.user, tc.rule, tc.pass)
		logs := &logRecorder{}
		l := NewLimiter(rdb, WithPolicy(FailOpen), WithLogger(slogOf(logs)))
		for range 3 {
			err := l.Wait(ctx, "denied", PerSecond(100))
			if !errors.Is(err, ErrNoPermission) || errors.Is(err, ErrScript) || errors.Is(err, ErrUnavailable) || !Permanent(err) {
				t.Errorf("%s: Wait = %v, want ErrNoPermission alone", tc.name, err)
			}
		}
		time.Sleep(50 * time.Millisecond) // what runs in the background after a call
		if l.Mode() != ModeShared {
			t.Errorf("%s switched the Limiter to %v", tc.name, l.Mode())
		}
		if n := logs.Count(slog.LevelError, "permission"); n != 1 || logs.Len() != 1 {
			t.Errorf("%s: %d records of the missing permission, want 1 alone:\n%s", tc.name, n, logs)
		}
	}
}

// TestRefusedAnnouncements: for a user that may not publish on the
// package's channel, a call whose announcement is known before it writes
// (the operator's pause, resume and limits) fails and changes nothing;
// one whose announcement is known only once written (a provider's pause,
// a take that pushes lower classes back, a settle that gives tokens back)
// is applied and succeeds, unannounced.
func TestRefusedAnnouncements(t *testing.T) {
	t.Parallel()
	a := newACLServer(t)
	rdb := a.user("nochannel", withoutRule("&quota:*"), "limiter-secret")
	ctx := context.Background()
	l := NewLimiter(rdb, WithPolicy(FailClosed), WithLogger(slogOf(&logRecorder{})))
	lim := Limit{Rate: 10, Burst: 1}
	if err := l.Wait(ctx, "ops", lim); err != nil {
		t.Fatal(err)
	}
	for what, op := range map[string]func() error{
		"Pause":    func() error { return l.Pause(ctx, "ops", 3*time.Second) },
		"SetLimit": func() error { return l.SetLimit(ctx, "ops", PerSecond(1)) },
	} {
		if err := op(); !errors.Is(err, ErrNoPermission) {
			t.Errorf("%s without the channel: %v, want ErrNoPermission", what, err)
		}
	}
	if st, err := l.Status(ctx, "ops"); err != nil || st.Paused || st.Override != nil {
		t.Errorf("Status after a Pause and a SetLimit that failed: %+v, %v; want neither in force", st, err)
	}

	b, err := l.bucket("provider", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.store.Pause(ctx, b.Bucket, time.Second); err != nil {
		t.Errorf("a provider's pause without the channel: %v", err)
	}
	if st, err := l.Status(ctx, "provider"); err != nil || !st.Paused || st.PausedBy != PausedByProvider {
		t.Errorf("Status after a provider's pause: %+v, %v; want it paused", st, err)
	}

	b, err = l.bucket("pushed", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	for range 4 { // class 0's grants, due up to 300 ms from now
		if _, err := l.store.Take(ctx, b.Bucket, store.Tokens(1), time.Second); err != nil {
			t.Fatal(err)
		}
	}
	g, err := l.store.Take(ctx, b.Bucket, store.Cost{N: 1, Class: 3}, time.Second)
	if err != nil || !g.Granted() {
		t.Errorf("a take of class 3 ahead of class 0's grants, without the channel: %+v, %v", g, err)
	}
	if err := l.store.Adjust(ctx, b.Bucket, store.Tokens(-2), ""); err != nil {
		t.Errorf("a give-back without the channel: %v", err)
	}
}
