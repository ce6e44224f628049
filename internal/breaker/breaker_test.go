package breaker

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

const idle = time.Minute

// changes records what a breaker told its hook.
type changes struct {
	mu  sync.Mutex
	all []Change
}

func (c *changes) add(ch Change) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.all = append(c.all, ch)
}

// of returns the changes of event told so far.
func (c *changes) of(event Event) []Change {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []Change
	for _, ch := range c.all {
		if ch.Event == event {
			out = append(out, ch)
		}
	}
	return out
}

// newTestBreaker returns a breaker whose questions to Redis are answered
// by answer, recording when each was asked, and what it told its hook.
func newTestBreaker(answer func(n int) error) (*Breaker, func(context.Context) error, *changes, func() []time.Time) {
	told := &changes{}
	var mu sync.Mutex
	var asked []time.Time
	br := New(Config{RemindEvery: time.Minute, Idle: idle, OnChange: told.add})
	ask := func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, time.Now())
		return answer(len(asked))
	}
	return br, ask, told, func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(asked)
	}
}

var errDown = errors.New("connection refused")

func TestBreakerBacksOffAndReminds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, ask, told, asked := newTestBreaker(func(int) error { return errDown })
		start := time.Now()
		br.Trip("k", ask, errDown)
		if !br.Open() {
			t.Fatal("closed after a trip")
		}
		// A request every second keeps the probe going for five minutes.
		for range 300 {
			br.Touch(ask)
			br.Served()
			time.Sleep(time.Second)
		}
		synctest.Wait()
		var gaps []time.Duration
		last := start
		for _, at := range asked()[:7] {
			gaps = append(gaps, at.Sub(last))
			last = at
		}
		want := []time.Duration{50, 100, 200, 400, 500, 500, 500}
		for i := range want {
			if gaps[i] != want[i]*time.Millisecond {
				t.Fatalf("the probe asked after %v, want %v ms", gaps, want)
			}
		}
		// One reminder a minute: at 1, 2, 3 and 4 minutes, and at 5 when
		// the fifth minute's probe lands before the loop ends.
		reminders := told.of(Reminded)
		if n := len(reminders); n < 4 || n > 5 {
			t.Fatalf("%d reminders in 5 minutes, want one a minute", n)
		}
		if r := reminders[0]; r.Served < 55 || r.Served > 61 || r.For < time.Minute || r.For > time.Minute+MaxBackoff || r.Cause != errDown {
			t.Errorf("the first reminder says %d requests were served in %v, cause %v; want about 60 in a minute, %v", r.Served, r.For, r.Cause, errDown)
		}
		if trips := told.of(Tripped); len(trips) != 1 || trips[0].Bucket != "k" || trips[0].Cause != errDown {
			t.Errorf("the outage was told as %+v, want once, of k", trips)
		}
		time.Sleep(2 * idle) // the probe stops
	})
}

func TestBreakerCloses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var openWhenAnswered []bool
		var br *Breaker
		br, ask, told, asked := newTestBreaker(func(n int) error {
			openWhenAnswered = append(openWhenAnswered, br.Open())
			if n < 4 {
				return errDown
			}
			return nil
		})
		var openWhenTold []bool
		br.cfg.OnChange = func(c Change) { openWhenTold = append(openWhenTold, br.Open()); told.add(c) }
		br.Trip("k", ask, errDown)
		br.Served()
		time.Sleep(time.Second)
		synctest.Wait()
		if br.Open() || len(asked()) != 4 {
			t.Fatalf("open %v after %d questions, want closed after 4", br.Open(), len(asked()))
		}
		if slices.Contains(openWhenAnswered, false) {
			t.Errorf("the probe asked while the breaker was closed: %v", openWhenAnswered)
		}
		rec := told.of(Recovered)
		if len(rec) != 1 || rec[0].Served != 1 || rec[0].For != (50+100+200+400)*time.Millisecond {
			t.Errorf("the recovery was told as %+v, want once, after 750ms, one request served", rec)
		}
		if openWhenTold[len(openWhenTold)-1] {
			t.Error("the recovery was told before the breaker closed")
		}
	})
}

// TestBreakerHalfOpensWhenIdle: a probe that has served no request for
// the idle time stops, and the breaker stops reporting an outage that
// nobody has checked since.
func TestBreakerHalfOpensWhenIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, ask, told, asked := newTestBreaker(func(int) error { return errDown })
		br.Trip("k", ask, errDown)
		time.Sleep(idle - time.Second)
		if !br.Open() {
			t.Fatal("closed before the probe's idle time")
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if br.Open() || br.probing.Load() {
			t.Fatalf("open %v, probing %v after the idle time; want closed, no probe", br.Open(), br.probing.Load())
		}
		n := len(asked())
		time.Sleep(time.Hour)
		if len(asked()) != n {
			t.Errorf("the probe asked %d more times after it stopped", len(asked())-n)
		}
		if n := len(told.of(Idled)); n != 1 || len(told.of(Recovered)) != 0 {
			t.Errorf("the half-open breaker was told %d times, want once, and no recovery", n)
		}
	})
}
