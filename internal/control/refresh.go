package control

import (
	"context"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/store"
)

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
	e.news.Store(false)
	grants, taken := e.tally.take()
	rec, err := c.store.Record(ctx, keys, store.RecordOp{Op: "read", ID: c.id, Limit: e.passed, Layers: e.layers, Meter: e.meter, Grants: grants, Linger: c.lingering(e.key)})
	if err != nil {
		e.tally.give(taken)
		return err
	}
	close(e.state.Swap(stateOf(rec, sent)).replaced)
	c.learned(e, rec.Learned)
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
