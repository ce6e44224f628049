package pending

import (
	"context"
	"testing"
	"time"
)

func TestWait(t *testing.T) {
	var c Count
	if err := c.Wait(context.Background()); err != nil {
		t.Fatalf("Wait with nothing under way: %v", err)
	}
	c.Add(2)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if err := c.Wait(ctx); err != context.DeadlineExceeded {
		t.Fatalf("Wait with 2 under way: %v, want the deadline", err)
	}
	done := make(chan error)
	go func() { done <- c.Wait(context.Background()) }()
	c.Done(1)
	select {
	case err := <-done:
		t.Fatalf("Wait returned %v with 1 still under way", err)
	case <-time.After(20 * time.Millisecond):
	}
	c.Done(1)
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("Wait: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Wait did not return once nothing was under way")
	}
	c.Add(1) // a Count is used again after a Wait
	c.Done(1)
}

func TestDoneBeyondAdded(t *testing.T) {
	defer func() {
		if recover() == nil {
			t.Fatal("Done beyond Add did not panic")
		}
	}()
	var c Count
	c.Done(1)
}
