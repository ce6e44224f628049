package slots

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/redisx"
)

// TestRenewQueuesALapsedWaiterAtTheEnd: a waiter whose lease lapsed while
// its process stalled joins the queue again at its end, behind a caller
// that came meanwhile, as a new arrival would.
func TestRenewQueuesALapsedWaiterAtTheEnd(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	key := "quota:{lapsed}"
	keys := []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix, key + TakesSuffix}
	script := redisx.NewScript(rdb, Source(""))
	run := func(op string, ids ...string) []any {
		t.Helper()
		args := []any{op, 1, time.Minute.Microseconds(), "", "", 0}
		for _, id := range ids {
			args = append(args, id)
		}
		cmd, _ := script.Run(ctx, keys, args...)
		v, err := cmd.Result()
		if err != nil {
			t.Fatal(op, err)
		}
		if s, ok := v.([]any); ok {
			return s
		}
		return []any{v}
	}
	run("acquire", "holder")
	run("acquire", "stalled")
	// The stalled waiter's lease ends; its place in the queue is left.
	if err := rdb.ZRem(ctx, keys[1], "stalled").Err(); err != nil {
		t.Fatal(err)
	}
	run("acquire", "newcomer")
	// The holder's process renews one held id, in use, and one waiting id.
	v := run("renew", "1", "0", "holder", "stalled")
	if len(v) != 3 || v[1] != int64(slotHolds) || v[2] != int64(slotRequeued) {
		t.Errorf("renew replied %v, want {hint, holds, waits again}", v)
	}
	queue, err := rdb.LRange(ctx, keys[2], 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(queue, " ") != "newcomer stalled" {
		t.Errorf("queue %q, want the newcomer, then the lapsed waiter", queue)
	}
	if w, _ := rdb.ZScore(ctx, keys[1], "stalled").Result(); w == 0 {
		t.Error("the lapsed waiter has no lease again")
	}
	// A holder Redis forgot before its use is reported, not held again:
	// it is to queue again.
	if err := rdb.ZRem(ctx, keys[0], "holder").Err(); err != nil {
		t.Fatal(err)
	}
	v = run("renew", "0", "1", "holder", "stalled")
	if len(v) != 3 || v[1] != int64(slotUnknown) {
		t.Errorf("renew replied %v, want the forgotten holder unknown", v)
	}
	if err := rdb.ZScore(ctx, keys[0], "holder").Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("the forgotten holder holds again: %v", err)
	}
	// The free slot went to the newcomer. A holder in use that Redis
	// forgot is held again, over the bucket's one slot: its request is at
	// the provider, and nobody is handed a slot until it goes.
	v = run("renew", "1", "0", "holder")
	if len(v) != 2 || v[1] != int64(slotAgain) {
		t.Errorf("renew replied %v, want the holder in use held again", v)
	}
	if n, _ := rdb.ZCard(ctx, keys[0]).Result(); n != 2 {
		t.Errorf("%d slots held, want 2: the one granted meanwhile and the one in use", n)
	}
	run("release", "newcomer")
	if err := rdb.ZScore(ctx, keys[0], "stalled").Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("a slot was handed on while the one in use still held it: %v", err)
	}
	run("release", "holder")
	if err := rdb.ZScore(ctx, keys[0], "stalled").Err(); err != nil {
		t.Errorf("the slot was not handed on once free: %v", err)
	}
}

