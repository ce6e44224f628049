package control

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
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
