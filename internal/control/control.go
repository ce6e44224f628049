// Package control keeps what a Limiter knows of its buckets' control
// records (internal/store's record operations): each bucket's override of
// its Limit and its pause, read when the bucket is first used, again in
// the background, on every announcement, and every WaitRefresh while
// callers sleep or wait on it.
package control

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redisx"
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

// Entry is a Limiter's knowledge of one bucket's control record.
type Entry struct {
	key   string // the bucket's first key
	name  string // the bucket's name
	state atomic.Pointer[State]
	read  atomic.Int64 // when it was last read or tried, unix ns
	used  atomic.Int64 // when it was last used, unix ns

	passed Limit  // the first layer's Limit as the Limiter's callers pass it
	layers string // the further layers' suffixes

	mu      sync.Mutex
	reading chan struct{} // closed when the read in flight ends; nil when none
	readErr error         // how the read last ended, for the callers that waited for it
	stale   bool          // read again once the read in flight ends
	waiters int           // callers sleeping or waiting on the bucket
}

// Override returns the Limit an operator set in place of the first
// layer's, if any.
func (st *State) Override() (Limit, bool) { return st.override, st.hasOverride }

// ReadAt returns when the read that made st was sent; zero if never read.
func (st *State) ReadAt() time.Time { return st.readAt }

// Replaced returns a channel closed once a newer read replaces st.
func (st *State) Replaced() <-chan struct{} { return st.replaced }

// Rate returns the first layer's rate in force under st.
func (e *Entry) Rate(st *State) float64 {
	if st.hasOverride {
		return st.override.Rate
	}
	return e.passed.Rate
}

// Reading reports whether a read of e's record is in flight.
func (e *Entry) Reading() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.reading != nil
}

// Load returns what was read last.
func (e *Entry) Load() *State { return e.state.Load() }

// Controls are a Limiter's control entries.
type Controls struct {
	store  *store.Store // runs the records' operations
	id     string       // this Limiter's, among a bucket's users
	events *redisx.Listener

	mu sync.RWMutex
	m  map[string]*Entry

	failed func(e *Entry, err error) // a read in the background failed; nil: nothing to tell
}

// OnFailure has f told of every read of a record in the background that
// fails: that is how a Limiter whose callers only sleep on their grants
// learns of an outage. Call it before the first use.
func (c *Controls) OnFailure(f func(e *Entry, err error)) { c.failed = f }

// Key returns the bucket's first key.
func (e *Entry) Key() string { return e.key }

// Name returns the bucket's name.
func (e *Entry) Name() string { return e.name }

// New returns the Controls that run the record ops on s, whose channel
// events listens on.
func New(s *store.Store, events *redisx.Listener) *Controls {
	host, _ := os.Hostname()
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &Controls{
		store:  s,
		id:     fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:])),
		events: events,
	}
}

// Entry returns the control entry of the bucket called name whose
// layers' keys are keys, the first the bucket's own, and whose callers pass passed for the
// first layer, reading the record when it is not
// known well enough to grant by: when the Limiter has none, or does not
// listen to announcements and read it more than Refresh ago. Only
// one read of a record is in flight at once: callers that need it wait
// for it. shared tells whether Redis is healthy; while it is not, the
// entry is used as last read, and read when Redis is back. The error is
// that of a read that failed.
func (c *Controls) Entry(ctx context.Context, name string, keys []string, passed Limit, shared bool) (_ *Entry, sent bool, _ error) {
	now := time.Now().UnixNano()
	listening := c.events.Use()
	key := keys[0]
	c.mu.RLock()
	e := c.m[key]
	c.mu.RUnlock()
	if e == nil {
		e = c.add(name, keys, passed)
		listening = false
	}
	redisx.Touch(&e.used, now)
	readAt := e.read.Load()
	switch {
	case !shared:
		return e, false, nil
	case e.Load().readAt.IsZero():
		// Never read: wait for the read, this caller's or the one in
		// flight, and share its outcome.
	case now-readAt < int64(Refresh):
		return e, false, nil
	case listening && readAt != 0:
		// Read again in the background, once: what was read stands
		// meanwhile.
		if e.read.CompareAndSwap(readAt, now) {
			go c.refresh(e)
		}
		return e, false, nil
	}
	sent, err := c.ReadNow(ctx, e)
	return e, sent, err
}

// add returns the entry of the bucket of keys, made and kept if there is
// none, making room when maxControls are kept.
func (c *Controls) add(name string, keys []string, passed Limit) *Entry {
	c.mu.Lock()
	defer c.mu.Unlock()
	key := keys[0]
	if e := c.m[key]; e != nil {
		return e
	}
	if c.m == nil {
		c.m = make(map[string]*Entry)
	}
	if len(c.m) >= maxControls {
		c.evict()
	}
	e := &Entry{key: key, name: name, passed: passed}
	e.state.Store(&State{replaced: make(chan struct{})})
	var layers []string
	for _, k := range keys[1:] {
		layers = append(layers, strings.TrimPrefix(k, key))
	}
	e.layers = strings.Join(layers, " ")
	c.m[key] = e
	return e
}