// TestHandOffRunsTheWaitersTake: a waiter leaves its take with its id, and
// the release that hands it its slot runs it, with its deadline counted
// down to the hand-off; the announcement carries the grant, and so does a
// renewal, should the announcement be lost. A stub of the take's script
// counts the tokens it is asked for and replies the longest wait it was
// given (script.lua's ARGV[6] and ARGV[5], for a plain take of one layer).
func TestHandOffRunsTheWaitersTake(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	key := "quota:{handoff}"
	keys := []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix, key + TakesSuffix}
	stub := `redis.call('INCRBY', KEYS[1], ARGV[6])
return {1, tonumber(ARGV[5]), 7, 0, 0}`
	script := redisx.NewScript(rdb, Source(stub))
	const channel = "handoffs"
	sub := srv.Client(t).Subscribe(ctx, channel)
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UnixMicro()
	// run runs op at now+at (µs), with the releases riding on it and a
	// take of n tokens and a wait of wait µs, a deadline with deadline.
	run := func(op string, at int64, released []string, ids []string, n, wait int64, deadline bool) any {
		t.Helper()
		args := []any{op, 1, time.Minute.Microseconds(), channel, now + at, len(released)}
		for _, id := range released {
			args = append(args, id)
		}
		for _, id := range ids {
			args = append(args, id)
		}
		call := keys
		if n > 0 {
			d := "0"
			if deadline {
				d = "1"
			}
			args = append(args, d, "take", "", "plain", "", wait, n, 1000, 10)
			call = append(slices.Clip(keys), "quota:{handoff}:tokens")
		}
		cmd, _ := script.Run(ctx, call, args...)
		v, err := cmd.Result()
		if err != nil {
			t.Fatal(op, err)
		}
		return v
	}
	tokens := func() int64 {
		n, _ := rdb.Get(ctx, "quota:{handoff}:tokens").Int64()
		return n
	}
	if v := run("acquire", 0, nil, []string{"a"}, 2, 5000, false); fmt.Sprint(v) != "[1 0 1,5000,7,0,0]" {
		t.Fatalf("the first acquire replied %v, want the slot with its grant", v)
	}
	if tokens() != 2 {
		t.Fatalf("%d tokens taken, want a's 2", tokens())
	}
	if v := run("acquire", 1000, nil, []string{"b"}, 3, 900000, true); fmt.Sprint(v) != "[0 59999000]" {
		t.Fatalf("b's acquire replied %v, want it queued", v)
	}
	if tokens() != 2 {
		t.Fatalf("%d tokens taken while b waits, want 2: a waiter takes nothing before its slot", tokens())
	}
	// a's release rides on another caller's try, 400 ms after b asked: b's
	// deadline has 500 ms left.
	if v := run("try", 401000, []string{"a"}, []string{"c"}, 1, 0, false); fmt.Sprint(v) != "[0 0]" {
		t.Errorf("c's try replied %v, want nothing: b holds the slot", v)
	}
	if tokens() != 5 {
		t.Errorf("%d tokens taken, want 5: b's 3 taken at its hand-off", tokens())
	}
	msg, err := sub.ReceiveMessage(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if want := "s b=1,500000,7,0,0\n" + key; msg.Payload != want {
		t.Errorf("announced %q, want %q", msg.Payload, want)
	}
	// Should the announcement be lost, b's renewal, as a waiter, tells it
	// the grant, once.
	if v := run("renew", 402000, nil, []string{"0", "0", "b"}, 0, 0, false); fmt.Sprint(v) != "[60000000 1 1,500000,7,0,0]" {
		t.Errorf("b's renewal replied %v, want it held, with its grant", v)
	}
	if n, _ := rdb.HLen(ctx, keys[3]).Result(); n != 0 {
		t.Errorf("%d takes left after the renewal told b its grant, want 0", n)
	}
}

// The queue serves the higher priority classes first, each first come,
// first served: a waiter's class is its take's (script.lua's ARGV[6]). A
// waiter that cancels leaves its class's place.
func TestQueueByClass(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	key := "quota:{classes}"
	keys := []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix, key + TakesSuffix, key, key + ":ctl"}
	script := redisx.NewScript(rdb, Source(""))
	run := func(op string, args ...any) {
		t.Helper()
		cmd, _ := script.Run(ctx, keys, append([]any{op, 1, time.Minute.Microseconds(), "", "", 0}, args...)...)
		if err := cmd.Err(); err != nil {
			t.Fatal(op, err)
		}
	}
	wait := func(id string, class int) {
		t.Helper()
		if class == 0 {
			run("acquire", id, "0")
			return
		}
		// A take of 1 token of class class from a bucket of 1000/s.
		run("acquire", id, "0", "take", "", "class", "", "1000000", class, "", 1, 1000, 10)
	}
	queue := func() string {
		t.Helper()
		q, err := rdb.LRange(ctx, keys[2], 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		return strings.Join(q, " ")
	}
	run("acquire", "holder", "0")
	wait("a", 0)
	wait("b", 0)
	wait("c", 3)
	wait("d", 5)
	wait("e", 3)
	if got, want := queue(), "d@5 c@3 e@3 a b"; got != want {
		t.Errorf("queue %q, want %q: the higher classes first, each in arrival order", got, want)
	}
	run("cancel", "e")
	if got, want := queue(), "d@5 c@3 a b"; got != want {
		t.Errorf("queue %q after e cancelled, want %q", got, want)
	}
	run("release", "holder")
	if got, want := queue(), "c@3 a b"; got != want {
		t.Errorf("queue %q after the release, want %q: the slot went to d, of class 5", got, want)
	}
	if s, err := rdb.ZScore(ctx, keys[0], "d").Result(); err != nil || s == 0 {
		t.Errorf("d does not hold the slot: %v", err)
	}
}

// TestReleasesRidingOnACancelHandOn: a process's releases ride on its next
// call, whatever it is; a cancel that carries one hands the freed slot to
// the queue's head, as a release does, though the cancelled waiter held
// nothing.
func TestReleasesRidingOnACancelHandOn(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	key := "quota:{riding}"
	keys := []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix, key + TakesSuffix}
	script := redisx.NewScript(rdb, Source(""))
	run := func(op string, released []string, ids ...string) {
		t.Helper()
		args := []any{op, 1, time.Minute.Microseconds(), "", "", len(released)}
		for _, id := range append(released, ids...) {
			args = append(args, id)
		}
		cmd, _ := script.Run(ctx, keys, args...)
		if err := cmd.Err(); err != nil {
			t.Fatal(op, err)
		}
	}
	run("acquire", nil, "holder")
	run("acquire", nil, "waiter")
	run("acquire", nil, "quitter")
	run("cancel", []string{"holder"}, "quitter")
	if err := rdb.ZScore(ctx, keys[0], "waiter").Err(); err != nil {
		t.Errorf("the slot a cancel's riding release freed was not handed on: %v", err)
	}
}
