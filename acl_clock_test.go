package quota

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

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
