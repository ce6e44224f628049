// Package pending counts work a Limiter does in the background, so that a
// process can wait for it before it exits.
package pending

import (
	"context"
	"sync"
)

// A Count is a number of things under way. The zero Count is ready.
type Count struct {
	mu   sync.Mutex
	n    int
	none chan struct{} // closed when n comes to zero; nil while nobody waits
}

// Add counts n more things under way.
func (c *Count) Add(n int) {
	if n <= 0 {
		return
	}
	c.mu.Lock()
	c.n += n
	c.mu.Unlock()
}

// Done counts n things that ended.
func (c *Count) Done(n int) {
	if n <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n -= n
	if c.n < 0 {
		panic("pending: more done than added")
	}
	if c.n == 0 && c.none != nil {
		close(c.none)
		c.none = nil
	}
}

// Wait returns once nothing is under way, or with ctx's error when ctx
// ends first.
func (c *Count) Wait(ctx context.Context) error {
	c.mu.Lock()
	if c.n == 0 {
		c.mu.Unlock()
		return nil
	}
	if c.none == nil {
		c.none = make(chan struct{})
	}
	none := c.none
	c.mu.Unlock()
	select {
	case <-none:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
