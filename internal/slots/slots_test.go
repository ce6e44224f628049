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
		v, err := cmd.Slice()
		if err != nil {
			t.Fatal(op, err)
		}
		return v
	}
	run("acquire", "holder")
	run("acquire", "stalled")
	// The stalled waiter's lease ends; its place in the queue is left.
	if err := rdb.ZRem(ctx, keys[1], "stalled").Err(); err != nil {
		t.Fatal(err)
	}
	run("acquire", "newcomer")
	// The holder's process renews one held id and one waiting id.
	v := run("renew", "1", "holder", "stalled")
	if len(v) != 3 || v[1] != int64(slotHolds) || v[2] != int64(slotWaits) {
		t.Errorf("renew replied %v, want {hint, holds, waits}", v)
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
	// A holder Redis forgot is reported, not held again.
	if err := rdb.ZRem(ctx, keys[0], "holder").Err(); err != nil {
		t.Fatal(err)
	}
	v = run("renew", "1", "holder", "stalled")
	if len(v) != 3 || v[1] != int64(slotUnknown) {
		t.Errorf("renew replied %v, want the forgotten holder unknown", v)
	}
	if err := rdb.ZScore(ctx, keys[0], "holder").Err(); !errors.Is(err, redis.Nil) {
		t.Errorf("the forgotten holder holds again: %v", err)
	}
}
