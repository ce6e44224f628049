package local

import (
	"strconv"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/store"
)

// A daily layer's local share is its count divided by the workers, a
// day, counted over every outage of the day: a take beyond it waits for
// the next day, one beyond that too is not granted, and an outage that
// ends leaves the count as it is.
func TestDailyShare(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls Shares
		// The bubble's clock starts at midnight UTC; the day resets at 06:00.
		day := store.Limit{Rate: daily.Rate(5), Burst: 5, Reset: 6 * time.Hour, Zone: time.UTC}
		b := store.New("p:", "a", []store.Limit{{Rate: 100, Burst: 100}, day})
		reserve := func() (*Reservation, time.Duration) {
			t.Helper()
			r, err := ls.Reserve(b, store.Tokens(1), 2)
			if err != nil {
				t.Fatal(err)
			}
			return r, r.Delay.Round(time.Minute)
		}
		time.Sleep(time.Second) // the rate layer's share starts empty
		reset := 6*time.Hour - time.Second
		for i, want := range []time.Duration{0, 0, reset, reset, reset + 24*time.Hour} {
			if _, got := reserve(); got != want.Round(time.Minute) {
				t.Errorf("take %d of a share of 2 a day: a delay of %v, want %v", i+1, got, want)
			}
		}
		if _, err := ls.Reserve(b, store.Tokens(3), 2); err == nil || !strings.Contains(err.Error(), "local share of the day, 2") {
			t.Errorf("3 tokens of a share of 2 a day: %v", err)
		}
		// The 5th was not granted: it is undone, as its caller does.
		r, _ := reserve()
		r.Undo()
		ls.Reset() // the outage ended; the next one starts with today spent
		if _, got := reserve(); got < time.Hour {
			t.Errorf("after an outage ended, a delay of %v, want the next day's, today being spent", got)
		}
		time.Sleep(6 * time.Hour)
		// Today now holds the 2 counted against it: spent again.
		if _, got := reserve(); got < 23*time.Hour {
			t.Errorf("on the next day, a delay of %v, want the day after's: the next day's 2 were counted", got)
		}
	})
}

// At a resume, the shared day takes what the local share granted of today
// and has not handed over yet: once, however many resumes follow.
func TestSettleDays(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	s := store.NewStore(rdb, store.Options{})
	now := time.Now().UTC()
	at := time.Duration((now.Hour()+12)%24) * time.Hour // half a day away
	day := store.Limit{Rate: daily.Rate(10), Burst: 10, Reset: at, Zone: time.UTC}
	b := store.New("p:", "a", []store.Limit{day})
	var ls Shares
	for range 3 {
		if r, err := ls.Reserve(b, store.Tokens(1), 2); err != nil || r.Delay != 0 {
			t.Fatalf("a take of a share of 5 a day: %v, %v", r, err)
		}
	}
	used := func() float64 {
		got, _ := m.Get(b.Keys[0])
		v, _ := strconv.ParseFloat(got, 64)
		today, _, _ := daily.Count(v, time.Now(), 10, at, time.UTC)
		return today
	}
	fail := func(err error) bool { t.Error(err); return true }
	for i := range 2 {
		if err := ls.Settle(s, 2, fail); err != nil {
			t.Fatal(err)
		}
		if got := used(); got != 3 {
			t.Errorf("after resume %d, the shared day counted %v, want the 3 the share granted", i+1, got)
		}
	}
	ls.Reserve(b, store.Tokens(1), 2)
	ls.Settle(s, 2, fail)
	if got := used(); got != 4 {
		t.Errorf("after a take and a resume more, the shared day counted %v, want 4", got)
	}
	// A hand-over that fails hands nothing over: the next one does.
	ls.Reserve(b, store.Tokens(1), 2)
	down := redis.NewClient(&redis.Options{Addr: m.Addr()})
	down.Close()
	if err := ls.SettleDays(store.NewStore(down, store.Options{}), func(error) bool { return true }); err == nil {
		t.Fatal("a hand-over on a closed client did not fail")
	}
	ls.Settle(s, 2, fail)
	if got := used(); got != 5 {
		t.Errorf("after a failed hand-over and one more, the shared day counted %v, want 5", got)
	}
}
