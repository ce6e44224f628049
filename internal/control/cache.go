package control

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/store"
)

// Entry is a Limiter's knowledge of one bucket's control record.
type Entry struct {
	key   string // the bucket's first key
	name  string // the bucket's name
	state atomic.Pointer[State]
	read  atomic.Int64 // when it was last read or tried, unix ns
	used  atomic.Int64 // when it was last used, unix ns

	passed Limit       // the first layer's Limit as the Limiter's callers pass it
	layers string      // the further layers' suffixes
	meter  string      // what the first layer meters, when each meters its own
	k      int         // the layers
	tally  tally       // what was granted, for the next read (grants.go)
	news   atomic.Bool // the next read has news to tell (Tell)
	mixed  atomic.Bool // a caller passed a first Limit other than passed

	mu      sync.Mutex
	reading chan struct{} // closed when the read in flight ends; nil when none
	readErr error         // how the read last ended, for the callers that waited for it
	stale   bool          // read again once the read in flight ends
	waiters int           // callers sleeping or waiting on the bucket
	told    []float64     // the learned rates last logged (learned.go)
}

// Mixed reports whether lim, a caller's first Limit, is the first seen to
// differ from the Limit the entry's first caller passed: true once per
// entry.
func (e *Entry) Mixed(lim Limit) bool {
	return lim != e.passed && !e.mixed.Load() && e.mixed.CompareAndSwap(false, true)
}

// Passed returns the first layer's Limit as the entry's first caller
// passed it.
func (e *Entry) Passed() Limit { return e.passed }

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

	untold    map[*Entry]bool // entries whose grants their records were not told of (grants.go), under mu
	reporting bool            // the reporter runs

	linger func(key string) int // the slots held lingering of a bucket; nil: none
	shared func() bool          // Redis serves the Limiter; nil: always
	logger *slog.Logger         // tells of the learned rates; nil: nothing to tell
	gauge  func(bucket, layer string, rate float64)
}

// OnRead has each read of a bucket's record tell it how many of the
// bucket's slots the Limiter holds lingering, as linger counts them, and
// has the reads that only tell (grants.go) wait while shared reports
// false: a Limiter that Redis does not serve reads nothing of its own
// accord. Call it before the first use.
func (c *Controls) OnRead(linger func(key string) int, shared func() bool) {
	c.linger, c.shared = linger, shared
}

func (c *Controls) lingering(key string) int {
	if c.linger == nil {
		return 0
	}
	return c.linger(key)
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

// Entry returns the control entry of bucket b, whose callers pass passed
// for the first layer, reading the record when it is not
// known well enough to grant by: when the Limiter has none, or does not
// listen to announcements and read it more than Refresh ago. Only
// one read of a record is in flight at once: callers that need it wait
// for it. shared tells whether Redis is healthy; while it is not, the
// entry is used as last read, and read when Redis is back. The error is
// that of a read that failed.
func (c *Controls) Entry(ctx context.Context, b store.Bucket, passed Limit, shared bool) (_ *Entry, sent bool, _ error) {
	now := time.Now().UnixNano()
	listening := c.events.Use()
	key := b.Keys[0]
	c.mu.RLock()
	e := c.m[key]
	c.mu.RUnlock()
	if e == nil {
		e = c.add(b, passed)
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

// add returns the entry of bucket b, made and kept if there is none,
// making room when maxControls are kept.
func (c *Controls) add(b store.Bucket, passed Limit) *Entry {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys, key := b.Keys, b.Keys[0]
	if e := c.m[key]; e != nil {
		return e
	}
	if c.m == nil {
		c.m = make(map[string]*Entry)
	}
	if len(c.m) >= maxControls {
		c.evict()
	}
	e := &Entry{key: key, name: b.Name, passed: passed}
	if b.Meters != nil {
		e.meter = b.Meters[0]
	}
	e.state.Store(&State{replaced: make(chan struct{})})
	var layers []string
	for _, k := range keys[1:] {
		layers = append(layers, strings.TrimPrefix(k, key))
	}
	e.layers, e.k = strings.Join(layers, " "), len(keys)
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
			delete(c.untold, e)
		}
	}
	for k, e := range c.m {
		if len(c.m) < maxControls*9/10 {
			break
		}
		if !e.busy() {
			delete(c.m, k)
			delete(c.untold, e)
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
