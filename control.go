package quota

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redisx"
)

// What changes how a bucket is taken, an operator's override of its Limit
// and its pause (a provider's Retry-After or an operator's), lives in Redis
// in the bucket's control record, beside its layers (script.lua). Every
// take reads it in the script, so the script never grants past a pause or
// at a Limit no longer in force, whatever the Limiter knows.
//
// Each Limiter also keeps what it read of the records of the buckets it
// uses, for what happens outside the script: its callers sleeping on
// grants taken before a pause or a change, its callers waiting for a pause
// with no end to be resumed, its local shares. It reads a bucket's record
// when it first uses the bucket, and again, in the background, once it is
// controlRefresh old. Every change is announced on the prefix's control
// channel, on which the Limiter listens (listener.go), and the Limiter reads
// again the record of a bucket announced. While callers sleep or wait on a
// bucket, the Limiter reads its record every waitRefresh as well, so that a
// lost announcement costs them at most that.
const (
	controlRefresh = time.Second
	waitRefresh    = 500 * time.Millisecond
	maxControls    = 2048        // records kept
	controlReadFor = time.Second // bounds a read in the background

	controlSuffix  = ":ctl"
	controlChannel = "control" // after the prefix
)

// controlIdle is how long a Limiter stays unused before it stops
// listening; a variable for the tests.
var controlIdle = time.Minute

// controlState is what a Limiter read of a bucket's control record. It
// never changes: a read replaces it, and closes replaced.
type controlState struct {
	override    Limit
	hasOverride bool

	// The bucket's pause, on the local clock; since is zero when the
	// record holds none, until is zero for a pause with no end.
	since, until time.Time
	sinceUS      int64  // since on the server's clock, µs, to compare with takes
	source       string // who set its end: "provider" or "operator"

	// The latest change of the Limit in force: when, on the server's
	// clock; the instant the queue was rescaled from, on the local clock;
	// the rate before; and the pause then in force, whose later changes
	// move the pivot with the queue. changedUS is zero when it never
	// changed.
	changedUS int64
	pivot     time.Time
	prev      float64
	during    pauseFound

	readAt   time.Time // when the read that made it was sent; zero: never read
	replaced chan struct{}
}

// pausedAt tells whether the pause is in force at t, and when it ends.
func (st *controlState) pausedAt(t time.Time) (end time.Time, forever, paused bool) {
	if st.since.IsZero() {
		return time.Time{}, false, false
	}
	if st.until.IsZero() {
		return time.Time{}, true, true
	}
	return st.until, false, t.Before(st.until)
}

// hold returns when a grant due at due, whose take found the pause found,
// falls due once the pause in force has moved it, as the script moved the
// queue: a grant due t after the pause began falls due t after it ends,
// and one taken during the pause moves by what the pause changed since.
// It returns false while the pause has no end.
func (st *controlState) hold(due time.Time, takenAt int64, found pauseFound) (time.Time, bool) {
	if st.since.IsZero() {
		return due, true
	}
	var moved time.Duration // by the pause, when the take ran
	switch {
	case found.since == st.sinceUS:
		moved = time.Duration(found.shifted) * time.Microsecond
	case takenAt >= st.sinceUS || !due.After(st.since):
		return due, true // taken after the pause, or due before it began
	}
	if st.until.IsZero() {
		return time.Time{}, false
	}
	return due.Add(st.until.Sub(st.since) - moved), true
}

// rescale returns when a grant taken at takenAt (server µs) and due at due,
// as the pause in force has moved it (see hold), falls due once the latest
// change of the Limit in force, to rate to, has moved it, as the script
// moved the queue: a grant due t after the pivot falls due t x prev / to
// after it. A pause in force at the change that has changed since moved
// the pivot with the queue.
func (st *controlState) rescale(due time.Time, takenAt int64, to float64) time.Time {
	if st.changedUS == 0 || takenAt >= st.changedUS || !(st.prev > 0) || st.prev == to {
		return due
	}
	pivot := st.pivot
	if st.during.since != 0 && st.during.since == st.sinceUS && !st.until.IsZero() {
		pivot = pivot.Add(st.until.Sub(st.since) - time.Duration(st.during.shifted)*time.Microsecond)
	}
	if !due.After(pivot) {
		return due
	}
	return pivot.Add(time.Duration(float64(due.Sub(pivot)) * st.prev / to))
}

// controlEntry is a Limiter's knowledge of one bucket's control record.
type controlEntry struct {
	key   string // the bucket's first key
	state atomic.Pointer[controlState]
	read  atomic.Int64 // when it was last read or tried, unix ns
	used  atomic.Int64 // when it was last used, unix ns

	passed Limit  // the first layer's Limit as the Limiter's callers pass it
	seen   string // passed, "<rate> <burst>"
	layers string // the further layers' suffixes

	mu      sync.Mutex
	reading chan struct{} // closed when the read in flight ends; nil when none
	readErr error         // how the read last ended, for the callers that waited for it
	stale   bool          // read again once the read in flight ends
	waiters int           // callers sleeping or waiting on the bucket
}

