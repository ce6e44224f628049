package quota

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// A daily Limit is a count: it validates as one, refuses a rate beside it,
// prints its reset, and cannot be an override.
func TestDailyLimitValidates(t *testing.T) {
	la := time.FixedZone("Pacific", -8*3600)
	if err := Daily(1500, 0, la).Validate(); err != nil {
		t.Errorf("Daily(1500, 0, la): %v", err)
	}
	if got, want := Daily(1500, 7*time.Hour+30*time.Minute, time.UTC).String(), "1500 a day from 07:30 UTC"; got != want {
		t.Errorf("String: %q, want %q", got, want)
	}
	for _, tc := range []struct {
		lim  Limit
		want string
	}{
		{Daily(-1, 0, la), "count"},
		{Daily(0, 0, la), "count"},
		{Daily(5, 24*time.Hour, la), "Reset"},
		{Daily(5, -time.Second, la), "Reset"},
		{Limit{Rate: 1, Burst: 5, Zone: la}, "not a rate"},
		{Limit{Burst: 5, Reset: time.Hour}, "Zone is nil"},
	} {
		err := tc.lim.Validate()
		if !errors.Is(err, ErrInvalidLimit) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: %v, want ErrInvalidLimit saying %q", tc.lim, err, tc.want)
		}
	}
	func() {
		defer func() {
			if r := recover(); r == nil || !strings.Contains(r.(string), "nil *time.Location") {
				t.Errorf("Daily with a nil location: panic %v", r)
			}
		}()
		Daily(5, 0, nil)
	}()
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	if err := l.SetLimit(context.Background(), "api", Daily(5, 0, la)); !errors.Is(err, ErrInvalidLimit) {
		t.Errorf("SetLimit of a daily Limit: %v, want ErrInvalidLimit", err)
	}
}

// A daily layer beside a rate layer, on a real server, with the Limiter's
// clock stopped: N grants a day, all or nothing with the rate layer.
func TestDailyLayerAllOrNothing(t *testing.T) {
	_, rdb := limiterServer(t)
	clock := newStoppedClock()
	l := NewLimiter(rdb, WithClock(clock.Now), WithNoBatching())
	ctx := context.Background()
	rate, day := Limit{Rate: 1, Burst: 2}, Daily(5, 0, time.UTC)
	allow := func(n float64) bool {
		t.Helper()
		ok, err := l.AllowN(ctx, "api", n, rate, day)
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	if !allow(2) || allow(1) {
		t.Fatal("the rate layer's burst of 2: want 2 granted, then 1 refused")
	}
	// The refusal took nothing of the day's count: 3 remain, a second each.
	for i := range 3 {
		clock.advance(time.Second)
		if !allow(1) {
			t.Fatalf("grant %d of the 3 left of the day, after a second: refused", i+1)
		}
	}
	clock.advance(10 * time.Second) // the rate layer full again
	if allow(1) {
		t.Fatal("a 6th grant of a day of 5 granted")
	}
	// Nor did the daily layer's refusal take from the rate layer: its
	// burst of 2 is there tomorrow.
	clock.advance(24 * time.Hour)
	if !allow(2) {
		t.Fatal("the next day, 2 of the rate layer's burst: refused")
	}
	// Status tells the rate layer, and the day's count: the new day's 2.
	st, err := l.Status(ctx, "api")
	if err != nil || len(st.Layers) != 2 || st.Layers[0].Rate != 1 || st.Layers[1].Daily == nil ||
		st.Layers[1].Daily.Used != 2 || st.Layers[1].Tokens != 3 || st.Layers[1].Burst != 5 {
		t.Errorf("Status: %v, %+v; want the rate layer, then the day's with 2 used of 5", err, st.Layers)
	}
}

// Many goroutines, each its own Limiter, on a daily layer of 100 beside a
// fast rate: exactly 100 granted, however they interleave. Without the
// daily layer, the same run grants many more (the negative control).
func TestDailyLayerConcurrent(t *testing.T) {
	srv, _ := limiterServer(t)
	ctx := context.Background()
	run := func(name string, layers ...Limit) int64 {
		var granted atomic.Int64
		var wg sync.WaitGroup
		for range 8 {
			l := NewLimiter(srv.Client(t))
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for range 25 {
						ok, err := l.AllowN(ctx, name, 1, PerSecond(1e6), layers...)
						if err != nil {
							t.Error(err)
							return
						}
						if ok {
							granted.Add(1)
						}
					}
				}()
			}
		}
		wg.Wait()
		return granted.Load()
	}
	if n := run("daily", Daily(100, awayFromReset(time.Now()), time.UTC)); n != 100 {
		t.Errorf("a day of 100, 64 goroutines asking 25 times each: %d granted", n)
	}
	n := run("rate")
	t.Logf("without the daily layer: %d of 1600 granted", n)
	if n <= 100 {
		t.Errorf("without the daily layer, %d granted: the control grants no more than the day would", n)
	}
}

