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

// maxWait returns how long the caller accepts to wait: until ctx's
// deadline when it has one, however far, so that the caller keeps its
// place in the queue; MaxWait otherwise. deadline tells which.
func (l *Limiter) maxWait(ctx context.Context) (wait time.Duration, deadline bool) {
	if d, ok := ctx.Deadline(); ok {
		return max(time.Until(d), 0), true
	}
	return l.cfg.maxWait, false
}

// sleep waits for d or until ctx ends, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	return sleepOr(ctx, d, nil)
}

// sleepOr is sleep that also ends, without an error, when wake (if not
// nil) receives.
func sleepOr(ctx context.Context, d time.Duration, wake <-chan struct{}) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-wake:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

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
// g.Wait, or when the bucket's timeline says once it moved: every pause,
// resume, change of the Limit in force and give-back recorded since the
// take moves the grant, however many there were (see control.Anchor),
// and takes of higher priority classes push it back (see pushedBack).
// When ctx ends first, or a pause moves the grant past ctx's deadline, it
// returns how far the grant had been moved later with the error, for the
// refund.
func (l *Limiter) sleepOn(ctx context.Context, b bucket, g store.Grant, n store.Cost) (time.Duration, error) {
	if g.Wait <= 0 {
		return 0, nil
	}
	replied := time.Now()
	due := replied.Add(g.Wait)
	if b.ctl == nil || len(g.Pos) != len(b.Keys) {
		return 0, sleep(ctx, g.Wait)
	}
	pushed := pushedBack(b, g, n)
	if l.noPushes {
		pushed = func(*control.State) []float64 { return nil }
	}
	asked := func(i int) bool { return n.Of(i) > 0 } // a layer asked nothing holds nothing back
	pos := make([]float64, len(g.Pos))
	stale := false
	// when returns when the grant falls due under st, false while a pause
	// with no end holds it. A state read before the take knows less than
	// the take's reply: the grant stands as replied, and the record is
	// read again.
	when := func(st *control.State) (time.Time, bool) {
		if st.Ev() < g.Ev {
			if !stale {
				stale = true
				l.controls.Announced(b.ctl.Key())
			}
			return due, true
		}
		by := pushed(st)
		for i := range pos {
			pos[i] = g.Pos[i]
			if i < len(by) {
				pos[i] += by[i]
			}
		}
		at, ends := st.Due(pos, asked)
		// On the local clock as the take's reply tells it: the server's
		// instant g.Now is when the reply came.
		return replied.Add(time.Duration(at-g.Now) * time.Microsecond), ends
	}
	// A sleep long enough for a read of the record to matter, or one that
	// a pause holds, registers: the Limiter reads the record every
	// control.WaitRefresh meanwhile. A shorter one learns of a change from
	// its announcement alone.
	var done func()
	defer func() {
		if done != nil {
			done()
		}
	}()
	deadline, hasDeadline := ctx.Deadline()
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
			return max(at.Sub(due), 0), ErrWouldExceedDeadline
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
				return max(at.Sub(due), 0), ctx.Err()
			}
			return 0, ctx.Err()
		}
	}
}

// pushMargin widens control.CommitHorizon for the clocks: a caller
// counts a push as its own if its grant was due later than the horizon
// less pushMargin after it. Counting one the script did not make only
// sends the request a little later; missing one would send it early.
const pushMargin = 25 * time.Millisecond

// pushedBack returns how far takes of higher priority classes have pushed
// grant g, a take of n from b, back since the take, in positions of each
// layer (see control.Anchor). A push counts for a layer whose part of the
// grant was due more than the commit horizon after it (see
// control.CommitHorizon); from the first one that does not, the grant
// stands, and later pushes pass it by. The pushes count from those the
// take's reply found (g.Pushed). It keeps what it has counted: call it
// with the states in the order read.
func pushedBack(b bucket, g store.Grant, n store.Cost) func(*control.State) []float64 {
	k := len(b.Keys)
	if len(g.Pos) != k {
		return func(*control.State) []float64 { return nil }
	}
	seen := make([]int64, k)      // the push counts counted from
	applied := make([]float64, k) // what they moved each layer
	stood := make([]bool, k)      // the layer's part stands: no push moves it now
	if c := n.Class; len(g.Pushed) >= (c+1)*k {
		copy(seen, g.Pushed[c*k:(c+1)*k])
	}
	var counted *control.State
	return func(st *control.State) []float64 {
		if st == counted {
			return applied
		}
		counted = st
		for i := range k {
			if n.Of(i) <= 0 || stood[i] {
				continue
			}
			count, at, ok := st.Pushed(n.Class, i, k)
			if !ok || count <= seen[i] {
				continue // nothing new (or a read sent before the take)
			}
			layerDue := st.Local(st.Anchor(i).Due(g.Pos[i] + applied[i]))
			if layerDue.After(at.Add(control.CommitHorizon - pushMargin)) {
				applied[i] += float64(count - seen[i])
			} else {
				stood[i] = true
			}
			seen[i] = count
		}
		return applied
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
