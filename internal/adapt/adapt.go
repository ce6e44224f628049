// Package adapt is what a Transport that learns the provider's real limit
// (quota.Adaptive) keeps in its process: which responses are refusals,
// and the share of its requests the provider accepted lately, by bucket,
// which a refusal carries to the bucket's script. The rate itself is
// learned in Redis, once for the fleet (internal/store's learn.lua).
package adapt

import (
	"fmt"
	"maps"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/sharedquota/quota/internal/ratelimit"
	"github.com/sharedquota/quota/internal/store"
)

// The defaults of a Config's zero fields.
const (
	DefaultFloor = 0.05 // of each Limit's rate
	DefaultRise  = 0.02 // of each Limit's rate a second, past the peak (docs/adaptive.md: measured)
)

// A Config is quota.Adaptive's.
type Config struct {
	Floor, Rise float64
	Refusals    []int
}

// Check returns the Config with its defaults, or what is wrong with it.
func (c Config) Check() (Config, error) {
	switch {
	case !(c.Floor >= 0 && c.Floor < 1):
		return c, fmt.Errorf("a Floor of %v, want 0 to 1 (excluded)", c.Floor)
	case !(c.Rise >= 0 && c.Rise <= 1):
		return c, fmt.Errorf("a Rise of %v, want 0 to 1", c.Rise)
	}
	for _, s := range c.Refusals {
		if s < 400 || s > 599 {
			return c, fmt.Errorf("a refusal status of %d, want 400 to 599", s)
		}
	}
	if c.Floor == 0 {
		c.Floor = DefaultFloor
	}
	if c.Rise == 0 {
		c.Rise = DefaultRise
	}
	if len(c.Refusals) == 0 {
		c.Refusals = []int{http.StatusTooManyRequests}
	}
	return c, nil
}

// How far back the share accepted looks: ticks ticks of tick.
const (
	tick  = 100 * time.Millisecond
	ticks = 5
)

// maxBuckets bounds the buckets a Learner counts for: a flood of names
// leaves it no larger.
const maxBuckets = 2048

// forget drops the buckets that had no response in the look back before
// tick at, and every bucket when that leaves maxBuckets.
func (l *Learner) forget(at int64) {
	for name, w := range l.seen {
		if w.at <= at-ticks {
			delete(l.seen, name)
		}
	}
	if len(l.seen) >= maxBuckets {
		clear(l.seen)
	}
}

// minSeen is the fewest responses whose share accepted a refusal
// carries: a quiet process's few say too little to take a cut deeper.
const minSeen = 10

// A Learner counts a Transport's responses by bucket.
type Learner struct {
	cfg  Config
	mu   sync.Mutex
	seen map[string]*window
}

// window counts the responses of the last ticks ticks, by tick.
type window struct {
	at          int64 // the latest tick counted
	ok, refused [ticks]int
	bounds      []float64 // the bounds last told (see policies)
	boundsAt    time.Time // when
}

// boundsEvery is how often a bucket's bounds are told again, unchanged.
const boundsEvery = 10 * time.Second

// New returns a Learner of c, a checked Config.
func New(c Config) *Learner { return &Learner{cfg: c, seen: map[string]*window{}} }

// Response counts a response of status and header h to a request of the
// bucket called name, whose layers meter meters (nil: one cost), sent age
// ago; lows, when not nil, are what the provider says remains of each
// layer (below zero: it says nothing of it). For a refusal it returns
// what to tell the bucket: the share of the bucket's requests accepted in
// the last half second (1 when it saw fewer than minSeen), and the layers
// the response names (those with less than a token left). It returns the
// bounds of the provider's RateLimit-Policy too (see policies) when they
// changed, or were told boundsEvery ago; for them alone, a Refusal whose
// Why is "". A nil Learner learns nothing.
func (l *Learner) Response(name string, status int, h http.Header, meters []string, age time.Duration, lows []float64, now time.Time) (store.Refusal, bool) {
	if l == nil {
		return store.Refusal{}, false
	}
	refused := slices.Contains(l.cfg.Refusals, status)
	bounds := policies(h, meters)
	l.mu.Lock()
	at := now.UnixNano() / int64(tick)
	w := l.seen[name]
	if w == nil {
		if len(l.seen) >= maxBuckets {
			l.forget(at)
		}
		w = &window{}
		l.seen[name] = w
	}
	for t := w.at + 1; t <= at && t <= w.at+ticks; t++ {
		w.ok[t%ticks], w.refused[t%ticks] = 0, 0
	}
	w.at = max(w.at, at)
	if refused {
		w.refused[at%ticks]++
	} else {
		w.ok[at%ticks]++
	}
	var ok, all int
	for i := range ticks {
		ok, all = ok+w.ok[i], all+w.ok[i]+w.refused[i]
	}
	tell := bounds != nil && (!slices.Equal(bounds, w.bounds) || now.Sub(w.boundsAt) >= boundsEvery)
	if tell {
		w.bounds, w.boundsAt = bounds, now
	} else {
		bounds = nil
	}
	l.mu.Unlock()
	if !refused && !tell {
		return store.Refusal{}, false
	}
	r := store.Refusal{Age: age, OK: 1, Floor: l.cfg.Floor, Rise: l.cfg.Rise, Bounds: bounds}
	if !refused {
		return r, true
	}
	r.Why = fmt.Sprint(status)
	if all >= minSeen {
		r.OK = float64(ok) / float64(all)
	}
	for i, low := range lows {
		if low >= 0 && low < 1 {
			if r.Named == nil {
				r.Named = make([]bool, len(lows))
			}
			r.Named[i] = true
		}
	}
	return r, true
}

// policies returns the rates the provider's RateLimit-Policy allows the
// layers that meter meters, below zero for a layer it says nothing of;
// for a bucket of one cost (nil meters) the least it allows, of the first
// layer; nil when it says nothing.
func policies(h http.Header, meters []string) []float64 {
	ps := ratelimit.Policies(h)
	if ps == nil {
		return nil
	}
	if meters == nil {
		return []float64{slices.Min(slices.Collect(maps.Values(ps)))}
	}
	out := make([]float64, len(meters))
	for i, m := range meters {
		out[i] = -1
		if v, ok := ps[m]; ok {
			out[i] = v
		}
	}
	return out
}