// A take that finds the day spent waits for the reset, within its
// deadline: on a clock that stands still 600 ms before the reset, it
// sleeps 600 ms.
func TestDailyWaitsForTheReset(t *testing.T) {
	_, rdb := limiterServer(t)
	clock := newStoppedClock()
	l := NewLimiter(rdb, WithClock(clock.Now))
	ctx := context.Background()
	reset := clock.Now().UTC().Add(600 * time.Millisecond)
	day := Daily(2, reset.Sub(reset.Truncate(24*time.Hour)), time.UTC)
	for range 2 {
		if err := l.Wait(ctx, "api", day); err != nil {
			t.Fatal(err)
		}
	}
	short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	if err := l.Wait(short, "api", day); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Fatalf("a wait past the deadline for the reset: %v, want ErrWouldExceedDeadline", err)
	}
	long, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	start := time.Now()
	if err := l.Wait(long, "api", day); err != nil {
		t.Fatal(err)
	}
	if slept := time.Since(start); slept < 550*time.Millisecond {
		t.Errorf("the 3rd of a day of 2 went after %v, before the reset 600 ms away", slept)
	}
	// It counted against the new day, which has 1 left.
	clock.advance(time.Second)
	if ok, err := l.Allow(ctx, "api", day); err != nil || !ok {
		t.Errorf("the new day's 2nd: %v, %v; want granted", ok, err)
	}
	if ok, err := l.Allow(ctx, "api", day); err != nil || ok {
		t.Errorf("the new day's 3rd: %v, %v; want refused", ok, err)
	}
	// Status tells the day: both of the new day's 2 used.
	if st, err := l.Status(ctx, "api"); err != nil || len(st.Layers) != 1 || st.Layers[0].Daily == nil || st.Layers[0].Daily.Used != 2 || st.Layers[0].Tokens != 0 {
		t.Errorf("Status of a bucket whose first layer is daily: %v, %+v; want the day's layer, 2 used", err, st.Layers)
	}
}

// A daily Meter beside a token Meter: each request counts against the
// day's requests, all or nothing with its tokens.
func TestDailyMeter(t *testing.T) {
	_, rdb := limiterServer(t)
	clock := newStoppedClock()
	l := NewLimiter(rdb, WithClock(clock.Now))
	ctx := context.Background()
	defer l.Flush(ctx) // the settles
	meters := []Meter{{Name: "requests", Limit: Daily(3, 0, time.UTC)}, {Name: "tokens", Limit: Limit{Rate: 1, Burst: 100}}}
	reserve := func(tokens float64) error {
		short, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		r, err := l.Reserve(short, "llm", meters, Usage{"requests": 1, "tokens": tokens})
		if err == nil {
			r.Settle(Usage{"requests": 1, "tokens": tokens}) // as reserved: nothing to give back
		}
		return err
	}
	if err := reserve(60); err != nil {
		t.Fatal(err)
	}
	// 70 tokens of the 40 left, on a clock that stands still: refused, and
	// the day's count is not taken.
	if err := reserve(70); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Fatalf("70 tokens of 60: %v, want ErrWouldExceedDeadline", err)
	}
	for i := range 2 {
		if err := reserve(10); err != nil {
			t.Fatalf("request %d of the 2 left of the day: %v", i+1, err)
		}
	}
	if err := reserve(1); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Fatalf("a 4th request of a day of 3: %v, want ErrWouldExceedDeadline", err)
	}
}

