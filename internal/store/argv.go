package store

import (
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
)

// argvCache keeps the script arguments that most calls repeat (the Limits
// in use, one token, the longest wait) formatted and boxed, so that a call
// does not allocate them again.
type argvCache struct {
	one     any // "1"
	maxWait int64
	wait    any // maxWait, boxed

	// limits maps a Limit to its rate and burst as the script reads them.
	// Readers load it without a lock; a new Limit replaces it with a copy.
	limits atomic.Pointer[map[Limit][2]any]
	mu     sync.Mutex // serialises the copies
}

// maxCachedLimits bounds the cache: Limits come from configuration, and a
// caller that makes new ones for every call gets them formatted each time.
const maxCachedLimits = 1024

func (c *argvCache) init(maxWait time.Duration) {
	us := maxWait.Microseconds()
	c.one, c.maxWait, c.wait = redisx.Num(1), us, us
	c.limits.Store(&map[Limit][2]any{})
}

func (c *argvCache) tokens(n float64) any {
	if n == 1 {
		return c.one
	}
	return redisx.Num(n)
}

func (c *argvCache) micros(us int64) any {
	if us == c.maxWait {
		return c.wait
	}
	return us
}

// limit returns lim's rate and burst as the script reads them.
func (c *argvCache) limit(lim Limit) (rate, burst any) {
	if v, ok := (*c.limits.Load())[lim]; ok {
		return v[0], v[1]
	}
	v := [2]any{redisx.Num(lim.Rate), redisx.Num(lim.Burst)}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := *c.limits.Load()
	if _, ok := old[lim]; !ok && len(old) < maxCachedLimits {
		m := make(map[Limit][2]any, len(old)+1)
		maps.Copy(m, old)
		m[lim] = v
		c.limits.Store(&m)
	}
	return v[0], v[1]
}
