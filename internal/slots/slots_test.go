package slots

import (
	"context"
	"errors"
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
	keys := []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix}
	script := redisx.NewScript(rdb, slotsSource)
	run := func(op string, ids ...string) []any {
		t.Helper()
		args := []any{op, 1, time.Minute.Microseconds(), "", ""}
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
