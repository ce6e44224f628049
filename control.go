package quota

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/store"
)

// controlIdle is how long a Limiter stays unused before it stops
// listening; a variable for the tests.
var controlIdle = time.Minute

// controlled returns b under its control record: with the override as its
// first layer's Limit, and the entry that tells of its pauses. A record
// that cannot be read because Redis is unavailable leaves b as it was read
// last, and the breaker learns of the outage; any other failure to read
// it is the caller's error. A read of the record counts among the span's
// round trips.
func (l *Limiter) controlled(ctx context.Context, span *waitSpan, b bucket) (bucket, error) {
	e, sent, err := l.controls.Entry(ctx, b.Name, b.Keys, control.Limit(b.Lims[0]), l.mode() == ModeShared)
	if sent {
		span.trips++
	}
	if err != nil {
		cerr := l.classify(ctx, err)
		if !errors.Is(cerr, ErrUnavailable) {
			return bucket{}, cerr
		}
		l.trip(b, err)
	}
	b.ctl, b.passed = e, b.limit(0)
	return b.under(e), nil
}

// under returns b under the state of its control record e read last: with
// the override, if any, as its first layer's Limit, else the Limit its
// callers pass.
func (b bucket) under(e *control.Entry) bucket {
	st := e.Load()
	want := b.passed
	if o, ok := st.Override(); ok {
		want = Limit(o)
	}
	if b.limit(0) != want {
		b.Lims = slices.Clone(b.Lims)
		b.Lims[0] = store.Limit(want)
	}
	b.st = st
	return b
}

// Bounds on how callers wait outside the script: a caller waiting for a
// pause rechecks what the Limiter knows at least every waitCheck, and one
// that the script refused for a pause the Limiter did not know of waits
// at least minRetry before it takes again.
const (
	waitCheck = time.Second
	minRetry  = 250 * time.Millisecond
)

