package request

import (
	"slices"
	"sync"
	"time"
)

// The bounds of Times: the response times kept of each name, the fewest
// that give a quantile, and the names kept at once.
const (
	keptTimes = 128
	minTimes  = 16
	maxNames  = 1000
)

// Times keeps the latest response times of each of a bounded number of
// names. The zero value is ready for use.
type Times struct {
	mu sync.Mutex
	m  map[string]*ring
}

// A ring holds the latest keptTimes times, the oldest overwritten first.
type ring struct {
	d    [keptTimes]time.Duration
	n    int // times seen, at most keptTimes counted
	next int
}

// Add records a response time d of name. Past maxNames names, it forgets
// one to make room.
func (t *Times) Add(name string, d time.Duration) {
	t.mu.Lock()
	defer t.mu.Unlock()
	r := t.m[name]
	if r == nil {
		if t.m == nil {
			t.m = make(map[string]*ring)
		}
		if len(t.m) >= maxNames {
			for k := range t.m {
				delete(t.m, k)
				break
			}
		}
		r = new(ring)
		t.m[name] = r
	}
	r.d[r.next] = d
	r.next = (r.next + 1) % keptTimes
	r.n = min(r.n+1, keptTimes)
}

// Quantile returns the q quantile (0 < q <= 1) of the times of name, or
// false while fewer than minTimes are known.
func (t *Times) Quantile(name string, q float64) (time.Duration, bool) {
	t.mu.Lock()
	r := t.m[name]
	if r == nil || r.n < minTimes {
		t.mu.Unlock()
		return 0, false
	}
	d := slices.Clone(r.d[:r.n])
	t.mu.Unlock()
	slices.Sort(d)
	i := min(int(q*float64(len(d))+0.999999)-1, len(d)-1)
	return d[max(i, 0)], true
}
