package quota

import (
	"context"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redisx"
)

//go:embed script.lua
var bucketSource string

// maxNameLen bounds a bucket's name inside its Redis key. Longer names,
// which only untrusted input produces, are shortened to a prefix and a
// digest.
const maxNameLen = 200

// bucket is one bucket's layers: its name, and the Redis key and resolved
// Limit of each layer, the first layer under the bucket's own key.
type bucket struct {
	name string
	keys []string // the layers'
	lims []Limit
	call []string       // the script's KEYS: the layers' keys, then the control record's
	ctl  *control.Entry // what the Limiter read of its control record; nil in none

	// Under a control record: the state whose override lims holds, and
	// the first layer's Limit as the caller passed it.
	st     *control.State
	passed Limit
}

// bucketKey returns the Redis key of the bucket named name: the prefix,
// then the name in a hash tag so that every key of one bucket shares a
// Cluster slot. Distinct names have distinct keys. A name longer than
// maxNameLen is shortened to a prefix and a digest, one byte longer than
// maxNameLen, which no name kept whole can be; a name that begins with
// "}", which would leave the hash tag empty, or with "%", is written after
// a "%".
func bucketKey(prefix, name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: empty bucket name", ErrInvalidKey)
	}
	if len(name) > maxNameLen {
		sum := sha256.Sum256([]byte(name))
		digest := hex.EncodeToString(sum[:8])
		name = name[:maxNameLen-len(digest)] + "~" + digest
	}
	if name[0] == '}' || name[0] == '%' {
		name = "%" + name
	}
	return prefix + "{" + name + "}", nil
}

// newBucket returns the bucket named name with layers lims, validated and
// resolved, without asking Redis anything.
func newBucket(prefix, name string, lims []Limit) (bucket, error) {
	key, err := bucketKey(prefix, name)
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
			call [2]string
			lims [1]Limit
		})
		b.call, b.lims = one.call[:], one.lims[:]
	} else {
		b.call, b.lims = make([]string, len(lims)+1), make([]Limit, len(lims))
	}
	b.keys = b.call[:len(lims):len(lims)]
	b.call[len(lims)] = key + control.Suffix
	for i, lim := range lims {
		if b.lims[i], err = lim.resolve(); err != nil {
			return bucket{}, err
		}
		b.keys[i] = key
		if i > 0 {
			// Further layers live beside the first, in its hash slot, under
			// a key that names their Limit.
			b.keys[i] = key + ":" + redisx.Num(b.lims[i].Rate) + "/" + redisx.Num(b.lims[i].Burst)
		}
	}
	return b, nil
}

// checkTokens reports whether n tokens can ever be granted from every layer.
func (b bucket) checkTokens(n float64) error {
	for _, lim := range b.lims {
		if err := lim.checkTokens(b.name, n); err != nil {
			return err
		}
	}
	return nil
}

// store runs the operations of the bucket script (script.lua) on Redis, one
// typed method each.
type store struct {
	script  *redisx.Script
	argv    argvCache
	clock   func() time.Time // nil: the server's clock
	cluster bool             // the client follows Cluster redirections
	channel string           // the control channel, which announces changes
	batches *batches         // nil: every take a call of its own
}

func newStore(rdb redis.Scripter, cfg config) *store {
	s := &store{script: redisx.NewScript(rdb, bucketSource), clock: cfg.clock, channel: cfg.prefix + control.Channel}
	s.cluster = redisx.IsCluster(rdb)
	if !cfg.noBatching {
		s.batches = &batches{hold: !cfg.dryRun} // a dry run never delays
	}
	s.argv.init(cfg.maxWait)
	return s
}

// grant is the reply to a take.
type grant struct {
	granted bool          // false: the wait exceeds the caller's, nothing was taken
	wait    time.Duration // until the tokens have accrued, or would have
	tats    []int64       // µs, a layer each; identify the take for its refund (nil without a wait)
	pause   control.Pause // the pause in force when the take ran (zero without a wait)
}

// takenAt returns when, on the server's clock in microseconds, the take
// that granted g after a wait ran: its grant falls due when the slowest
// layer, whose tat moved by n tokens, has n tokens again.
func (g grant) takenAt(b bucket) int64 {
	due := int64(math.MinInt64)
	for i, lim := range b.lims {
		due = max(due, g.tats[i]-int64(lim.Burst/lim.Rate*1e6))
	}
	return due - g.wait.Microseconds()
}

// take takes n tokens from every layer of b when the wait for them is at
// most maxWait, and returns the grant and the Redis round trips it took.
// A take of a bucket that has no take in flight in this store is sent at
// once; one that finds a take in flight joins the next call, shared with
// every take that queued meanwhile (see batches).
func (s *store) take(ctx context.Context, b bucket, n float64, maxWait time.Duration) (grant, int, error) {
	if s.batches == nil {
		return s.takeOne(ctx, b, n, maxWait)
	}
	return s.batches.take(s, ctx, b, n, maxWait)
}