// awaitPause waits while b is paused, as far as the Limiter knows, when
// the script cannot queue the caller behind the pause: while it has no
// end, or ends after the longest wait the caller accepts (maxWait). It
// refuses at once with ErrWouldWait under noWait, and with
// ErrWouldExceedDeadline when the pause ends after ctx's deadline; a
// pause with no end may be resumed any time, so the caller keeps waiting
// for it until its deadline. Under dry run it records the wait and
// returns. It rechecks at least every waitCheck: whatever it misses, it
// finds out then.
func (l *Limiter) awaitPause(ctx context.Context, span *waitSpan, b bucket, o *ask) error {
	if b.ctl == nil {
		return ctx.Err()
	}
	var done func()
	defer func() {
		if done != nil {
			done()
		}
	}()
	var t *time.Timer // made when the caller first waits
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		st := b.ctl.Load()
		now := time.Now()
		end, forever, paused := st.PausedAt(now)
		if !paused {
			return ctx.Err()
		}
		until := "until resumed"
		if !forever {
			until = "for " + end.Sub(now).Round(time.Millisecond).String()
		}
		maxWait, hasDeadline := l.maxWait(ctx)
		switch {
		case span.dryRun:
			if !forever {
				span.wait = end.Sub(now)
			}
			return ctx.Err()
		case o.noWait:
			// The script decides, with the record as it is now: a pause
			// this Limiter knows of may have been resumed since.
			return ctx.Err()
		case hasDeadline && !forever && end.Sub(now) > maxWait:
			return fmt.Errorf("%w: %q is paused %s", ErrWouldExceedDeadline, b.Name, until)
		case !forever && end.Sub(now) <= maxWait:
			return ctx.Err() // the script queues it behind the pause
		}
		if done == nil {
			done = l.controls.Wait(b.ctl)
		}
		next := waitCheck
		if !forever {
			next = min(next, end.Sub(now)-maxWait+time.Millisecond)
		}
		t = reset(t, max(next, time.Millisecond))
		select {
		case <-st.Replaced():
			t.Stop()
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// sleepOn waits for a grant of bucket b, a take of n, that falls due after
// g.Wait, later by as much as a pause or a change of the Limit in force,
// recorded since the take, moved the queue it was granted in, and sooner
// by as much as give-backs moved it (see backOff). When ctx ends first,
// or a pause moves the grant past ctx's deadline, it returns how far the
// grant had been moved with the error, for the refund.
func (l *Limiter) sleepOn(ctx context.Context, b bucket, g store.Grant, n store.Cost) (time.Duration, error) {
	if g.Wait <= 0 {
		return 0, nil
	}
	replied := time.Now()
	due := replied.Add(g.Wait)
	if b.ctl == nil {
		return 0, sleep(ctx, g.Wait)
	}
	takenAt := g.TakenAt(b.Bucket)
	sooner := l.backOff(b, g, n, replied)
	later := pushedBack(b, g, n)
	if l.noPushes {
		later = func(_ *control.State, due time.Time) time.Time { return due }
	}
	// A sleep long enough for a read of the record to matter, or one that
	// a pause holds, registers: the Limiter reads the record every
	// control.WaitRefresh meanwhile. A shorter one learns of a change from its
	// announcement alone.
	var done func()
	defer func() {
		if done != nil {
			done()
		}
	}()
	deadline, hasDeadline := ctx.Deadline()
	// when returns when the grant falls due under st, false while a pause
	// with no end holds it.
	when := func(st *control.State) (time.Time, bool) {
		at, ends := st.Hold(later(st, sooner(st, due)), takenAt, control.Pause(g.Pause))
		if !ends {
			return at, false
		}
		return st.Rescale(at, takenAt, b.ctl.Rate(st)), true
	}
	var t *time.Timer // made when the caller first waits
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
	for {
		st := b.ctl.Load()
		at, ends := when(st)
		if ends && hasDeadline && at.After(deadline) {
			return at.Sub(due), ErrWouldExceedDeadline
		}
		if ends && !time.Now().Before(at) {
			return 0, nil
		}
		next := waitCheck
		if ends {
			next = time.Until(at)
		}
		if done == nil && (!ends || next >= control.WaitRefresh) {
			done = l.controls.Wait(b.ctl)
		}
		t = reset(t, next)
		select {
		case <-t.C:
		case <-st.Replaced():
			t.Stop()
		case <-ctx.Done():
			if at, ends := when(b.ctl.Load()); ends {
				// What a pause moved the grant by; not what give-backs
				// moved it sooner, which the refund's layers need not share.
				return max(at.Sub(due), 0), ctx.Err()
			}
			return 0, ctx.Err()
		}
	}
}

// backOff returns what moves the due time of grant g, a take of n from b
// whose reply came at replied, by what give-backs (settles) have moved
// its layers' queues since: each layer the take asked of falls due that
// much sooner, and the grant when the last of them does. The give-backs
// count from those the take's reply found (g.Back), which the queue it
// joined held already; without them, from the first read of the record
// sent after the reply, never from one before.
func (l *Limiter) backOff(b bucket, g store.Grant, n store.Cost, replied time.Time) func(*control.State, time.Time) time.Time {
	if len(g.Tats) != len(b.Keys) {
		return func(_ *control.State, due time.Time) time.Time { return due }
	}
	k := len(b.Keys)
	suffixes := make([]string, k)
	lags := make([]time.Duration, k) // how long before the grant layer i falls due
	last := int64(math.MinInt64)
	for i, lim := range b.Lims {
		suffixes[i] = b.Keys[i][len(b.Keys[0]):]
		last = max(last, g.Tats[i]-int64(lim.Burst/lim.Rate*1e6))
	}
	for i, lim := range b.Lims {
		lags[i] = time.Duration(last-(g.Tats[i]-int64(lim.Burst/lim.Rate*1e6))) * time.Microsecond
	}
	var base []int64 // the give-backs the take found
	if len(g.Back) == k {
		base = g.Back
	}
	return func(st *control.State, due time.Time) time.Time {
		if base == nil && st.ReadAt().Before(replied) {
			return due
		}
		if base == nil {
			base = make([]int64, k)
			for i := range base {
				base[i], _ = b.ctl.Back(st, suffixes[i])
			}
			return due
		}
		moved := time.Time{}
		for i := range k {
			if n.Of(i) <= 0 {
				continue // a layer asked nothing holds nothing back
			}
			back, ok := b.ctl.Back(st, suffixes[i])
			shift := time.Duration(0)
			if ok && back > base[i] {
				shift = time.Duration(back-base[i]) * time.Microsecond
			}
			if at := due.Add(-lags[i] - shift); at.After(moved) {
				moved = at
			}
		}
		if moved.IsZero() || moved.After(due) {
			return due
		}
		return moved
	}
}

// pushMargin widens control.CommitHorizon for the clocks: a caller
// counts a push as its own if its grant was due later than the horizon
// less pushMargin after it. Counting one the script did not make only
// sends the request a little later; missing one would send it early.
const pushMargin = 25 * time.Millisecond

// pushedBack returns what moves the due time of grant g, a take of n from
// b, by what takes of higher priority classes have pushed n's class back
// since: each layer the take asked of falls due that much later, and the
// grant when the last of them does. A push counts for a layer whose part
// of the grant was due more than the commit horizon after it (see
// control.CommitHorizon); from the first one that does not, the grant
// stands, and later pushes pass it by. The pushes count from those the
// take's reply found (g.Pushed). It keeps what it has counted: call it with
// the states in the order read.
func pushedBack(b bucket, g store.Grant, n store.Cost) func(*control.State, time.Time) time.Time {
	k := len(b.Keys)
	if b.ctl == nil || len(g.Tats) != k {
		return func(_ *control.State, due time.Time) time.Time { return due }
	}
	suffixes := make([]string, k)
	lags := make([]time.Duration, k) // how long before the grant layer i falls due
	last := int64(math.MinInt64)
	for i, lim := range b.Lims {
		suffixes[i] = b.Keys[i][len(b.Keys[0]):]
		last = max(last, g.Tats[i]-int64(lim.Burst/lim.Rate*1e6))
	}
	for i, lim := range b.Lims {
		lags[i] = time.Duration(last-(g.Tats[i]-int64(lim.Burst/lim.Rate*1e6))) * time.Microsecond
	}
	seen := make([]int64, k)    // the push counts counted from, µs
	applied := make([]int64, k) // what they moved each layer, µs
	stood := make([]bool, k)    // the layer's part stands: no push moves it now
	if c := n.Class; len(g.Pushed) >= (c+1)*k {
		copy(seen, g.Pushed[c*k:(c+1)*k])
	}
	var counted *control.State
	return func(st *control.State, due time.Time) time.Time {
		if st != counted {
			counted = st
			for i := range k {
				if n.Of(i) <= 0 || stood[i] {
					continue
				}
				count, at, ok := b.ctl.Pushed(st, n.Class, suffixes[i])
				switch {
				case !ok || count <= seen[i]:
					// nothing new (or a read sent before the take)
				default:
					layerDue := due.Add(-lags[i] + time.Duration(applied[i])*time.Microsecond)
					if layerDue.After(at.Add(control.CommitHorizon - pushMargin)) {
						applied[i] += count - seen[i]
					} else {
						stood[i] = true
					}
					seen[i] = count
				}
			}
		}
		moved := due
		for i := range k {
			if applied[i] == 0 {
				continue
			}
			if at := due.Add(-lags[i] + time.Duration(applied[i])*time.Microsecond); at.After(moved) {
				moved = at
			}
		}
		return moved
	}
}

// reset returns t set to fire after d, made if t is nil. (Since Go 1.23 a
// timer's channel holds nothing stale after Stop or Reset.)
func reset(t *time.Timer, d time.Duration) *time.Timer {
	if t == nil {
		return time.NewTimer(d)
	}
	t.Reset(d)
	return t
}