// rate returns the first layer's rate in force under st.
func (e *controlEntry) rate(st *controlState) float64 {
	if st.hasOverride {
		return st.override.Rate
	}
	return e.passed.Rate
}

func (e *controlEntry) load() *controlState { return e.state.Load() }

// controls are a Limiter's control entries.
type controls struct {
	script *redisx.Script // the bucket script's
	prefix string
	id     string // this Limiter's, among a bucket's users
	events *redisx.Listener

	mu sync.RWMutex
	m  map[string]*controlEntry
}

func newControls(s *redisx.Script, cfg config, events *redisx.Listener) *controls {
	host, _ := os.Hostname()
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &controls{
		script: s,
		prefix: cfg.prefix,
		id:     fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:])),
		events: events,
	}
}

// entry returns the control entry of b, reading the record when it is not
// known well enough to grant by: when the Limiter has none, or does not
// listen to announcements and read it more than controlRefresh ago. Only
// one read of a record is in flight at once: callers that need it wait
// for it. shared tells whether Redis is healthy; while it is not, the
// entry is used as last read, and read when Redis is back. The error is
// that of a read that failed.
func (c *controls) entry(ctx context.Context, b bucket, shared bool) (_ *controlEntry, sent bool, _ error) {
	now := time.Now().UnixNano()
	listening := c.events.Use()
	key := b.keys[0]
	c.mu.RLock()
	e := c.m[key]
	c.mu.RUnlock()
	if e == nil {
		e = c.add(b)
		listening = false
	}
	redisx.Touch(&e.used, now)
	readAt := e.read.Load()
	switch {
	case !shared:
		return e, false, nil
	case e.load().readAt.IsZero():
		// Never read: wait for the read, this caller's or the one in
		// flight, and share its outcome.
	case now-readAt < int64(controlRefresh):
		return e, false, nil
	case listening && readAt != 0:
		// Read again in the background, once: what was read stands
		// meanwhile.
		if e.read.CompareAndSwap(readAt, now) {
			go c.refresh(e)
		}
		return e, false, nil
	}
	sent, err := c.readNow(ctx, e)
	return e, sent, err
}

// add returns the entry of b, made and kept if there is none, making room
// when maxControls are kept.
func (c *controls) add(b bucket) *controlEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	key := b.keys[0]
	if e := c.m[key]; e != nil {
		return e
	}
	if c.m == nil {
		c.m = make(map[string]*controlEntry)
	}
	if len(c.m) >= maxControls {
		c.evict()
	}
	e := &controlEntry{key: key, passed: b.lims[0], seen: redisx.Num(b.lims[0].Rate) + " " + redisx.Num(b.lims[0].Burst)}
	e.state.Store(&controlState{replaced: make(chan struct{})})
	var layers []string
	for _, k := range b.keys[1:] {
		layers = append(layers, strings.TrimPrefix(k, key))
	}
	e.layers = strings.Join(layers, " ")
	c.m[key] = e
	return e
}

// evict forgets the entries unused for controlIdle, or, when all were
// used since, an arbitrary tenth of them; never one that callers sleep or
// wait on. It runs with c.mu held.
func (c *controls) evict() {
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

func (e *controlEntry) busy() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.waiters > 0
}

// lookup returns the entry of the bucket whose first key is key, or nil.
func (c *controls) lookup(key string) *controlEntry {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.m[key]
}

