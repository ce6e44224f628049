package quota

import (
	"context"
	"errors"
	"math"
	"net/http"
	"slices"
	"sort"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
)

// fleetOf returns n Limiters, each with a client of its own, on srv.
func fleetOf(t *testing.T, srv *redistest.Server, n int, opts ...Option) []*Limiter {
	t.Helper()
	var ls []*Limiter
	for range n {
		rdb := srv.Client(t)
		rdb.AddHook(dueHook{})
		ls = append(ls, NewLimiter(rdb, opts...))
	}
	return ls
}

// arrivals runs goroutines on each Limiter that wait for lim's tokens of
// the bucket called name in a loop until stop, and returns when each
// acquisition returned, sorted.
func arrivals(t *testing.T, ls []*Limiter, goroutines int, name string, lim Limit, stop time.Time) func() []time.Time {
	var (
		mu    sync.Mutex
		woke  []time.Time
		wg    sync.WaitGroup
		fails []error
	)
	for _, l := range ls {
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(stop) {
					ctx, cancel := context.WithDeadline(context.Background(), stop.Add(5*time.Second))
					err := l.Wait(ctx, name, lim)
					cancel()
					mu.Lock()
					if err != nil {
						fails = append(fails, err)
						mu.Unlock()
						return
					}
					woke = append(woke, time.Now())
					mu.Unlock()
				}
			}()
		}
	}
	return func() []time.Time {
		wg.Wait()
		if len(fails) > 0 {
			t.Fatalf("%d waits failed, the first: %v", len(fails), fails[0])
		}
		slices.SortFunc(woke, time.Time.Compare)
		return woke
	}
}

// between counts the times in [from, to).
func between(ts []time.Time, from, to time.Time) int {
	n := 0
	for _, t := range ts {
		if !t.Before(from) && t.Before(to) {
			n++
		}
	}
	return n
}

// lastRun returns the last of ts after from that ended a run of five
// within span: the end of a pace faster than four gaps in span. A run of
// gaps, not one, so that a late wake-up followed by a punctual one does
// not pass for the old pace.
func lastRun(ts []time.Time, from time.Time, span time.Duration) time.Time {
	var last time.Time
	for i := 4; i < len(ts); i++ {
		if ts[i].After(from) && ts[i].Sub(ts[i-4]) < span {
			last = ts[i]
		}
	}
	return last
}

func TestSetLimitReachesEveryLimiter(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	ls := fleetOf(t, srv, 3)
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	const name = "override"
	old, low := Limit{Rate: 100, Burst: 10}, Limit{Rate: 20, Burst: 5}
	start := time.Now()
	stop := start.Add(5500 * time.Millisecond)
	done := arrivals(t, ls, 10, name, old, stop)

	time.Sleep(time.Until(start.Add(1500 * time.Millisecond)))
	if err := operator.SetLimit(ctx, name, low); err != nil {
		t.Fatal(err)
	}
	set := time.Now()
	time.Sleep(time.Until(set.Add(2 * time.Second)))
	if err := operator.ClearLimit(ctx, name); err != nil {
		t.Fatal(err)
	}
	cleared := time.Now()
	woke := done()

	// Grants given before the change keep their turn: 30 callers queue a
	// third of a second at 100/s. After them, grants come 50 ms apart:
	// five span 200 ms, where at the old pace they span 40.
	last := lastRun(woke[:sort.Search(len(woke), func(i int) bool { return woke[i].After(cleared) })], set, 100*time.Millisecond)
	if last.IsZero() {
		last = set // no grant at the old pace after SetLimit
	}
	slow := between(woke, set.Add(time.Second), cleared)
	fast := between(woke, cleared.Add(time.Second), stop)
	t.Logf("the old pace ended %v after SetLimit; %d grants in the second before ClearLimit (bound %d), %d in the %v after it",
		last.Sub(set).Round(time.Millisecond), slow, bound(low, time.Second), fast, stop.Sub(cleared.Add(time.Second)).Round(time.Millisecond))
	if d := last.Sub(set); d > time.Second {
		t.Errorf("grants kept the old pace %v after SetLimit, want at most a second", d)
	}
	if slow > bound(low, time.Second)+2 || slow < 15 {
		t.Errorf("%d grants in the second before ClearLimit, want %d at most and about 20", slow, bound(low, time.Second))
	}
	if secs := stop.Sub(cleared.Add(time.Second)).Seconds(); float64(fast) < 0.8*old.Rate*secs {
		t.Errorf("%d grants in %.1fs after ClearLimit restored %v, want about %.0f", fast, secs, old, old.Rate*secs)
	}
	// The swarm's bound across both changes: never the larger limit's.
	if n := maxInWindow(woke, time.Second); n > bound(old, time.Second)+3 {
		t.Errorf("%d grants in a second, bound %d", n, bound(old, time.Second))
	}
}