// takeOne takes n tokens from every layer of b in a call of its own.
func (s *store) takeOne(ctx context.Context, b bucket, n float64, maxWait time.Duration) (grant, int, error) {
	cmd, trips := s.run(ctx, b, "take", s.argv.tokens(n), s.argv.micros(maxWait.Microseconds()), nil)
	if err := cmd.Err(); err != nil {
		return grant{}, trips, err
	}
	if v, ok := cmd.Val().(int64); ok && v == 0 {
		return grant{granted: true}, trips, nil // granted without a wait
	}
	v, err := cmd.Int64Slice()
	if k := len(b.keys); err != nil || len(v) != 2+k+2 {
		return grant{}, trips, fmt.Errorf("%w: unexpected reply %v", ErrScript, cmd.Val())
	}
	k := len(b.keys)
	return grant{
		granted: v[0] == 1,
		wait:    time.Duration(v[1]) * time.Microsecond,
		tats:    v[2 : 2+k : 2+k],
		pause:   control.Pause{Since: v[2+k], Shifted: v[3+k]},
	}, trips, nil
}

// refund hands back n tokens of a take identified by its tats.
func (s *store) refund(ctx context.Context, b bucket, n float64, tats []int64) error {
	return s.do(ctx, b, "refund", s.argv.tokens(n), 0, tats)
}

// probe rewrites b as it is, to learn whether the server accepts writes.
func (s *store) probe(ctx context.Context, b bucket) error {
	return s.do(ctx, b, "probe", 0, 0, nil)
}

// pause grants nothing from b for d, as a provider's Retry-After asks: the
// bucket's one pause ends then at the latest, and the change is announced
// on the control channel.
func (s *store) pause(ctx context.Context, b bucket, d time.Duration) error {
	return s.do(ctx, b, "pause", max(d.Microseconds(), 1), s.channel, nil)
}

// lower leaves every layer of b at most remaining tokens, never raising it.
func (s *store) lower(ctx context.Context, b bucket, remaining float64) error {
	for _, lim := range b.lims {
		if remaining < lim.Burst {
			return s.do(ctx, b, "lower", redisx.Num(remaining), 0, nil)
		}
	}
	return nil // no layer holds more than that
}

// adjust takes n more tokens from b at once, or gives -n back. A non-empty
// id makes it count once however often it is sent (a client's retry after
// a lost reply): the script remembers the ids of the last minute.
func (s *store) adjust(ctx context.Context, b bucket, n float64, id string) error {
	withIDs := b
	withIDs.call = append(slices.Clip(b.call), b.keys[0]+settledSuffix)
	return s.do(ctx, withIDs, "adjust", redisx.Num(n), id, nil)
}

// settledSuffix follows a bucket's key in the key of its settles' ids.
const settledSuffix = ":settled"

// do runs an operation whose reply says nothing but success.
func (s *store) do(ctx context.Context, b bucket, op string, x, y any, tats []int64) error {
	cmd, _ := s.run(ctx, b, op, x, y, tats)
	if err := cmd.Err(); err != nil {
		return err
	}
	_, err := s.decode(cmd, b)
	return err
}

// run runs the script on b's keys with ARGV op, x and y (see script.lua),
// the clock, and each layer's rate, burst and tat.
func (s *store) run(ctx context.Context, b bucket, op string, x, y any, tats []int64) (*redis.Cmd, int) {
	return s.script.Run(ctx, b.call, s.args(b, op, x, y, tats, 0)...)
}

// args returns the ARGV of run, with room for spare more.
func (s *store) args(b bucket, op string, x, y any, tats []int64, spare int) []any {
	args := make([]any, 0, 4+3*len(b.lims)+spare)
	args = append(args, op, x, y, s.now())
	for i, lim := range b.lims {
		var tat any = 0
		if tats != nil {
			tat = tats[i]
		}
		rate, burst := s.argv.limit(lim)
		args = append(args, rate, burst, tat)
	}
	return args
}

// decode checks a table reply, {granted, wait, tat_1, ..., tat_k}.
func (s *store) decode(cmd *redis.Cmd, b bucket) ([]int64, error) {
	v, err := cmd.Int64Slice()
	if err != nil || len(v) != 2+len(b.keys) {
		return nil, fmt.Errorf("%w: unexpected reply %v", ErrScript, cmd.Val())
	}
	return v, nil
}

// now returns the ARGV the script reads as the time: empty for the server's
// clock, the caller's clock in microseconds with WithClock.
func (s *store) now() string {
	if s.clock == nil {
		return ""
	}
	return strconv.FormatInt(s.clock().UnixMicro(), 10)
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
