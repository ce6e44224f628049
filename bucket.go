package quota

import (
	"context"
	_ "embed"
	"fmt"
	"maps"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

//go:embed script.lua
var bucketSource string

// The operations of the bucket script.
const (
	opTake   = "take"
	opRefund = "refund"
	opProbe  = "probe"
	opPause  = "pause"
	opLower  = "lower"
	opAdjust = "adjust"
)

// bucket is one bucket's layers: the Redis key and the resolved Limit of
// each, the first layer under the bucket's own key.
type bucket struct {
	name string
	keys []string
	lims []Limit
}

// bucket returns the bucket named name with layers lims, validated and
// resolved, without asking Redis anything.
func (l *Limiter) bucket(name string, lims []Limit) (bucket, error) {
	rkey, err := l.redisKey(name)
	if err != nil {
		return bucket{}, err
	}
	if len(lims) == 0 {
		return bucket{}, fmt.Errorf("%w: no Limit given", ErrInvalidLimit)
	}
	b := bucket{name: name}
	if len(lims) == 1 {
		// The usual bucket, one layer, in one allocation.
		one := new(struct {
			keys [1]string
			lims [1]Limit
		})
		b.keys, b.lims = one.keys[:], one.lims[:]
	} else {
		b.keys, b.lims = make([]string, len(lims)), make([]Limit, len(lims))
	}
	for i, lim := range lims {
		if b.lims[i], err = lim.resolve(); err != nil {
			return bucket{}, err
		}
		b.keys[i] = rkey
		if i > 0 {
			// Further layers live beside the first, in its hash slot, under
			// a key that names their Limit.
			b.keys[i] = rkey + ":" + num(b.lims[i].Rate) + "/" + num(b.lims[i].Burst)
		}
	}
	return b, nil
}

// checkTokens reports whether n tokens can ever be granted from every layer.
func (b bucket) checkTokens(n float64) error {
	for _, lim := range b.lims {
		if err := lim.checkTokens(n); err != nil {
			return err
		}
	}
	return nil
}

// reply is the decoded reply of the bucket script.
type reply struct {
	granted bool
	wait    time.Duration
	tats    []int64 // microseconds, a layer each; identify a take for its refund (nil without a wait)
}

// call runs op of the bucket script on b and returns the reply and the
// number of Redis round trips it took. n and arg are the operation's
// ARGV[2] and ARGV[3]; mine is a refund's tats.
func (l *Limiter) call(ctx context.Context, b bucket, op string, n float64, arg int64, mine []int64) (reply, int, error) {
	args := make([]any, 0, 4+3*len(b.lims))
	args = append(args, op, l.argv.tokens(n), l.argv.micros(arg), l.now())
	for i, lim := range b.lims {
		var tat any = 0
		if mine != nil {
			tat = mine[i]
		}
		rate, burst := l.argv.limit(lim)
		args = append(args, rate, burst, tat)
	}
	cmd, trips := l.bucketScript.run(ctx, b.keys, args...)
	if err := cmd.Err(); err != nil {
		return reply{}, trips, err
	}
	if v, ok := cmd.Val().(int64); ok && v == 0 && op == opTake {
		return reply{granted: true}, trips, nil // granted without a wait
	}
	v, err := cmd.Int64Slice()
	if err != nil || len(v) != 2+len(b.keys) {
		return reply{}, trips, fmt.Errorf("%w: unexpected reply %v", ErrScript, cmd.Val())
	}
	return reply{granted: v[0] == 1, wait: time.Duration(v[1]) * time.Microsecond, tats: v[2:]}, trips, nil
}

// num formats x for the script: plain digits where they are short, which
// every Lua reads, and the exponent form for the extremes.
func num(x float64) string {
	if a := math.Abs(x); a == 0 || (a >= 1e-6 && a < 1e21) {
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
	return strconv.FormatFloat(x, 'g', -1, 64)
}

// now returns the ARGV the script reads as the time: empty for the server's
// clock, the caller's clock in microseconds with WithClock.
func (l *Limiter) now() string {
	if l.cfg.clock == nil {
		return ""
	}
	return strconv.FormatInt(l.cfg.clock().UnixMicro(), 10)
}

// pause grants nothing from b for d, as a provider's Retry-After asks.
func (l *Limiter) pause(ctx context.Context, b bucket, d time.Duration) error {
	_, _, err := l.call(ctx, b, opPause, float64(d.Microseconds()), 0, nil)
	return err
}

// lower leaves every layer of b at most remaining tokens, never raising it.
func (l *Limiter) lower(ctx context.Context, b bucket, remaining float64) error {
	for _, lim := range b.lims {
		if remaining < lim.Burst {
			_, _, err := l.call(ctx, b, opLower, remaining, 0, nil)
			return err
		}
	}
	return nil // no layer holds more than that
}

// adjust takes n more tokens from b at once, or gives -n back.
func (l *Limiter) adjust(ctx context.Context, b bucket, n float64) error {
	_, _, err := l.call(ctx, b, opAdjust, n, 0, nil)
	return err
}

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
	c.one, c.maxWait, c.wait = num(1), us, us
	c.limits.Store(&map[Limit][2]any{})
}

func (c *argvCache) tokens(n float64) any {
	if n == 1 {
		return c.one
	}
	return num(n)
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
	v := [2]any{num(lim.Rate), num(lim.Burst)}
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