// deaf is a client on which a Limiter cannot listen to announcements: it
// learns of a change only when it reads the record again, a second after
// it last did.
type deaf struct{ redis.Scripter }

// A Limiter that has not heard of a change to a slower rate takes at the
// old one meanwhile. Its grants, spaced at the old pace, must not reach
// the provider as a burst once it hears: they are taken again.
func TestGrantsOutpacedByAChangeAreTakenAgain(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	stale := NewLimiter(deaf{srv.Client(t)})
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	const name = "outpaced"
	old, low := Limit{Rate: 100, Burst: 1}, Limit{Rate: 10, Burst: 1}
	start := time.Now()
	stop := start.Add(4 * time.Second)
	done := arrivals(t, []*Limiter{stale}, 20, name, old, stop)

	time.Sleep(time.Until(start.Add(1200 * time.Millisecond)))
	if err := operator.SetLimit(ctx, name, low); err != nil {
		t.Fatal(err)
	}
	set := time.Now()
	woke := done()

	// The deaf Limiter reads the record a second after its last read at
	// most, and grants at the old pace until then; from then on, the
	// provider sees the new one.
	heard := set.Add(1100 * time.Millisecond)
	busiest := 0
	for i, w := range woke {
		if w.Before(heard) {
			continue
		}
		busiest = max(busiest, between(woke[i:], w, w.Add(time.Second)))
	}
	t.Logf("%d grants in the busiest second from 1.1s after SetLimit(%v), bound %d", busiest, low, bound(low, time.Second))
	if busiest > bound(low, time.Second)+3 {
		t.Errorf("%d grants in a second once the change was heard, bound %d", busiest, bound(low, time.Second))
	}
}

