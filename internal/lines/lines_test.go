package lines

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

// TestLinesServeInOrder: the callers of one tenant on one bucket are
// first one after another, in the order they joined; another tenant's
// line is apart; a line that empties is forgotten.
func TestLinesServeInOrder(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Lines
		ctx := context.Background()
		first, err := ls.Join(ctx, "b", "t")
		if err != nil {
			t.Fatal(err)
		}
		other, err := ls.Join(ctx, "b", "u")
		if err != nil {
			t.Fatalf("another tenant's line waits: %v", err)
		}
		other.Leave(time.Time{})
		var order []int
		for i := range 3 {
			go func() {
				turn, err := ls.Join(ctx, "b", "t")
				if err != nil {
					t.Error(err)
					return
				}
				order = append(order, i)
				turn.Leave(time.Time{})
			}()
			synctest.Wait() // queued in order
		}
		next := time.Now().Add(time.Second)
		first.Leave(next)
		first.Leave(time.Time{}) // once only
		synctest.Wait()
		if len(order) != 3 || order[0] != 0 || order[1] != 1 || order[2] != 2 {
			t.Errorf("the callers were first in the order %v, want 0 1 2", order)
		}
		if len(ls.m) != 0 {
			t.Errorf("%d lines left, want none", len(ls.m))
		}
	})
}

// TestLinesDueAndWake: the first caller asks no sooner than the last
// turn said, and a give-back on its bucket wakes it.
func TestLinesDueAndWake(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Lines
		ctx := context.Background()
		a, _ := ls.Join(ctx, "b", "t")
		held := make(chan *Turn)
		go func() {
			b, _ := ls.Join(ctx, "b", "t")
			held <- b
		}()
		synctest.Wait()
		next := time.Now().Add(time.Second)
		a.Leave(next)
		b := <-held
		if !b.Due().Equal(next) {
			t.Errorf("due %v, want %v", b.Due(), next)
		}
		ls.GaveBack("other")
		select {
		case <-b.Wake():
			t.Fatal("woken by a give-back on another bucket")
		default:
		}
		ls.GaveBack("b")
		ls.GaveBack("b") // one wake is enough
		<-b.Wake()
		select {
		case <-b.Wake():
			t.Fatal("woken twice")
		default:
		}
		b.Leave(time.Time{})
	})
}

// TestLinesJoinEnds: a caller whose context ends while it waits leaves
// its line.
func TestLinesJoinEnds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Lines
		a, _ := ls.Join(context.Background(), "b", "t")
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if _, err := ls.Join(ctx, "b", "t"); err != context.DeadlineExceeded {
			t.Fatalf("join: %v, want the deadline", err)
		}
		if n := ls.m[key{"b", "t"}].users; n != 1 {
			t.Errorf("%d users, want the first alone", n)
		}
		a.Leave(time.Time{})
		if len(ls.m) != 0 {
			t.Errorf("%d lines left, want none", len(ls.m))
		}
	})
}

// TestPlace: a place joins its line once, keeps give-backs announced
// while its take is held, and leaves for the next caller.
func TestPlace(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Lines
		ctx := context.Background()
		var none *Place
		if none.First() || none.Wake() != nil {
			t.Fatal("a nil place is in a line")
		}
		none.Leave(time.Time{})
		none.Held(func() func() { t.Fatal("a nil place held"); return nil })

		var p Place
		if err := p.Join(ctx, &ls, "b", "t"); err != nil || !p.First() || p.Wake() == nil {
			t.Fatalf("joined: %v, first %v", err, p.First())
		}
		if err := p.Join(ctx, &ls, "b", "t"); err != nil {
			t.Fatalf("a second join waits: %v", err)
		}
		holds, ends := 0, 0
		hold := func() func() { holds++; return func() { ends++ } }
		p.Held(hold)
		p.Held(hold)
		if holds != 1 {
			t.Errorf("held %d times, want once", holds)
		}
		var q Place
		joined := make(chan time.Time, 1)
		go func() {
			if err := q.Join(ctx, &ls, "b", "t"); err != nil {
				t.Error(err)
			}
			joined <- time.Now()
		}()
		synctest.Wait()
		start := time.Now()
		p.Leave(start.Add(time.Second))
		synctest.Wait()
		if ends != 1 || p.First() {
			t.Errorf("after leaving: %d ends of the announcements, first %v", ends, p.First())
		}
		if at := <-joined; at.Sub(start) != time.Second {
			t.Errorf("the next caller asked %v after the leave, want when the queue had room, 1s", at.Sub(start))
		}
		q.Leave(time.Time{})
	})
}
