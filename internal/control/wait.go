package control

import (
	"context"
	"errors"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// A caller waiting outside the script for a pause, or sleeping on a grant
// that a change may move, rechecks what the Limiter knows at least every
// WaitCheck.
const WaitCheck = time.Second

// ErrPastDeadline reports that a pause, or a grant a pause moved, ends
// after the caller's deadline.
var ErrPastDeadline = errors.New("past the caller's deadline")

// MaxWait returns how long the caller accepts to wait: until ctx's
// deadline when it has one, however far, so that the caller keeps its
// place in the queue; d, the Limiter's MaxWait, otherwise. deadline
// tells which.
func MaxWait(ctx context.Context, d time.Duration) (wait time.Duration, deadline bool) {
	if dl, ok := ctx.Deadline(); ok {
		return max(time.Until(dl), 0), true
	}
	return d, false
}

// Sleep waits for d, until ctx ends, with its error, or until wake (if
// not nil) receives, whichever comes first.
func Sleep(ctx context.Context, d time.Duration, wake <-chan struct{}) error {
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

// AwaitPause waits while e's bucket is paused, as far as the Limiter
// knows, when the script cannot queue the caller behind the pause: while
// it has no end, or ends after the longest wait the caller accepts (see
// MaxWait, with maxWait). It returns ErrPastDeadline, and how long the
// pause lasts, when the pause ends after ctx's deadline; a pause with no
// end may be resumed any time, so the caller keeps waiting for it until
// its deadline. It rechecks at least every WaitCheck: whatever it misses,
// it finds out then.
func (c *Controls) AwaitPause(ctx context.Context, e *Entry, maxWait time.Duration) (until string, _ error) {
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
		st := e.Load()
		now := time.Now()
		end, forever, paused := st.PausedAt(now)
		if !paused {
			return "", ctx.Err()
		}
		wait, hasDeadline := MaxWait(ctx, maxWait)
		switch {
		case hasDeadline && !forever && end.Sub(now) > wait:
			return "for " + end.Sub(now).Round(time.Millisecond).String(), ErrPastDeadline
		case !forever && end.Sub(now) <= wait:
			return "", ctx.Err() // the script queues it behind the pause
		}
		if done == nil {
			done = c.Wait(e)
		}
		next := WaitCheck
		if !forever {
			next = min(next, end.Sub(now)-wait+time.Millisecond)
		}
		t = reset(t, max(next, time.Millisecond))
		select {
		case <-st.Replaced():
			t.Stop()
		case <-t.C:
		case <-ctx.Done():
			return "", ctx.Err()
		}
	}
}

// SleepOn waits for the grant g of a take of n from the bucket of e, of
// layers layers, that falls due after g.Wait, or when the bucket's
// timeline says once it moved: every pause, resume, change of the Limit
// in force and give-back recorded since the take moves the grant, however
// many there were (see Anchor), and, with pushes, takes of higher priority
// classes push it back (see pushedBack). e may be nil: the grant falls due
// after g.Wait. When ctx ends first, or a pause moves the grant past ctx's
// deadline (ErrPastDeadline), it returns how far the grant had been moved
// later with the error, for the refund; when the grant falls due, how far
// it moved, later or earlier.
func (c *Controls) SleepOn(ctx context.Context, e *Entry, layers int, g store.Grant, n store.Cost, pushes bool) (time.Duration, error) {
	if g.Wait <= 0 {
		return 0, nil
	}
	replied := time.Now()
	due := replied.Add(g.Wait)
	if e == nil || len(g.Pos) != layers {
		return 0, Sleep(ctx, g.Wait, nil)
	}
	pushed := pushedBack(layers, g, n)
	if !pushes {
		pushed = func(*State) []float64 { return nil }
	}
	asked := func(i int) bool { return n.Of(i) > 0 } // a layer asked nothing holds nothing back
	pos := make([]float64, len(g.Pos))
	stale := false
	// when returns when the grant falls due under st, false while a pause
	// with no end holds it. A state read before the take knows less than
	// the take's reply: the grant stands as replied, and the record is
	// read again.
	when := func(st *State) (time.Time, bool) {
		if st.Ev() < g.Ev {
			if !stale {
				stale = true
				c.Announced(e.Key())
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
	// WaitRefresh meanwhile. A shorter one learns of a change from its
	// announcement alone.
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
		st := e.Load()
		at, ends := when(st)
		if ends && hasDeadline && at.After(deadline) {
			return max(at.Sub(due), 0), ErrPastDeadline
		}
		if ends && !time.Now().Before(at) {
			return at.Sub(due), nil
		}
		next := WaitCheck
		if ends {
			next = time.Until(at)
		}
		if done == nil && (!ends || next >= WaitRefresh) {
			done = c.Wait(e)
		}
		t = reset(t, next)
		select {
		case <-t.C:
		case <-st.Replaced():
			t.Stop()
		case <-ctx.Done():
			if at, ends := when(e.Load()); ends {
				return max(at.Sub(due), 0), ctx.Err()
			}
			return 0, ctx.Err()
		}
	}
}

// pushMargin widens CommitHorizon for the clocks: a caller counts a push
// as its own if its grant was due later than the horizon less pushMargin
// after it. Counting one the script did not make only sends the request a
// little later; missing one would send it early.
const pushMargin = 25 * time.Millisecond

// pushedBack returns how far takes of higher priority classes have pushed
// grant g, a take of n from a bucket of k layers, back since the take, in
// positions of each layer (see Anchor). A push counts for a layer whose
// part of the grant was due more than the commit horizon after it (see
// CommitHorizon); from the first one that does not, the grant stands, and
// later pushes pass it by. The pushes count from those the take's reply
// found (g.Pushed). It keeps what it has counted: call it with the states
// in the order read.
func pushedBack(k int, g store.Grant, n store.Cost) func(*State) []float64 {
	if len(g.Pos) != k {
		return func(*State) []float64 { return nil }
	}
	seen := make([]int64, k)      // the push counts counted from
	applied := make([]float64, k) // what they moved each layer
	stood := make([]bool, k)      // the layer's part stands: no push moves it now
	if c := n.Class; len(g.Pushed) >= (c+1)*k {
		copy(seen, g.Pushed[c*k:(c+1)*k])
	}
	var counted *State
	return func(st *State) []float64 {
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
			if layerDue.After(at.Add(CommitHorizon - pushMargin)) {
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