func TestPauseHoldsEveryGrant(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	ls := fleetOf(t, srv, 3)
	operator := NewLimiter(srv.Client(t))
	ctx := context.Background()
	const name = "paused"
	lim := Limit{Rate: 50, Burst: 5}
	start := time.Now()
	stop := start.Add(5 * time.Second)
	done := arrivals(t, ls, 10, name, lim, stop)

	// A pause of known length, while 30 callers keep 0.6 s of grants
	// queued.
	time.Sleep(time.Until(start.Add(time.Second)))
	if err := operator.Pause(ctx, name, time.Second); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	// One with no end, then a resume.
	time.Sleep(time.Until(paused.Add(2 * time.Second)))
	if err := operator.Pause(ctx, name, Forever); err != nil {
		t.Fatal(err)
	}
	forever := time.Now()
	st, err := operator.Status(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if !st.Paused || !st.PausedUntil.IsZero() {
		t.Errorf("status during a pause forever: %+v", st)
	}
	time.Sleep(time.Until(forever.Add(time.Second)))
	if err := operator.Resume(ctx, name); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	woke := done()

	report := func(what string, from, to time.Time) {
		var last time.Time
		for _, w := range woke {
			if w.After(from) && w.Before(to) {
				last = w
			}
		}
		lastAfter := time.Duration(0)
		if !last.IsZero() {
			lastAfter = last.Sub(from)
		}
		during := between(woke, from.Add(50*time.Millisecond), to)
		t.Logf("%s: last grant %v after the call; %d grants from 50 ms after it to its end",
			what, lastAfter.Round(time.Millisecond), during)
		if during != 0 {
			t.Errorf("%s: %d grants during the pause", what, during)
		}
	}
	report("Pause(1s)", paused, paused.Add(time.Second))
	report("Pause(Forever)", forever, resumed)
	after := between(woke, paused.Add(time.Second), paused.Add(2*time.Second))
	if after < 40 || after > bound(lim, time.Second)+2 {
		t.Errorf("%d grants in the second after the pause, want about %v", after, lim.Rate)
	}
	var first time.Time
	for _, w := range woke {
		if w.After(resumed) {
			first = w
			break
		}
	}
	t.Logf("after Resume: first grant %v later, %d in the %v after",
		first.Sub(resumed).Round(time.Millisecond), between(woke, resumed, stop), stop.Sub(resumed).Round(time.Millisecond))
	if first.IsZero() || first.Sub(resumed) > 300*time.Millisecond {
		t.Errorf("first grant after Resume at %v, want within 300ms", first.Sub(resumed))
	}
	// The queue resumes at its pace: never more than the bound.
	if n := maxInWindow(woke, time.Second); n > bound(lim, time.Second)+3 {
		t.Errorf("%d grants in a second, bound %d", n, bound(lim, time.Second))
	}
}

func TestStatusReports(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := NewLimiter(rdb)
	counting := NewLimiter(srv.Client(t), WithPolicy(FallbackLocal(4).CountingWorkers()))
	ctx := context.Background()
	const name = "status"
	lim := Limit{Rate: 10, Burst: 5}

	st, err := l.Status(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Limit != (Limit{}) || st.Paused || st.Override != nil || st.Workers != 0 {
		t.Errorf("status of an unused bucket: %+v", st)
	}

	// 8 tokens of 5: 3 owed, the last grant due in 0.3 s.
	if ok, err := l.AllowN(ctx, name, 5, lim); !ok || err != nil {
		t.Fatal(ok, err)
	}
	ctx3, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	go func() { _ = l.WaitN(context.WithoutCancel(ctx3), name, 3, lim) }()
	_ = counting.Wait(ctx, "other", lim)
	time.Sleep(20 * time.Millisecond)
	st, err = l.Status(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Limit != lim || math.Abs(st.Tokens+2.8) > 0.3 || st.Queue < 200*time.Millisecond || st.Queue > 300*time.Millisecond || st.Workers != 1 || st.FleetWorkers != 1 {
		t.Errorf("status after 8 tokens: %+v; want %v, about -2.8 tokens, a queue of about 280ms, 1 worker, 1 in the roll call", st, lim)
	}

	if err := l.SetLimit(ctx, name, Limit{Rate: 2, Burst: 4}); err != nil {
		t.Fatal(err)
	}
	if err := l.Pause(ctx, name, 2*time.Second); err != nil {
		t.Fatal(err)
	}
	st, err = l.Status(ctx, name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Override == nil || *st.Override != (Limit{Rate: 2, Burst: 4}) || st.Limit != *st.Override ||
		!st.Paused || time.Until(st.PausedUntil) < time.Second || time.Until(st.PausedUntil) > 2*time.Second {
		t.Errorf("status with an override and a pause of 2s: %+v", st)
	}
	if err := l.Pause(ctx, name, Forever); err != nil {
		t.Fatal(err)
	}
	if st, _ = l.Status(ctx, name); !st.Paused || !st.PausedUntil.IsZero() || st.PausedSince.IsZero() {
		t.Errorf("status with a pause forever: %+v", st)
	}
	if err := l.Resume(ctx, name); err != nil {
		t.Fatal(err)
	}
	if err := l.ClearLimit(ctx, name); err != nil {
		t.Fatal(err)
	}
	if st, _ = l.Status(ctx, name); st.Paused || st.Override != nil || st.Limit != lim {
		t.Errorf("status after Resume and ClearLimit: %+v", st)
	}
}

func TestPauseRefusesWhatCannotWait(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 100, Burst: 10}
	if err := l.Wait(ctx, "p", lim); err != nil {
		t.Fatal(err)
	}
	if err := l.Pause(ctx, "p", time.Hour); err != nil {
		t.Fatal(err)
	}
	if ok, err := l.Allow(ctx, "p", lim); ok || err != nil {
		t.Errorf("Allow during a pause: %v, %v; want false", ok, err)
	}
	prov, reached := countingServer(t)
	req, _ := http.NewRequest("GET", prov.URL, nil)
	if _, err := NewTransport(rdb, lim, WithKey(Fixed("p")), WithNoWait()).RoundTrip(req); !errors.Is(err, ErrWouldWait) || reached.Load() != 0 {
		t.Errorf("WithNoWait during a pause: %v, %d requests sent; want ErrWouldWait and none", err, reached.Load())
	}
	short, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	began := time.Now()
	if err := l.Wait(short, "p", lim); !errors.Is(err, ErrWouldExceedDeadline) || time.Since(began) > 100*time.Millisecond {
		t.Errorf("Wait with a deadline before the pause ends: %v after %v; want ErrWouldExceedDeadline at once", err, time.Since(began))
	}
	dry := NewLimiter(rdb, WithDryRun())
	if err := dry.Wait(ctx, "p", lim); err != nil {
		t.Errorf("dry run during a pause: %v", err)
	}
	// Without a deadline a caller waits for the resume.
	waited := make(chan error, 1)
	go func() { waited <- l.Wait(ctx, "p", lim) }()
	select {
	case err := <-waited:
		t.Fatalf("Wait returned %v during the pause", err)
	case <-time.After(100 * time.Millisecond):
	}
	if err := l.Resume(ctx, "p"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-waited:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("Wait still waiting 2s after Resume")
	}

	for _, c := range []struct {
		what string
		err  error
		want error
	}{
		{"SetLimit rate 0", l.SetLimit(ctx, "p", Limit{}), ErrInvalidLimit},
		{"SetLimit burst -1", l.SetLimit(ctx, "p", Limit{Rate: 1, Burst: -1}), ErrInvalidLimit},
		{"Pause 0", l.Pause(ctx, "p", 0), ErrInvalidLimit},
		{"Pause -1s", l.Pause(ctx, "p", -time.Second), ErrInvalidLimit},
		{"Pause of an empty name", l.Pause(ctx, "", time.Second), ErrInvalidKey},
		{"SetLimit of an empty name", l.SetLimit(ctx, "", lim), ErrInvalidKey},
		{"Resume of an empty name", l.Resume(ctx, ""), ErrInvalidKey},
	} {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: %v, want %v", c.what, c.err, c.want)
		}
	}
	if _, err := l.Status(ctx, ""); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("Status of an empty name: %v", err)
	}
}

func TestOverrideAppliesToTheFirstLayerOnly(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	perSecond, perMinute := Limit{Rate: 100, Burst: 100}, Limit{Rate: 1, Burst: 3}
	if err := l.SetLimit(ctx, "layers", Limit{Rate: 1, Burst: 2}); err != nil {
		t.Fatal(err)
	}
	// The override lets 2 through of the first layer; the second layer's
	// 3 are untouched by it.
	granted := 0
	for range 5 {
		if ok, err := l.AllowN(ctx, "layers", 1, perSecond, perMinute); err != nil {
			t.Fatal(err)
		} else if ok {
			granted++
		}
	}
	if granted != 2 {
		t.Errorf("%d granted under an override of burst 2, want 2", granted)
	}
	if _, err := l.AllowN(ctx, "layers", 3, perSecond); !errors.Is(err, ErrExceedsBurst) {
		t.Errorf("3 tokens under an override of burst 2: %v, want ErrExceedsBurst", err)
	}
}

func TestControlReadsAreBounded(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 1000, Burst: 1000}
	began := time.Now()
	for time.Since(began) < 2500*time.Millisecond {
		if err := l.Wait(ctx, "reads", lim); err != nil {
			t.Fatal(err)
		}
		time.Sleep(2 * time.Millisecond)
	}
	reads, takes := cmds.get("control"), cmds.get("evalsha")+cmds.get("eval")
	t.Logf("%d takes, %d reads of the control record in 2.5s", takes, reads)
	if reads < 2 || reads > 4 {
		t.Errorf("%d reads of the control record in 2.5s, want the first and one a second", reads)
	}
}

