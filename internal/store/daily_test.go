package store

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/redistest"
)

// dailyLimit returns a daily Limit of n a day reset at at in loc, resolved
// as the root package resolves it.
func dailyLimit(n float64, at time.Duration, loc *time.Location) Limit {
	return Limit{Rate: daily.Rate(n), Burst: n, Reset: at, Zone: loc}
}

// TestDailyRefillsAtTheReset moves the callers' clock, which the script
// reads, across the resets of a daily layer of 3 a day at midnight in
// Los Angeles, on the days daylight saving begins (23 hours) and ends (25
// hours): the count refills at local midnight, not 24 hours after the
// last reset, and a take that finds the day spent waits until the reset.
func TestDailyRefillsAtTheReset(t *testing.T) {
	la, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		t.Skip(err)
	}
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	var now atomic.Int64
	at := func(s string) { // s: a local time in Los Angeles
		t.Helper()
		tm, err := time.ParseInLocation("2006-01-02 15:04:05", s, la)
		if err != nil {
			t.Fatal(err)
		}
		now.Store(tm.UnixNano())
	}
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	for _, tc := range []struct {
		name                        string
		before, day, last, midnight string // the evening before the change, its day's start, a second before its end, its end
		length                      time.Duration
	}{
		{"march", "2026-03-07 22:00:00", "2026-03-08 00:00:00", "2026-03-08 23:59:59", "2026-03-09 00:00:00", 23 * time.Hour},
		{"november", "2026-10-31 22:00:00", "2026-11-01 00:00:00", "2026-11-01 23:59:59", "2026-11-02 00:00:00", 25 * time.Hour},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := New("quota:", "daily-"+tc.name, []Limit{dailyLimit(3, 0, la)})
			take := func(maxWait time.Duration) Grant {
				t.Helper()
				g, err := s.Take(ctx, b, Tokens(1), maxWait)
				if err != nil {
					t.Fatal(err)
				}
				return g
			}
			at(tc.before)
			for i := range 3 {
				if g := take(0); !g.Granted() || g.Wait != 0 {
					t.Fatalf("take %d of 3 at %s: %v after %v, want granted at once", i+1, tc.before, g.Outcome, g.Wait)
				}
			}
			if g := take(time.Hour); g.Outcome != TooLong || g.Wait != 2*time.Hour {
				t.Fatalf("a 4th take at %s, waiting an hour at most: %v after %v, want too long, 2h until midnight", tc.before, g.Outcome, g.Wait)
			}
			// It waits for midnight, and counts against the next day.
			if g := take(3 * time.Hour); !g.Granted() || g.Wait != 2*time.Hour {
				t.Fatalf("a 4th take waiting 3h at most: %v after %v, want granted after 2h", g.Outcome, g.Wait)
			}
			// The day of the change: 2 left after the grant that waited.
			at(tc.day)
			for i := range 2 {
				if g := take(0); !g.Granted() {
					t.Fatalf("take %d of the 2 left after midnight: %v", i+1, g.Outcome)
				}
			}
			at(tc.last)
			if g := take(0); g.Outcome != TooLong || g.Wait != time.Second {
				t.Fatalf("a take at %s: %v after %v, want too long, 1s until midnight", tc.last, g.Outcome, g.Wait)
			}
			at(tc.midnight)
			for i := range 3 {
				if g := take(0); !g.Granted() || g.Wait != 0 {
					t.Fatalf("take %d of 3 at local midnight %s: %v after %v, want granted at once", i+1, tc.midnight, g.Outcome, g.Wait)
				}
			}
			if g := take(0); g.Outcome != TooLong {
				t.Fatalf("a 4th take at %s: %v, want too long", tc.midnight, g.Outcome)
			}
			day := daily.Resets(time.Unix(0, now.Load()), 0, la)
			if got := day[1].Sub(day[0]); got != tc.length {
				t.Errorf("the day of the change lasts %v, want %v", got, tc.length)
			}
		})
	}
}