// evict forgets the entries unused for the listener's idle time, or, when all were
// used since, an arbitrary tenth of them; never one that callers sleep or
// wait on. It runs with c.mu held.
func (c *Controls) evict() {
	idle := time.Now().Add(-c.events.Idle()).UnixNano()
	for k, e := range c.m {
		if e.used.Load() < idle && !e.busy() {
			delete(c.m, k)
		}
	}
	for k, e := range c.m {
		if len(c.m) < maxControls*9/10 {
			break
		}
		if !e.busy() {
			delete(c.m, k)
		}
	}
}

func (e *Entry) busy() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.waiters > 0
}

// Lookup returns the entry of the bucket whose first key is key, or nil.
func (c *Controls) Lookup(key string) *Entry {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.m[key]
}

// Wait registers a caller that sleeps or waits on e, and returns the func
// that ends it. While any does, the Limiter listens, and reads e's record
// every WaitRefresh: an announcement lost costs them that at most, and
// never a stall.
func (c *Controls) Wait(e *Entry) (done func()) {
	release := c.events.Hold()
	e.mu.Lock()
	e.waiters++
	first := e.waiters == 1
	e.mu.Unlock()
	if first {
		go c.watch(e)
	}
	return func() {
		e.mu.Lock()
		e.waiters--
		e.mu.Unlock()
		release()
	}
}

// watch reads e's record every WaitRefresh while callers wait on it, and
// at once if it was read longer ago than the Limiter refreshes records.
func (c *Controls) watch(e *Entry) {
	if time.Since(time.Unix(0, e.read.Load())) >= Refresh {
		c.refresh(e)
	}
	t := time.NewTicker(WaitRefresh)
	defer t.Stop()
	for range t.C {
		if !e.busy() {
			return
		}
		if time.Since(time.Unix(0, e.read.Load())) >= WaitRefresh/2 {
			c.refresh(e)
		}
	}
}

// ReadNow reads e's record unless a read is in flight, in which case it
// waits for that one, and returns its error. sent tells whether it sent a
// read of its own.
func (c *Controls) ReadNow(ctx context.Context, e *Entry) (sent bool, _ error) {
	e.mu.Lock()
	if done := e.reading; done != nil {
		e.mu.Unlock()
		select {
		case <-done:
			e.mu.Lock()
			defer e.mu.Unlock()
			return false, e.readErr
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
	done := make(chan struct{})
	e.reading = done
	e.mu.Unlock()
	err := c.read(ctx, e)
	e.mu.Lock()
	e.reading, e.readErr = nil, err
	again := e.stale
	e.stale = false
	e.mu.Unlock()
	close(done)
	if again {
		go c.refresh(e)
	}
	return true, err
}

// refresh reads e's record in the background. When a read is in flight,
// which may have been sent before the change that calls for this one, it
// has the record read again once that read ends.
func (c *Controls) refresh(e *Entry) {
	e.mu.Lock()
	if e.reading != nil {
		e.stale = true
		e.mu.Unlock()
		return
	}
	e.mu.Unlock()
	ctx, cancel := context.WithTimeout(redisx.Untraced(), readFor)
	defer cancel()
	if _, err := c.ReadNow(ctx, e); err != nil && c.failed != nil {
		c.failed(e, err)
	}
}

// read reads e's record, records the Limit the Limiter's callers pass
// and the Limiter among the bucket's users, and replaces e's state with
// what it read. A failed read leaves the state as it was, or no control at
// all if there was none, and is tried again Refresh later.
func (c *Controls) read(ctx context.Context, e *Entry) error {
	e.read.Store(time.Now().UnixNano())
	sent := time.Now()
	keys := []string{e.key}
	for suffix := range strings.FieldsSeq(e.layers) {
		keys = append(keys, e.key+suffix)
	}
	rec, err := c.store.Record(ctx, keys, store.RecordOp{Op: "read", ID: c.id, Limit: e.passed, Layers: e.layers})
	if err != nil {
		return err
	}
	close(e.state.Swap(stateOf(rec, sent)).replaced)
	return nil
}

// Forget resets what the Limiter read of every record, so that the next
// use reads again before it grants: what was read is no longer kept up to
// date once the Limiter stops listening.
func (c *Controls) Forget() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, e := range c.m {
		e.read.Store(0)
	}
}

// Resync makes up for the announcements the Limiter may have missed before
// it listened: the records callers wait on are read again at once, and
// the others used lately in the background at once, the rest at their next
// use. (The script enforces
// every record itself; what a Limiter knows serves its sleepers.)
func (c *Controls) Resync() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	recent := time.Now().Add(-Refresh).UnixNano()
	for _, e := range c.m {
		if e.busy() || e.used.Load() > recent {
			go c.refresh(e)
		} else {
			e.read.Store(1) // long ago, but read
		}
	}
}