// wait registers a caller that sleeps or waits on e, and returns the func
// that ends it. While any does, the Limiter listens, and reads e's record
// every waitRefresh: an announcement lost costs them that at most, and
// never a stall.
func (c *controls) wait(e *controlEntry) (done func()) {
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

// watch reads e's record every waitRefresh while callers wait on it, and
// at once if it was read longer ago than the Limiter refreshes records.
func (c *controls) watch(e *controlEntry) {
	if time.Since(time.Unix(0, e.read.Load())) >= controlRefresh {
		c.refresh(e)
	}
	t := time.NewTicker(waitRefresh)
	defer t.Stop()
	for range t.C {
		if !e.busy() {
			return
		}
		if time.Since(time.Unix(0, e.read.Load())) >= waitRefresh/2 {
			c.refresh(e)
		}
	}
}

// readNow reads e's record unless a read is in flight, in which case it
// waits for that one, and returns its error. sent tells whether it sent a
// read of its own.
func (c *controls) readNow(ctx context.Context, e *controlEntry) (sent bool, _ error) {
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
func (c *controls) refresh(e *controlEntry) {
	e.mu.Lock()
	if e.reading != nil {
		e.stale = true
		e.mu.Unlock()
		return
	}
	e.mu.Unlock()
	ctx, cancel := context.WithTimeout(redisx.Untraced(), controlReadFor)
	defer cancel()
	_, _ = c.readNow(ctx, e)
}

// read reads e's record, records the Limit the Limiter's callers pass
// and the Limiter among the bucket's users, and replaces e's state with
// what it read. A failed read leaves the state as it was, or no control at
// all if there was none, and is tried again controlRefresh later.
func (c *controls) read(ctx context.Context, e *controlEntry) error {
	e.read.Store(time.Now().UnixNano())
	sent := time.Now()
	keys := []string{e.key}
	for suffix := range strings.FieldsSeq(e.layers) {
		keys = append(keys, e.key+suffix)
	}
	keys = append(keys, e.key+controlSuffix)
	cmd, _ := c.script.Run(ctx, keys, "read", e.seen, e.layers, "", c.id)
	rec, err := parseControl(cmd)
	if err != nil {
		return err
	}
	close(e.state.Swap(rec.state(sent)).replaced)
	return nil
}

// forget resets what the Limiter read of every record, so that the next
// use reads again before it grants: what was read is no longer kept up to
// date once the Limiter stops listening.
func (c *controls) forget() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	for _, e := range c.m {
		e.read.Store(0)
	}
}

// resync makes up for the announcements the Limiter may have missed before
// it listened: the records callers wait on are read again at once, and
// the others used lately in the background at once, the rest at their next
// use. (The script enforces
// every record itself; what a Limiter knows serves its sleepers.)
func (c *controls) resync() {
	c.mu.RLock()
	defer c.mu.RUnlock()
	recent := time.Now().Add(-controlRefresh).UnixNano()
	for _, e := range c.m {
		if e.busy() || e.used.Load() > recent {
			go c.refresh(e)
		} else {
			e.read.Store(1) // long ago, but read
		}
	}
}

// announced reads again the record of the bucket whose first key is key,
// announced on the control channel.
func (c *controls) announced(key string) {
	if e := c.lookup(key); e != nil {
		go c.refresh(e)
	}
}

// record is a control record as the script replies it.
type record struct {
	now          int64 // µs, the server's clock
	override     *Limit
	since, until int64 // µs; until is -1 for a pause with no end
	seen         *Limit
	users        int    // status only
	tat          int64  // status only; 0 when absent
	changed      int64  // µs; 0 when the Limit in force never changed
	source       string // who set the pause's end
	pivot        int64  // µs, whence the change rescaled the queue
	prev         float64
	during       pauseFound // the pause in force at the change
}

// parseControl reads the reply of a record operation.
func parseControl(cmd *redis.Cmd) (record, error) {
	vals, err := cmd.StringSlice()
	if err != nil {
		return record{}, err
	}
	if len(vals) != 13 {
		return record{}, fmt.Errorf("%w: a control reply of %d fields", ErrScript, len(vals))
	}
	var r record
	var errs []error
	integer := func(s string) int64 {
		if s == "" {
			return 0
		}
		v, err := strconv.ParseInt(s, 10, 64)
		errs = append(errs, err)
		return v
	}
	limit := func(rate, burst string) *Limit {
		if rate == "" || burst == "" {
			return nil
		}
		r, err1 := strconv.ParseFloat(rate, 64)
		b, err2 := strconv.ParseFloat(burst, 64)
		lim, err3 := Limit{Rate: r, Burst: b}.resolve()
		errs = append(errs, err1, err2, err3)
		return &lim
	}
	r.now = integer(vals[0])
	r.override = limit(vals[1], vals[2])
	r.since = integer(vals[3])
	if vals[4] == "forever" {
		r.until = -1
	} else {
		r.until = integer(vals[4])
	}
	if rate, burst, ok := strings.Cut(vals[5], " "); ok {
		r.seen = limit(rate, burst)
	}
	r.users = int(integer(vals[6]))
	if vals[7] != "" {
		tat, err := strconv.ParseFloat(vals[7], 64)
		r.tat = int64(tat)
		errs = append(errs, err)
	}
	r.changed = integer(vals[8])
	r.source = vals[9]
	r.pivot = integer(vals[10])
	if vals[11] != "" {
		prev, err := strconv.ParseFloat(vals[11], 64)
		r.prev = prev
		errs = append(errs, err)
	}
	if since, shifted, ok := strings.Cut(vals[12], " "); ok {
		r.during = pauseFound{since: integer(since), shifted: integer(shifted)}
	}
	if err := errors.Join(errs...); err != nil {
		return record{}, fmt.Errorf("%w: an unreadable control record: %w", ErrScript, err)
	}
	return r, nil
}

// state turns the record into a Limiter's state, its times moved to the
// local clock as of sent, when the read was sent.
func (r record) state(sent time.Time) *controlState {
	st := &controlState{replaced: make(chan struct{}), readAt: sent, source: r.source}
	if r.override != nil {
		st.override, st.hasOverride = *r.override, true
	}
	// A record's times are the script's, but Redis holds what anyone with
	// access wrote: bound them to a century either way, within which a
	// Duration neither overflows nor wraps.
	const century = 100 * 365 * 24 * time.Hour
	local := func(us int64) time.Time {
		us = max(min(us, r.now+century.Microseconds()), r.now-century.Microseconds())
		return sent.Add(time.Duration(us-r.now) * time.Microsecond)
	}
	if r.changed != 0 {
		st.changedUS, st.pivot, st.prev, st.during = r.changed, local(r.pivot), r.prev, r.during
	}
	if r.since != 0 {
		st.since, st.sinceUS = local(r.since), r.since
		if r.until >= 0 {
			st.until = local(r.until)
		}
	}
	return st
}

// controlled returns b under its control record: with the override as its
// first layer's Limit, and the entry that tells of its pauses. A record
// that cannot be read because Redis is unavailable leaves b as it was read
// last, and the breaker learns of the outage; any other failure to read
// it is the caller's error. A read of the record counts among the span's
// round trips.
func (l *Limiter) controlled(ctx context.Context, span *waitSpan, b bucket) (bucket, error) {
	e, sent, err := l.controls.entry(ctx, b, l.mode() == ModeShared)
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
	b.ctl, b.passed = e, b.lims[0]
	return b.under(e), nil
}

// under returns b under the state of its control record e read last: with
// the override, if any, as its first layer's Limit, else the Limit its
// callers pass.
func (b bucket) under(e *controlEntry) bucket {
	st := e.load()
	want := b.passed
	if st.hasOverride {
		want = st.override
	}
	if b.lims[0] != want {
		b.lims = slices.Clone(b.lims)
		b.lims[0] = want
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
	t := time.NewTimer(0)
	<-t.C
	defer t.Stop()
	for {
		st := b.ctl.load()
		now := time.Now()
		end, forever, paused := st.pausedAt(now)
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
			return fmt.Errorf("%w: %q is paused %s", ErrWouldWait, b.name, until)
		case hasDeadline && !forever && end.Sub(now) > maxWait:
			return fmt.Errorf("%w: %q is paused %s", ErrWouldExceedDeadline, b.name, until)
		case !forever && end.Sub(now) <= maxWait:
			return ctx.Err() // the script queues it behind the pause
		}
		if done == nil {
			done = l.controls.wait(b.ctl)
		}
		next := waitCheck
		if !forever {
			next = min(next, end.Sub(now)-maxWait+time.Millisecond)
		}
		t.Reset(max(next, time.Millisecond))
		select {
		case <-st.replaced:
			if !t.Stop() {
				<-t.C
			}
		case <-t.C:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// sleepOn waits for a grant of bucket b that falls due after g.wait, and
// later by as much as a pause or a change of the Limit in force, recorded
// since the take, moved the queue it was granted in. When ctx ends first,
// or a pause moves the grant past ctx's deadline, it returns how far the
// grant had been moved with the error, for the refund.
func (l *Limiter) sleepOn(ctx context.Context, b bucket, g grant) (time.Duration, error) {
	if g.wait <= 0 {
		return 0, nil
	}
	due := time.Now().Add(g.wait)
	if b.ctl == nil {
		return 0, sleep(ctx, g.wait)
	}
	takenAt := g.takenAt(b)
	// A sleep long enough for a read of the record to matter, or one that
	// a pause holds, registers: the Limiter reads the record every
	// waitRefresh meanwhile. A shorter one learns of a change from its
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
	when := func(st *controlState) (time.Time, bool) {
		at, ends := st.hold(due, takenAt, g.pause)
		if !ends {
			return at, false
		}
		return st.rescale(at, takenAt, b.ctl.rate(st)), true
	}
	t := time.NewTimer(0)
	<-t.C
	defer t.Stop()
	for {
		st := b.ctl.load()
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
		if done == nil && (!ends || next >= waitRefresh) {
			done = l.controls.wait(b.ctl)
		}
		t.Reset(next)
		select {
		case <-t.C:
		case <-st.replaced:
			if !t.Stop() {
				<-t.C
			}
		case <-ctx.Done():
			if at, ends := when(b.ctl.load()); ends {
				return at.Sub(due), ctx.Err()
			}
			return 0, ctx.Err()
		}
	}
}
