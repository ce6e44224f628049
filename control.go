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
	"go.opentelemetry.io/otel/trace"
)

//go:embed control.lua
var controlSource string

// What operators set on a bucket at runtime, an override of its Limit and
// a pause, lives in Redis in the bucket's control record (control.lua).
// Each Limiter keeps what it read of the records of the buckets it uses,
// so that an acquisition asks Redis nothing more than its take: it reads a
// bucket's record when it first uses the bucket, and again, in the
// background, once it is controlRefresh old. Every change is announced on
// the prefix's control channel, on which a Limiter in use listens, and a
// Limiter reads again the record of a bucket announced. A Limiter that
// missed an announcement holds what it read for controlRefresh at most
// while it listens, and while it does not, reads before it grants.
const (
	controlRefresh = time.Second
	controlIdle    = time.Minute // a Limiter stops listening when unused this long
	maxControls    = 2048        // records kept
	controlReadFor = time.Second // bounds a read in the background

	// A pause with no end moves a bucket's queue ten years ahead until it
	// ends (control.lua): a wait longer than this tells of one.
	pausedForever = 5 * 365 * 24 * time.Hour

	controlSuffix  = ":ctl"
	controlChannel = "control" // after the prefix
)

// controlState is what a Limiter read of a bucket's control record. It
// never changes: a read replaces it, and closes changed.
type controlState struct {
	override    Limit
	hasOverride bool

	// The latest pause, on the local clock; since is zero when the record
	// holds none, until is zero for a pause with no end.
	since, until time.Time
	sinceUS      int64 // since on the server's clock, µs, to compare with takes

	// When the Limit in force last changed, on the local clock and the
	// server's; zero when it never did.
	changed   time.Time
	changedUS int64

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

// hold returns when a grant taken at takenAt (server µs) and due at due
// falls due once the latest pause has moved it: a grant due t after the
// pause began falls due t after it ends. It returns false while the pause
// has no end.
func (st *controlState) hold(due time.Time, takenAt int64) (time.Time, bool) {
	if st.since.IsZero() || takenAt >= st.sinceUS || !due.After(st.since) {
		return due, true
	}
	if st.until.IsZero() {
		return time.Time{}, false
	}
	return st.until.Add(due.Sub(st.since)), true
}

// rescale returns when a grant taken at takenAt (server µs) at rate from
// and due at due falls due once the latest change of the Limit in force,
// to rate to, has moved it: a grant due t after the change falls due
// t x from / to after it.
func (st *controlState) rescale(due time.Time, takenAt int64, from, to float64) time.Time {
	if st.changed.IsZero() || takenAt >= st.changedUS || !due.After(st.changed) || from == to {
		return due
	}
	return st.changed.Add(time.Duration(float64(due.Sub(st.changed)) * from / to))
}

// outpaced tells whether a grant taken at takenAt (server µs) at rate from
// was taken after the latest change of the Limit in force, to the slower
// rate to, by a Limiter that had not yet heard of it: such a grant holds
// a place in the queue spaced at the old rate, and is to be taken again.
func (st *controlState) outpaced(takenAt int64, from, to float64) bool {
	return !st.changed.IsZero() && takenAt >= st.changedUS && from > to
}

// apply returns b with the override, if any, as its first layer's Limit.
func (st *controlState) apply(b bucket) bucket {
	if !st.hasOverride || b.lims[0] == st.override {
		return b
	}
	lims := make([]Limit, len(b.lims))
	copy(lims, b.lims)
	lims[0] = st.override
	b.lims = lims
	return b
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
	stale   bool          // read again once the read in flight ends
}

// rate returns the first layer's rate in force under st.
func (e *controlEntry) rate(st *controlState) float64 {
	if st.hasOverride {
		return st.override.Rate
	}
	return e.passed.Rate
}

func (e *controlEntry) load() *controlState { return e.state.Load() }

// controls are a Limiter's control entries, and its subscription to the
// announcements of changes.
type controls struct {
	rdb    redis.Scripter
	script *script
	prefix string
	id     string // this Limiter's, among a bucket's users

	mu        sync.RWMutex
	m         map[string]*controlEntry
	listening bool
	sub       *redis.PubSub
	lastUse   atomic.Int64 // unix ns
}

func newControls(rdb redis.Scripter, cfg config) *controls {
	host, _ := os.Hostname()
	var b [6]byte
	_, _ = rand.Read(b[:])
	return &controls{
		rdb:    rdb,
		script: newScript(rdb, controlSource),
		prefix: cfg.prefix,
		id:     fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:])),
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
	touch(&c.lastUse, now)
	key := b.keys[0]
	c.mu.RLock()
	e, listening := c.m[key], c.listening
	c.mu.RUnlock()
	if e == nil {
		e = c.add(b)
		listening = false
	}
	touch(&e.used, now)
	if !listening {
		c.listen()
	}
	readAt := e.read.Load()
	switch {
	case !shared || now-readAt < int64(controlRefresh):
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

// touch records now in t unless t holds a time less than a second older:
// every acquisition records its use, and most need not write.
func touch(t *atomic.Int64, now int64) {
	if now-t.Load() > int64(time.Second) {
		t.Store(now)
	}
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
	e := &controlEntry{key: key, passed: b.lims[0], seen: num(b.lims[0].Rate) + " " + num(b.lims[0].Burst)}
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
// used since, an arbitrary tenth of them. It runs with c.mu held.
func (c *controls) evict() {
	idle := time.Now().Add(-controlIdle).UnixNano()
	for k, e := range c.m {
		if e.used.Load() < idle {
			delete(c.m, k)
		}
	}
	for k := range c.m {
		if len(c.m) < maxControls*9/10 {
			break
		}
		delete(c.m, k)
	}
}

// readNow reads e's record unless a read is in flight, in which case it
// waits for that one. sent tells whether it sent a read of its own.
func (c *controls) readNow(ctx context.Context, e *controlEntry) (sent bool, _ error) {
	e.mu.Lock()
	if done := e.reading; done != nil {
		e.mu.Unlock()
		select {
		case <-done:
			return false, nil
		case <-ctx.Done():
			return false, ctx.Err()
		}
	}
	done := make(chan struct{})
	e.reading = done
	e.mu.Unlock()
	err := c.read(ctx, e)
	e.mu.Lock()
	e.reading = nil
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
	ctx, cancel := context.WithTimeout(untraced(), controlReadFor)
	defer cancel()
	_, _ = c.readNow(ctx, e)
}

// read reads e's record, records the Limit the Limiter's callers pass
// and the Limiter among the bucket's users,
// and replaces e's state with what it read. A failed read leaves the
// state as it was, or no control at all if there was none, and is tried
// again controlRefresh later.
func (c *controls) read(ctx context.Context, e *controlEntry) error {
	e.read.Store(time.Now().UnixNano())
	sent := time.Now()
	keys := []string{e.key + controlSuffix, e.key}
	for suffix := range strings.FieldsSeq(e.layers) {
		keys = append(keys, e.key+suffix)
	}
	cmd, _ := c.script.run(ctx, keys, "read", e.seen, e.layers, c.id)
	rec, err := parseControl(cmd)
	if err != nil {
		return err
	}
	close(e.state.Swap(rec.state(sent)).replaced)
	return nil
}

// listen subscribes to the prefix's control channel, unless the Limiter
// already does, and reads again the record of each bucket announced,
// until the Limiter has been unused for controlIdle.
func (c *controls) listen() {
	c.mu.Lock()
	if c.listening {
		c.mu.Unlock()
		return
	}
	s, ok := c.rdb.(subscriber)
	if !ok {
		c.mu.Unlock()
		return
	}
	c.listening = true
	c.sub = s.Subscribe(untraced(), c.prefix+controlChannel)
	sub := c.sub
	c.mu.Unlock()

	idle := time.NewTicker(controlIdle / 4)
	go func() {
		defer idle.Stop()
		msgs := sub.Channel()
		for {
			select {
			case msg, ok := <-msgs:
				if !ok {
					return
				}
				c.mu.RLock()
				e := c.m[msg.Payload]
				c.mu.RUnlock()
				if e != nil {
					go c.refresh(e)
				}
			case <-idle.C:
				if time.Since(time.Unix(0, c.lastUse.Load())) < controlIdle {
					continue
				}
				c.mu.Lock()
				c.listening, c.sub = false, nil
				// What was read is no longer kept up to date: the next
				// use reads again before it grants.
				for _, e := range c.m {
					e.read.Store(0)
				}
				c.mu.Unlock()
				sub.Close()
				return
			}
		}
	}()
}

// record is a control record as control.lua replies it.
type record struct {
	now          int64 // µs, the server's clock
	override     *Limit
	since, until int64 // µs; until is -1 for a pause with no end
	seen         *Limit
	users        int   // status only
	tat          int64 // status only; 0 when absent
	changed      int64 // µs; 0 when the Limit in force never changed
}

// parseControl reads control.lua's reply.
func parseControl(cmd *redis.Cmd) (record, error) {
	vals, err := cmd.StringSlice()
	if err != nil {
		return record{}, err
	}
	if len(vals) != 9 {
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
	r.changed = integer(vals[8])
	if vals[7] != "" {
		tat, err := strconv.ParseFloat(vals[7], 64)
		r.tat = int64(tat)
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return record{}, fmt.Errorf("%w: an unreadable control record: %w", ErrScript, err)
	}
	return r, nil
}

// state turns the record into a Limiter's state, its times moved to the
// local clock as of sent, when the read was sent.
func (r record) state(sent time.Time) *controlState {
	st := &controlState{replaced: make(chan struct{})}
	if r.override != nil {
		st.override, st.hasOverride = *r.override, true
	}
	local := func(us int64) time.Time { return sent.Add(time.Duration(us-r.now) * time.Microsecond) }
	if r.changed != 0 {
		st.changed, st.changedUS = local(r.changed), r.changed
	}
	if r.since != 0 {
		st.since, st.sinceUS = local(r.since), r.since
		if r.until >= 0 {
			st.until = local(r.until)
		}
	}
	return st
}

// untraced returns the context of the Limiter's own calls to Redis that
// serve no one request: the background reads of control records and the
// subscription to their announcements. Its parent span is one that is not
// sampled, so that a tracing hook that samples by the parent (the
// OpenTelemetry SDK's default) records none of them, rather than a trace
// of its own for each read, every second, of every bucket in use.
func untraced() context.Context {
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	return trace.ContextWithRemoteSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, Remote: true}))
}