// Announced reads again the record of the bucket whose first key is key,
// announced on the control channel.
func (c *Controls) Announced(key string) {
	if e := c.Lookup(key); e != nil {
		go c.refresh(e)
	}
}

// GaveBack takes in an announcement of the give-backs of the bucket whose
// first key is key: the timeline's count after them, and the layers'
// anchors, as a record read replies them. When the entry's state is the
// one just before, the anchors replace its own, so that its callers asleep
// in the queue go sooner without a read; when it missed a move before,
// the record is read again.
func (c *Controls) GaveBack(key, payload string) {
	e := c.Lookup(key)
	if e == nil {
		return
	}
	count, rest, _ := strings.Cut(payload, " ")
	ev, err := strconv.ParseInt(count, 10, 64)
	anchors, err2 := store.ParseAnchors(rest)
	if err != nil || err2 != nil {
		return
	}
	for {
		st := e.state.Load()
		switch {
		case st.readAt.IsZero() || ev <= st.ev:
			return // never read, or told already
		case ev > st.ev+1:
			go c.refresh(e)
			return
		}
		next := *st
		next.ev, next.anchors, next.replaced = ev, anchors, make(chan struct{})
		if e.state.CompareAndSwap(st, &next) {
			close(st.replaced)
			return
		}
	}
}

// Pushed takes in an announcement of the pushes of the bucket whose first
// key is key: when, on the server's clock, then each class's push counts
// in each layer, "<class>:<suffix>=<µs>" separated by spaces. The state
// they raise replaces the entry's, so that its callers asleep in the
// lower classes go later without a read.
func (c *Controls) Pushed(key, pushes string) {
	e := c.Lookup(key)
	if e == nil {
		return
	}
	when, rest, _ := strings.Cut(pushes, " ")
	at, err := strconv.ParseInt(when, 10, 64)
	if err != nil {
		return
	}
	suffixes := append([]string{""}, strings.Fields(e.layers)...)
	k := len(suffixes)
	told := map[int]int64{} // by class*k + layer
	for part := range strings.FieldsSeq(rest) {
		cs, v, ok := strings.Cut(part, "=")
		class, suffix, ok2 := strings.Cut(cs, ":")
		cl, err1 := strconv.Atoi(class)
		n, err2 := strconv.ParseInt(v, 10, 64)
		if !ok || !ok2 || err1 != nil || err2 != nil || cl < 0 || cl > 7 {
			return
		}
		for i, s := range suffixes {
			if s == suffix {
				told[cl*k+i] = n
			}
		}
	}
	for {
		st := e.state.Load()
		if st.readAt.IsZero() {
			return // never read: its first read tells
		}
		size := len(st.pushes)
		for i := range told {
			size = max(size, (i/k+1)*k)
		}
		pushes := make([]int64, size)
		copy(pushes, st.pushes)
		raised := false
		for i, n := range told {
			if n > pushes[i] {
				pushes[i], raised = n, true
			}
		}
		if !raised {
			return
		}
		next := *st
		next.pushes, next.replaced = pushes, make(chan struct{})
		next.pushAt = st.readAt.Add(time.Duration(at-st.serverAt) * time.Microsecond)
		if e.state.CompareAndSwap(st, &next) {
			close(st.replaced)
			return
		}
	}
}

// stateOf turns the record r into a Limiter's state, its times moved to
// the local clock as of sent, when the read was sent.
func stateOf(r Record, sent time.Time) *State {
	st := &State{replaced: make(chan struct{}), readAt: sent, serverAt: r.Now, source: r.Source,
		ev: r.Ev, anchors: r.Anchors, pushes: r.Pushes}
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
func (c *Controls) Op(ctx context.Context, key string, op store.RecordOp) (Record, error) {
	keys := []string{key}
	if op.Op == "hold" || op.Op == "resume" {
		layers, err := c.layersOf(ctx, key)
		if err != nil {
			return Record{}, err
		}
		for _, suffix := range layers {
			keys = append(keys, key+suffix)
		}
	}
	r, err := c.store.Record(ctx, keys, op)
	if err != nil {
		return Record{}, err
	}
	if op.Op != "status" {
		if e := c.Lookup(key); e != nil {
			_, _ = c.ReadNow(ctx, e)
		}
	}
	return r, nil
}

// layersOf returns the suffixes of the further layers' keys of the bucket
// whose first key is key, as the Limiters that use it last recorded them.
func (c *Controls) layersOf(ctx context.Context, key string) ([]string, error) {
	h, ok := c.store.Client().(interface {
		HGet(ctx context.Context, key, field string) *redis.StringCmd
	})
	if !ok {
		return nil, nil
	}
	layers, err := h.HGet(ctx, key+Suffix, "layers").Result()
	if err == redis.Nil {
		err = nil
	}
	return strings.Fields(layers), err
}
