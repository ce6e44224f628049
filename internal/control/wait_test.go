package control

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// TestPushedBack: a push of a higher class counts while the grant is due
// beyond the commit horizon after it; once one does not, the grant
// stands and later pushes pass it by.
func TestPushedBack(t *testing.T) {
	now := time.Now()
	// A grant at position 10, due 1s after now: a position is 100 ms.
	g := store.Grant{Pos: []float64{10}, Pushed: []int64{1}}
	state := func(pushes int64, at time.Duration) *State {
		return &State{readAt: now, anchors: []Anchor{{Scale: 100_000}}, pushes: []int64{pushes}, pushAt: now.Add(at)}
	}
	pushed := pushedBack(1, g, store.Tokens(1))
	first := state(3, 0) // two pushes since the take's reply, at once
	if got := pushed(first); len(got) != 1 || got[0] != 2 {
		t.Fatalf("pushed by %v, want 2", got)
	}
	if got := pushed(first); got[0] != 2 {
		t.Fatalf("the same state counted again: %v", got)
	}
	// Due at 1.2s now: a push at 1.15s is within the horizon.
	if got := pushed(state(4, 1150*time.Millisecond)); got[0] != 2 {
		t.Fatalf("a push within the horizon counted: %v", got)
	}
	if got := pushed(state(6, 0)); got[0] != 2 {
		t.Fatalf("a push after the grant stood counted: %v", got)
	}
	if got := pushedBack(2, g, store.Tokens(1))(first); got != nil {
		t.Errorf("a grant of another bucket's layers pushed by %v", got)
	}
}

func TestSleepAndMaxWait(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		start := time.Now()
		if err := Sleep(ctx, time.Second, nil); err != nil || time.Since(start) != time.Second {
			t.Errorf("slept %v: %v", time.Since(start), err)
		}
		wake := make(chan struct{}, 1)
		wake <- struct{}{}
		if err := Sleep(ctx, time.Hour, wake); err != nil || time.Since(start) != time.Second {
			t.Errorf("a wake did not end the sleep: %v after %v", err, time.Since(start))
		}
		if d, deadline := MaxWait(ctx, 5*time.Second); d != 5*time.Second || deadline {
			t.Errorf("MaxWait without a deadline = %v, %v", d, deadline)
		}
		dctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if d, deadline := MaxWait(dctx, 5*time.Second); d != time.Minute || !deadline {
			t.Errorf("MaxWait with a deadline a minute away = %v, %v", d, deadline)
		}
		if err := Sleep(dctx, time.Hour, nil); err != context.DeadlineExceeded || time.Since(start) != time.Minute+time.Second {
			t.Errorf("a sleep past the deadline: %v after %v", err, time.Since(start))
		}
	})
}