// controlled returns b under its control record: with the override as its
// first layer's Limit, and the entry that tells of its pauses. A record
// that cannot be read because Redis is unavailable leaves b as it was read
// last, and the breaker learns of the outage; any other failure to read
// it is the caller's error. A read of the record counts among the span's
// round trips.
func (l *Limiter) controlled(ctx context.Context, span *waitSpan, b bucket) (bucket, error) {
	e, sent, err := l.controls.entry(ctx, b, l.breaker.mode() == ModeShared)
	if sent {
		span.trips++
	}
	if err != nil {
		cerr := l.classify(ctx, err)
		if !errors.Is(cerr, ErrUnavailable) {
			return bucket{}, cerr
		}
		l.breaker.trip(b, err)
	}
	st, passed := e.load(), b.lims[0]
	b = st.apply(b)
	b.ctl, b.st, b.passed = e, st, passed
	return b, nil
}

// recontrolled returns b under the state of its control record read last,
// and whether that state changes how b is taken since b was made: another
// Limit in force, or a pause in force now.
func (b bucket) recontrolled() (bucket, bool) {
	if b.ctl == nil {
		return b, false
	}
	st := b.ctl.load()
	if st == b.st {
		return b, false
	}
	_, _, paused := st.pausedAt(time.Now())
	if !paused && st.hasOverride == b.st.hasOverride && (!st.hasOverride || st.override == b.st.override) {
		return b, false
	}
	lims := slices.Clone(b.lims)
	lims[0] = b.passed
	nb := b
	nb.lims = lims
	nb = st.apply(nb)
	nb.st = st
	return nb, true
}

