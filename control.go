package quota

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
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
	e, sent, err := l.controls.Entry(ctx, b.Keys, control.Limit(b.Lims[0]), l.mode() == ModeShared)
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

// sleepOn waits for a grant of bucket b that falls due after g.Wait, and
// later by as much as a pause or a change of the Limit in force, recorded
// since the take, moved the queue it was granted in. When ctx ends first,
// or a pause moves the grant past ctx's deadline, it returns how far the
// grant had been moved with the error, for the refund.
func (l *Limiter) sleepOn(ctx context.Context, b bucket, g store.Grant) (time.Duration, error) {
	if g.Wait <= 0 {
		return 0, nil
	}
	due := time.Now().Add(g.Wait)
	if b.ctl == nil {
		return 0, sleep(ctx, g.Wait)
	}
	takenAt := g.TakenAt(b.Bucket)
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
		at, ends := st.Hold(due, takenAt, control.Pause(g.Pause))
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
				return at.Sub(due), ctx.Err()
			}
			return 0, ctx.Err()
		}
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