// A control record that holds nothing an operator set lives while its
// bucket is in use or queued, and no longer; one with an override or a
// pause with no end stays.
func TestControlRecordExpires(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	const name = "expiry"
	key := "quota:{" + name + "}"
	ttl := func() time.Duration {
		t.Helper()
		d, err := rdb.PTTL(ctx, key+control.Suffix).Result()
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	// A queue of a minute: the record lives as long.
	if ok, err := l.AllowN(ctx, name, 61, Limit{Rate: 1, Burst: 61}); !ok || err != nil {
		t.Fatal(ok, err)
	}
	if err := l.ClearLimit(ctx, name); err != nil { // a write, that sets the expiry again
		t.Fatal(err)
	}
	if d := ttl(); d < 55*time.Second || d > 62*time.Second {
		t.Errorf("a record whose bucket is full in a minute expires in %v", d)
	}
	for _, c := range []struct {
		what string
		do   func() error
		keep bool
	}{
		{"an override", func() error { return l.SetLimit(ctx, name, Limit{Rate: 2, Burst: 4}) }, true},
		{"no override", func() error { return l.ClearLimit(ctx, name) }, false},
		{"a pause forever", func() error { return l.Pause(ctx, name, Forever) }, true},
		{"a resume", func() error { return l.Resume(ctx, name) }, false},
	} {
		if err := c.do(); err != nil {
			t.Fatal(err)
		}
		if d := ttl(); (d == -1) != c.keep {
			t.Errorf("after %s the record expires in %v; want it kept: %v", c.what, d, c.keep)
		}
	}
	// An unqueued bucket's record goes 10 s after its last read.
	if err := rdb.Del(ctx, key).Err(); err != nil {
		t.Fatal(err)
	}
	if err := l.ClearLimit(ctx, name); err != nil {
		t.Fatal(err)
	}
	if d := ttl(); d < 9*time.Second || d > 10*time.Second {
		t.Errorf("a record with nothing set and no queue expires in %v, want 10s", d)
	}
}