// awaitPause waits while b is paused, until the pause ends or ctx does.
// It refuses at once with ErrWouldWait under noWait, and with
// ErrWouldExceedDeadline when the pause ends after ctx's deadline; a
// pause with no end may be resumed any time, so the caller keeps waiting
// for it until its deadline. Under dry run it records the wait and
// returns.
func (l *Limiter) awaitPause(ctx context.Context, span *waitSpan, b bucket, noWait bool) error {
	if b.ctl == nil {
		return ctx.Err()
	}
	var t *time.Timer
	defer func() {
		if t != nil {
			t.Stop()
		}
	}()
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
		deadline, hasDeadline := ctx.Deadline()
		switch {
		case span.dryRun:
			if !forever {
				span.wait = end.Sub(now)
			}
			return ctx.Err()
		case noWait:
			return fmt.Errorf("%w: %q is paused %s", ErrWouldWait, b.name, until)
		case hasDeadline && !forever && end.After(deadline):
			return fmt.Errorf("%w: %q is paused %s", ErrWouldExceedDeadline, b.name, until)
		}
		var expired <-chan time.Time
		if !forever {
			if t == nil {
				t = time.NewTimer(end.Sub(now))
			} else {
				t.Reset(end.Sub(now))
			}
			expired = t.C
		}
		select {
		case <-st.replaced:
		case <-expired:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}
