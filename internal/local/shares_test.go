package local

import (
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

func TestLocalShares(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Shares
		lim := Limit{Rate: 10, Burst: 4}

		// No queue: a share of 2 workers starts empty, 5/s and burst 2.
		rl, err := ls.get("a", "ka", "ka", lim, 2)
		if err != nil {
			t.Fatal(err)
		}
		if tokens := rl.Tokens(); tokens != -0 && tokens != 0 {
			t.Errorf("a new share holds %v tokens, want 0", tokens)
		}
		time.Sleep(400 * time.Millisecond)
		if tokens := rl.Tokens(); tokens != 2 {
			t.Errorf("the share holds %v tokens after 400ms at 5/s, want its burst, 2", tokens)
		}

		// A queue 1s long: the share owes the tokens that accrue until it
		// has drained, besides its burst.
		ls.Granted("kb", time.Second)
		rl, _ = ls.get("b", "kb", "kb", lim, 2)
		if tokens := rl.Tokens(); tokens != -5 {
			t.Errorf("a share behind a 1s queue holds %v tokens, want -5: empty, and owing what accrues in 1s", tokens)
		}

		// A queue is forgotten once it has drained, however long after.
		ls.Granted("c", 200*time.Millisecond)
		if d := ls.Ahead("c"); d != 200*time.Millisecond {
			t.Errorf("ahead %v, want 200ms", d)
		}
		time.Sleep(401 * time.Millisecond)
		if d := ls.Ahead("c"); d != 0 {
			t.Errorf("ahead %v after the queue drained, want 0", d)
		}
		if n := ls.sweepQueues(); n != 1 {
			t.Errorf("%d queues remembered, want 1 (b's)", n)
		}
		time.Sleep(2 * time.Second)
		if n := ls.sweepQueues(); n != 0 {
			t.Errorf("%d queues remembered after all drained, want 0", n)
		}
		// A grant without a wait leaves nothing behind.
		ls.Granted("d", 0)
		if _, ok := ls.queues.Load("d"); ok {
			t.Error("a grant without a wait was remembered")
		}
	})
}

// TestReserve: a reservation takes from every layer asked, waits as long
// as the slowest, and is undone whole when one layer cannot serve it.
func TestReserve(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Shares
		b := store.New("p:", "a", []store.Limit{{Rate: 10, Burst: 4}, {Rate: 1, Burst: 2}})
		r, err := ls.Reserve(b, store.Tokens(1), 2)
		if err != nil {
			t.Fatal(err)
		}
		// Empty at first: 1 token takes 200ms at 5/s, 2s at 0.5/s.
		if r.Delay != 2*time.Second {
			t.Errorf("delay %v, want the slowest layer's, 2s", r.Delay)
		}
		r.Undo()
		if _, err := ls.Reserve(b, store.Tokens(2), 2); err == nil || !strings.Contains(err.Error(), "exceed this worker's local share of the burst, 1") {
			t.Errorf("2 tokens of a share of burst 1: %v", err)
		}
		again, _ := ls.Reserve(b, store.Tokens(1), 2)
		if again.Delay != 2*time.Second {
			t.Errorf("after an undo and a refused reservation, delay %v, want 2s as before", again.Delay)
		}
		meters := store.Cost{Each: []float64{1, 0}}
		if r, _ := ls.Reserve(b, meters, 2); r.Delay != 400*time.Millisecond {
			t.Errorf("a layer asked nothing held the reservation: %v, want 400ms", r.Delay)
		}
	})
}