// A Transport with a daily layer sends the day's count and no more; the
// requests it refuses never reach the provider.
func TestDailyTransportLayer(t *testing.T) {
	_, rdb := limiterServer(t)
	provider, reached := countingServer(t)
	tr := NewTransport(rdb, PerSecond(1000), WithLayers(Daily(3, 0, time.UTC)), WithNoWait())
	client := &http.Client{Transport: tr}
	for i := range 5 {
		resp, err := client.Get(provider.URL)
		if i < 3 && err != nil {
			t.Fatalf("request %d of a day of 3: %v", i+1, err)
		}
		if i >= 3 && !errors.Is(err, ErrWouldWait) {
			t.Fatalf("request %d of a day of 3: %v, want ErrWouldWait", i+1, err)
		}
		if resp != nil {
			resp.Body.Close()
		}
	}
	if n := reached.Load(); n != 3 {
		t.Errorf("%d requests reached the provider, want 3", n)
	}
}

// An operator's pause (a record operation, which knows no Limits) holds a
// daily layer's grants and leaves its count, as a provider's does: as a
// further layer and as the first.
func TestDailyOperatorPause(t *testing.T) {
	_, rdb := limiterServer(t)
	clock := newStoppedClock()
	l := NewLimiter(rdb, WithClock(clock.Now))
	ctx := context.Background()
	day := Daily(1e6, awayFromReset(clock.Now()), time.UTC) // the 10 minutes it moves cross no reset
	for _, tc := range []struct {
		name   string
		layers []Limit
	}{{"further", []Limit{{Rate: 1e6, Burst: 1e6}, day}}, {"first", []Limit{day}}} {
		allow := func(n float64) bool {
			t.Helper()
			ok, err := l.AllowN(ctx, tc.name, n, tc.layers[0], tc.layers[1:]...)
			if err != nil {
				t.Fatal(err)
			}
			return ok
		}
		if !allow(999990) {
			t.Fatalf("%s: 999,990 of a day of 1e6: refused", tc.name)
		}
		if err := l.Pause(ctx, tc.name, 10*time.Minute); err != nil {
			t.Fatal(err)
		}
		if allow(1) {
			t.Fatalf("%s: granted in a pause", tc.name)
		}
		clock.advance(10*time.Minute + time.Second)
		if !allow(10) || allow(1) {
			t.Errorf("%s: after the pause, want the 10 left of the day and no more", tc.name)
		}
	}
}

// Tenants share a bucket with a daily layer: the day's count charges
// them no time (its tokens are no rate), so that a take waits for the
// rate layer alone.
func TestDailyTenants(t *testing.T) {
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb, WithTenants(Tenants{}))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	for i := range 4 {
		tctx := ContextWithTenant(ctx, []string{"a", "b"}[i%2])
		wg.Go(func() {
			for range 10 {
				if err := l.WaitN(tctx, "api", 1, Limit{Rate: 20, Burst: 1}, Daily(100, awayFromReset(start), time.UTC)); err != nil {
					t.Error(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if d := time.Since(start); d > 4*time.Second {
		t.Errorf("40 takes at 20/s took %v, want about 2s", d)
	}
}

// awayFromReset returns a time of day, on the hour in UTC, half a day from
// now: a daily Limit that resets then counts one day through a test that
// runs at now, whatever the time of day (one that reset at midnight failed
// in the ten minutes before it).
func awayFromReset(now time.Time) time.Duration {
	return time.Duration((now.UTC().Hour()+12)%24) * time.Hour
}