// A daily layer of 2 beside a layer of 1 a minute, a minute before
// midnight UTC: settles give back or take more within the day; a grant
// that the minute layer makes wait past midnight counts against the next
// day, and the takes after it queue behind it there, first come, first
// served; a refund gives its count back, and a pause holds the day's
// grants and leaves its count.
func TestDailyBesideARate(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	var now atomic.Int64
	set := func(s string) {
		tm, err := time.Parse(time.DateTime, s)
		if err != nil {
			t.Fatal(err)
		}
		now.Store(tm.UnixNano())
	}
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	b := New("quota:", "beside", []Limit{{Rate: 1.0 / 60, Burst: 1}, dailyLimit(2, 0, time.UTC)})
	take := func(each []float64, maxWait time.Duration) Grant {
		t.Helper()
		g, err := s.Take(ctx, b, Cost{Each: each}, maxWait)
		if err != nil {
			t.Fatal(err)
		}
		return g
	}
	adjust := func(n float64) {
		t.Helper()
		if err := s.Adjust(ctx, b, Cost{Each: []float64{0, n}}, ""); err != nil {
			t.Fatal(err)
		}
	}
	day := []float64{0, 1} // of the daily layer alone
	granted := func(what string, g Grant) {
		t.Helper()
		if !g.Granted() || g.Wait != 0 {
			t.Fatalf("%s: %v after %v, want granted at once", what, g.Outcome, g.Wait)
		}
	}
	refused := func(what string, g Grant, wait time.Duration) {
		t.Helper()
		if g.Outcome != TooLong || g.Wait != wait {
			t.Fatalf("%s: %v after %v, want too long, %v", what, g.Outcome, g.Wait, wait)
		}
	}
	set("2026-06-01 23:59:00")
	granted("the first take", take([]float64{1, 1}, 0))
	granted("today's second", take(day, 0))
	refused("today's third", take(day, 0), time.Minute)
	adjust(-1)
	granted("one more after a settle gave one back", take(day, 0))
	adjust(-1)
	adjust(1)
	refused("after settles gave one back and took one more", take(day, 0), time.Minute)
	adjust(-1) // today has 1 left
	// The minute layer is spent: the next is due at midnight, and counts
	// against tomorrow; the take after it queues behind it.
	waited := take([]float64{1, 1}, 2*time.Minute)
	if !waited.Granted() || waited.Wait != time.Minute {
		t.Fatalf("a take of both: %v after %v, want granted after 1m", waited.Outcome, waited.Wait)
	}
	refused("a take behind the one that went to tomorrow", take(day, 0), time.Minute)
	// A pause holds the day's grants and leaves its count: the new day
	// has 1 left, after the grant that counted against it.
	set("2026-06-02 00:00:00")
	if err := s.Pause(ctx, b, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	refused("a take in a pause of 10s", take(day, 0), 10*time.Second)
	set("2026-06-02 00:00:10")
	granted("the new day's second", take(day, 0))
	refused("the new day's third", take(day, 0), 24*time.Hour-10*time.Second)
	// Refunded, a grant gives its count back, in tomorrow's count too.
	set("2026-06-02 12:00:00")
	g := take(day, 48*time.Hour)
	if !g.Granted() || g.Wait != 12*time.Hour {
		t.Fatalf("tomorrow's first, waiting 2 days at most: %v after %v", g.Outcome, g.Wait)
	}
	if err := s.Refund(ctx, b, Cost{Each: day}, g.Tats); err != nil {
		t.Fatal(err)
	}
	if g := take([]float64{0, 2}, 48*time.Hour); !g.Granted() || g.Wait != 12*time.Hour {
		t.Fatalf("tomorrow's 2 after the refund, waiting 2 days at most: %v after %v", g.Outcome, g.Wait)
	}
	// Beyond tomorrow no take goes, whatever its longest wait.
	if g := take(day, 48*time.Hour); g.Outcome != TooLong || g.Wait < 36*time.Hour {
		t.Fatalf("the day after tomorrow's: %v after %v, want too long, 36h or more", g.Outcome, g.Wait)
	}
}
