// Package control keeps what a Limiter knows of its buckets' control
// records (internal/store's record operations): each bucket's override of
// its Limit and its pause, read when the bucket is first used, again in
// the background, on every announcement, and every WaitRefresh while
// callers sleep or wait on it.
package control

import (
	"math"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// A Limit is a bucket's rate, tokens a second, and burst.
type Limit = store.Limit

// An Anchor is a layer's timeline, as the bucket's scripts keep it (see
// store.Anchor).
type Anchor = store.Anchor

// A Record is a control record as the record's script replies it.
type Record = store.Record

// What changes how a bucket is taken, an operator's override of its Limit
// and its pause (a provider's Retry-After or an operator's), lives in Redis
// in the bucket's control record, beside its layers (internal/store). Every
// take reads it in the script, so the script never grants past a pause or
// at a Limit no longer in force, whatever the Limiter knows.
//
// Each Limiter also keeps what it read of the records of the buckets it
// uses, for what happens outside the script: its callers sleeping on
// grants taken before a pause or a change, its callers waiting for a pause
// with no end to be resumed, its local shares. It reads a bucket's record
// when it first uses the bucket, and again, in the background, once it is
// Refresh old. Every change is announced on the prefix's control
// channel, on which the Limiter listens (listener.go), and the Limiter reads
// again the record of a bucket announced. While callers sleep or wait on a
// bucket, the Limiter reads its record every WaitRefresh as well, so that a
// lost announcement costs them at most that.
const (
	Refresh     = time.Second
	WaitRefresh = 500 * time.Millisecond
	maxControls = 2048        // records kept
	readFor     = time.Second // bounds a read in the background

	Suffix  = store.ControlSuffix // after the bucket's key, the record's
	Channel = "control"           // after the prefix, the channel of announcements
)

// State is what a Limiter read of a bucket's control record. It
// never changes: a read replaces it, and closes replaced.
type State struct {
	override    Limit
	hasOverride bool

	// The bucket's pause, on the local clock; since is zero when the
	// record holds none, until is zero for a pause with no end.
	since, until time.Time
	sinceUS      int64  // since on the server's clock, µs, to compare with takes
	source       string // who set its end: "provider" or "operator"

	// ev counts the moves of the bucket's timeline when it was read;
	// anchors are its layers' (see Anchor), the first layer's first.
	ev      int64
	anchors []Anchor

	// pushes is how far takes of higher priority classes have pushed each
	// class's queue in each layer so far, in positions, class 0's layers
	// first;
	// pushAt, when the latest push was, on the local clock. nil and zero
	// on a bucket no class above 0 took from.
	pushes []int64
	pushAt time.Time

	learned []float64 // the rates the fleet learned, by layer, 0 for none (learned.go)

	readAt   time.Time // when the read that made it was sent; zero: never read
	serverAt int64     // the server's clock then, µs
	replaced chan struct{}
}

// CommitHorizon is how far ahead of now a grant stands, the take's
// commit: a take of a higher priority class pushes back only the grants
// of lower classes due later than that after it (see classes.lua), so that
// its announcement reaches their callers before they are due.
const CommitHorizon = 100 * time.Millisecond

// Pushed returns how far takes of higher classes had pushed the queue of
// class class in layer i when st was read, in positions, and when the
// latest push was; ok is false when st does not say.
func (st *State) Pushed(class, i, layers int) (pos int64, at time.Time, ok bool) {
	if class*layers+i >= len(st.pushes) {
		return 0, time.Time{}, false
	}
	return st.pushes[class*layers+i], st.pushAt, true
}

// Ev returns the count of the timeline's moves when st was read: a take
// that found a higher count ran after a move that st does not know.
func (st *State) Ev() int64 { return st.ev }

// Anchor returns layer i's anchor when st was read.
func (st *State) Anchor(i int) Anchor {
	if i < len(st.anchors) {
		return st.anchors[i]
	}
	return Anchor{}
}

// Due returns when a grant at positions pos (a layer each, the first
// layer's first) falls due under st, µs on the server's clock: when the
// last of the layers asked falls due. It returns false while a pause with
// no end holds it: one due once the pause had begun.
func (st *State) Due(pos []float64, asked func(i int) bool) (int64, bool) {
	due := int64(math.MinInt64)
	for i, p := range pos {
		if asked(i) {
			due = max(due, st.Anchor(i).Due(p))
		}
	}
	if due == math.MinInt64 {
		return st.serverAt, true // nothing asked
	}
	if !st.since.IsZero() && st.until.IsZero() && due >= st.sinceUS {
		return 0, false
	}
	return due, true
}

// Local returns the instant us, on the server's clock, on the local one.
func (st *State) Local(us int64) time.Time {
	// A record's times are the script's, but Redis holds what anyone with
	// access wrote: bound them to a century either way, within which a
	// Duration neither overflows nor wraps.
	const century = int64(100 * 365 * 24 * time.Hour / time.Microsecond)
	us = max(min(us, st.serverAt+century), st.serverAt-century)
	return st.readAt.Add(time.Duration(us-st.serverAt) * time.Microsecond)
}

// PausedAt tells whether the pause is in force at t, and when it ends.
func (st *State) PausedAt(t time.Time) (end time.Time, forever, paused bool) {
	if st.since.IsZero() {
		return time.Time{}, false, false
	}
	if st.until.IsZero() {
		return time.Time{}, true, true
	}
	return st.until, false, t.Before(st.until)
}

// Override returns the Limit an operator set in place of the first
// layer's, if any.
func (st *State) Override() (Limit, bool) { return st.override, st.hasOverride }

// ReadAt returns when the read that made st was sent; zero if never read.
func (st *State) ReadAt() time.Time { return st.readAt }

// Replaced returns a channel closed once a newer read replaces st.
func (st *State) Replaced() <-chan struct{} { return st.replaced }

// stateOf turns the record r into a Limiter's state, its times moved to
// the local clock as of sent, when the read was sent.
func stateOf(r Record, sent time.Time) *State {
	st := &State{replaced: make(chan struct{}), readAt: sent, serverAt: r.Now, source: r.Source,
		ev: r.Ev, anchors: r.Anchors, pushes: r.Pushes, learned: r.Learned}
	if r.Override != nil {
		st.override, st.hasOverride = *r.Override, true
	}
	local := st.Local
	if r.PushAt != 0 {
		st.pushAt = local(r.PushAt)
	}
	if r.Since != 0 {
		st.since, st.sinceUS = local(r.Since), r.Since
		if r.Until >= 0 {
			st.until = local(r.Until)
		}
	}
	return st
}

// Op runs the record op op (limit, clear, hold, resume or status) of the
// bucket whose first key is key, and returns the record it replies. A
// pause (hold) and a resume move the queues of every layer the Limiters
// that use the bucket recorded. An op that changes the record is
// announced by the script; this Limiter reads its entry again at once.
