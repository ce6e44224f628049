// Package store keeps buckets in Redis: their keys, the bucket script
// (script.lua) with a typed method for each operation on the layers, and
// the sharing of script calls between the takes of one bucket (batch.go).
// The script also holds each bucket's control record, whose operations
// the control package runs on the same script.
package store

import (
	"context"
	"crypto/sha256"
	"embed"
	"encoding/hex"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redisx"
)

// The bucket script, in parts of one concern each, joined in this order
// into the one script every call runs (see script.lua).
var sourceParts = []string{"script.lua", "classes.lua", "timeline.lua", "record.lua", "tenants.lua", "take.lua", "layers.lua"}

//go:embed *.lua
var sources embed.FS

var source = func() string {
	var b strings.Builder
	for _, name := range sourceParts {
		part, err := sources.ReadFile(name)
		if err != nil {
			panic(err)
		}
		b.Write(part)
	}
	return b.String()
}()

// MaxNameLen bounds a bucket's name inside its Redis key. Longer names,
// which only untrusted input produces, are shortened to a prefix and a
// digest.
const MaxNameLen = 200

// A Limit is a layer's rate, tokens a second, and burst, validated.
type Limit struct {
	Rate  float64
	Burst float64
}

// A Bucket is one bucket's layers: its name, and the Redis key and Limit
// of each layer, the first layer under the bucket's own key.
type Bucket struct {
	Name   string
	Keys   []string // the layers'
	Lims   []Limit
	Meters []string // what each layer meters, when each meters its own; nil when all share the cost
	Call   []string // the script's KEYS: the layers' keys, then the control record's
}

// ControlSuffix follows a bucket's key in the key of its control record.
const ControlSuffix = ":ctl"

// Key returns the Redis key of the bucket named name, which is not empty:
// the prefix, then the name in a hash tag so that every key of one bucket
// shares a Cluster slot. Distinct names have distinct keys. A name longer
// than MaxNameLen is shortened to a prefix and a digest, one byte longer
// than MaxNameLen, which no name kept whole can be; a name that begins
// with "}", which would leave the hash tag empty, or with "%", is written
// after a "%".
func Key(prefix, name string) string {
	if len(name) > MaxNameLen {
		sum := sha256.Sum256([]byte(name))
		digest := hex.EncodeToString(sum[:8])
		name = name[:MaxNameLen-len(digest)] + "~" + digest
	}
	if name != "" && (name[0] == '}' || name[0] == '%') {
		name = "%" + name
	}
	return prefix + "{" + name + "}"
}

// New returns the bucket named name under prefix with layers lims, which
// are at least one and valid. With meters (one per layer, distinct and
// valid, see CheckMeter), each layer meters a thing of its own: its key
// names it.
func New(prefix, name string, lims []Limit, meters ...string) Bucket {
	key := Key(prefix, name)
	b := Bucket{Name: name}
	if len(lims) == 1 {
		// The usual bucket, one layer, in one allocation.
		one := new(struct {
			call [2]string
			lims [1]Limit
		})
		b.Call, b.Lims = one.call[:], one.lims[:]
	} else {
		b.Call, b.Lims = make([]string, len(lims)+1), make([]Limit, len(lims))
	}
	b.Keys = b.Call[:len(lims):len(lims)]
	b.Call[len(lims)] = key + ControlSuffix
	copy(b.Lims, lims)
	if len(meters) > 0 {
		b.Meters = meters
	}
	for i, lim := range b.Lims {
		b.Keys[i] = key
		if i > 0 {
			// Further layers live beside the first, in its hash slot, under
			// a key that names their Limit, and what they meter.
			b.Keys[i] = key + ":" + redisx.Num(lim.Rate) + "/" + redisx.Num(lim.Burst)
			if b.Meters != nil {
				b.Keys[i] = key + ":" + b.Meters[i] + ":" + redisx.Num(lim.Rate) + "/" + redisx.Num(lim.Burst)
			}
		}
	}
	return b
}

// MaxMeterLen bounds the name of a meter.
const MaxMeterLen = 64

// CheckMeter reports why name cannot name a meter, or nil: a meter's name
// is 1 to MaxMeterLen letters, digits, '_', '-' and '.', which keep its
// layer's key readable and apart from the others'.
func CheckMeter(name string) error {
	if name == "" || len(name) > MaxMeterLen {
		return fmt.Errorf("a meter's name has 1 to %d bytes, not %d", MaxMeterLen, len(name))
	}
	for _, c := range []byte(name) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-' || c == '.') {
			return fmt.Errorf("meter %q: a meter's name has letters, digits, '_', '-' and '.' only", name)
		}
	}
	return nil
}

// Same reports whether b and o are the same bucket: the same keys under
// the same Limits.
func (b Bucket) Same(o Bucket) bool {
	return slices.Equal(b.Keys, o.Keys) && slices.Equal(b.Lims, o.Lims) && slices.Equal(b.Meters, o.Meters)
}

// A Store runs the operations of the bucket script on Redis, one typed
// method each.
type Store struct {
	script  *redisx.Script
	argv    argvCache
	clock   func() time.Time // nil: the server's clock
	cluster bool             // the client follows Cluster redirections
	channel string           // the control channel, which announces changes
	batches *batches         // nil: every take a call of its own
}

// Options are a Store's settings.
type Options struct {
	Channel  string           // on which the script announces changes
	Clock    func() time.Time // the callers' clock; nil: the server's
	MaxWait  time.Duration    // the wait most takes accept, kept formatted
	Batching bool             // the takes of one bucket share calls
	Hold     bool             // a take on a bucket with a queue holds its call for the takes after it
}

// NewStore returns the Store of the buckets in rdb.
func NewStore(rdb redis.Scripter, o Options) *Store {
	s := &Store{script: redisx.NewScript(rdb, source), clock: o.Clock, channel: o.Channel}
	s.cluster = redisx.IsCluster(rdb)
	if o.Batching {
		s.batches = &batches{hold: o.Hold}
	}
	s.argv.init(o.MaxWait)
	return s
}

// Script returns the bucket script, which the control records' operations
// run too.
func (s *Store) Script() *redisx.Script { return s.script }

// Cluster reports whether the client follows Cluster redirections.
func (s *Store) Cluster() bool { return s.cluster }

// An Outcome is what a take came to.
type Outcome uint8

// The outcomes of a take, as the script replies them (see script.lua).
const (
	_        Outcome = iota
	Granted          // the tokens were taken; Wait is until they have accrued
	TooLong          // the wait would exceed the caller's; nothing was taken, Wait is what it would have been
	Paused           // the bucket is paused until a resume; nothing was taken
	Resuming         // the fleet has yet to leave its local shares after an outage; nothing was taken
	Crowded          // the take would push a lower class past its minimum share; nothing was taken, Wait is until it has room
	Held             // another tenant's turn, or the bucket's queue is full (see script.lua's tenants); nothing was taken, Wait is until the take may be admitted
	maxOutcome
)

var outcomeNames = [...]string{"", "granted", "too long", "paused", "resuming", "crowded", "held"}

func (o Outcome) String() string {
	if o > 0 && o < maxOutcome {
		return outcomeNames[o]
	}
	return fmt.Sprintf("outcome %d", uint8(o))
}

// A Grant is the reply to a take.
type Grant struct {
	Outcome Outcome
	Wait    time.Duration // until the tokens have accrued, or would have, or until the take may be asked again (see Outcome)
	Tats    []int64       // µs, a layer each; identify the take for its refund (nil without a wait)
	Pos     []float64     // the grant's position in each layer's timeline (see control.Anchor); nil without a wait
	Ev      int64         // the count of the bucket's timeline's moves when the take ran
	Now     int64         // when the take ran, µs on the server's clock (0 without a wait)
	Pushed  []int64       // how far pushes had moved each class's queue in each layer, class 0's first, k each; nil on a bucket no class above 0 took from
	Trips   int           // the Redis round trips of its call
	Size    int           // the takes its call served, when takes share calls; 0 otherwise or when none was sent
}

// Granted reports whether the take was granted.
func (g Grant) Granted() bool { return g.Outcome == Granted }

// TakenAt returns when, on the server's clock in microseconds, the take
// that granted g after a wait ran: its grant falls due when the slowest
// layer, whose tat moved by n tokens, has n tokens again.
func (g Grant) TakenAt(b Bucket) int64 {
	due := int64(math.MinInt64)
	for i, lim := range b.Lims {
		due = max(due, g.Tats[i]-int64(lim.Burst/lim.Rate*1e6))
	}
	return due - g.Wait.Microseconds()
}

// A Cost is what an operation asks of each layer of a bucket: N of every
// layer or, when Each is set, Each[i] of layer i (a bucket whose layers
// meter different things: requests, input tokens, output tokens).
type Cost struct {
	N     float64
	Each  []float64 // nil, or one per layer
	Class int       // the take's priority class, 0 to MaxClass (see script.lua)
	// Shares are the classes' minimum shares of the rate, by class, 0 or
	// in (0, 1); a take reads those below its class. nil: none.
	Shares []float64
	// Tenant names the tenant the take is for, when Weight is above 0: the
	// bucket's rate is shared between the tenants that wait, by weight
	// (see script.lua's tenants). TenantCap is the most tenants the bucket
	// keeps apart, of which this one is not sure to be one; 0 for a tenant
	// that always is.
	Tenant    string
	Weight    float64
	TenantCap int
	// Charge, for an adjust, is how much longer (µs) the tenant's take is
	// now reckoned to have held the bucket, below 0 when shorter: a settle
	// that gives tokens back gives the tenant's share that much back.
	Charge float64
}

// FairQueue is the longest queue of a bucket that a take for a tenant
// joins (script.lua's fairQueue).
const FairQueue = 250 * time.Millisecond

// MaxClass is the highest priority class.
const MaxClass = 7

// Tokens returns the Cost of n of every layer.
func Tokens(n float64) Cost { return Cost{N: n} }

// Of returns what c asks of layer i.
func (c Cost) Of(i int) float64 {
	if c.Each != nil {
		return c.Each[i]
	}
	return c.N
}

// Take takes n tokens from every layer of b when the wait for them is at
// most maxWait. A take of a bucket that has no take in flight in this
// store is sent at once; one that finds a take in flight joins the next
// call, shared with every take that queued meanwhile (see batches). The
// grant tells the round trips and the size of its call, also with an
// error.
func (s *Store) Take(ctx context.Context, b Bucket, n Cost, maxWait time.Duration) (Grant, error) {
	if s.batches == nil {
		g, err := s.takeOne(ctx, b, n, maxWait)
		g.Size = 0
		return g, err
	}
	return s.batches.take(s, ctx, b, n, maxWait)
}

// takeOne takes n from the layers of b in a call of its own.
func (s *Store) takeOne(ctx context.Context, b Bucket, n Cost, maxWait time.Duration) (Grant, error) {
	args := s.args(b, "take", s.argv.cost(n), s.argv.micros(maxWait.Microseconds()), nil, 1)
	if n.Class > 0 {
		args = append(args, s.channel) // announces the take's pushes
	}
	cmd, trips := s.script.Run(ctx, b.Call, args...)
	if err := cmd.Err(); err != nil {
		return Grant{Trips: trips, Size: 1}, err
	}
	if x, ok := cmd.Val().(int64); ok && x == 0 {
		return Grant{Outcome: Granted, Trips: trips, Size: 1}, nil // granted without a wait
	}
	v, err := cmd.Int64Slice()
	if err != nil {
		return Grant{Trips: trips, Size: 1}, fmt.Errorf("%w: %v", redisx.ErrReply, cmd.Val())
	}
	g, err := Decode(b, v)
	g.Trips, g.Size = trips, 1
	return g, err
}

// TakeCall returns the script's KEYS and ARGV of a take of n tokens from
// every layer of b with a longest wait of maxWait, for a script that runs
// this one's (internal/slots), and whose reply Decode reads.
func (s *Store) TakeCall(b Bucket, n Cost, maxWait time.Duration) (keys []string, args []any) {
	args = s.args(b, "take", s.argv.cost(n), s.argv.micros(maxWait.Microseconds()), nil, 1)
	if n.Class > 0 {
		args = append(args, s.channel)
	}
	return b.Call, args
}

// Source returns the bucket script's source, without the prelude.
func Source() string { return source }

// Decode reads the reply to a take of b, its integers in order: 0 alone
// when it was granted without a wait.
func Decode(b Bucket, v []int64) (Grant, error) {
	if len(v) == 1 && v[0] == 0 {
		return Grant{Outcome: Granted}, nil
	}
	k := len(b.Keys)
	rest := len(v) - (2 + 2*k + 2)
	if rest < 0 || rest%k != 0 || rest > MaxClass*k || !validOutcome(v[0], v[1]) {
		return Grant{}, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	g := Grant{
		Outcome: Outcome(v[0]),
		Wait:    time.Duration(v[1]) * time.Microsecond,
		Tats:    v[2 : 2+k : 2+k],
		Pos:     positions(v[2+k : 2+2*k]),
		Ev:      v[2+2*k],
		Now:     v[3+2*k],
	}
	if rest > 0 {
		g.Pushed = v[4+2*k:]
	}
	return g, nil
}

// validOutcome reports whether a caller's reply may begin with outcome
// and wait.
func validOutcome(outcome, wait int64) bool {
	return outcome > 0 && outcome < int64(maxOutcome) && wait >= 0
}

// positions returns a reply's positions as numbers, nil when they are
// all 0, as the script replies them for a take without a wait.
func positions(v []int64) []float64 {
	for _, p := range v {
		if p != 0 {
			pos := make([]float64, len(v))
			for i, p := range v {
				pos[i] = float64(p)
			}
			return pos
		}
	}
	return nil
}

// Refund hands back n of a take identified by its tats.
func (s *Store) Refund(ctx context.Context, b Bucket, n Cost, tats []int64) error {
	return s.do(ctx, b, "refund", s.argv.cost(n), 0, tats)
}

// Probe rewrites b as it is, to learn whether the server accepts writes.
func (s *Store) Probe(ctx context.Context, b Bucket) error {
	return s.do(ctx, b, "probe", 0, 0, nil)
}

// Resuming grants nothing from b before at (µs, on the scripts' clock),
// when the fleet leaves its local shares after an outage, to any Limiter,
// whether or not it saw the outage; of several such instants, the latest
// stands.
func (s *Store) Resuming(ctx context.Context, b Bucket, at int64) error {
	return s.do(ctx, b, "resuming", at, 0, nil)
}

// Pause grants nothing from b for d, as a provider's Retry-After asks: the
// bucket's one pause ends then at the latest, and the change is announced
// on the control channel.
func (s *Store) Pause(ctx context.Context, b Bucket, d time.Duration) error {
	return s.do(ctx, b, "pause", max(d.Microseconds(), 1), s.channel, nil)
}

// Lower leaves every layer of b at most remaining tokens, never raising it.
func (s *Store) Lower(ctx context.Context, b Bucket, remaining float64) error {
	for _, lim := range b.Lims {
		if remaining < lim.Burst {
			return s.do(ctx, b, "lower", redisx.Num(remaining), 0, nil)
		}
	}
	return nil // no layer holds more than that
}

// LowerEach leaves layer i of b at most remaining[i] tokens, never raising
// it; a remaining below zero leaves its layer as it is.
func (s *Store) LowerEach(ctx context.Context, b Bucket, remaining []float64) error {
	for i, lim := range b.Lims {
		if remaining[i] >= 0 && remaining[i] < lim.Burst {
			return s.do(ctx, b, "lower", s.argv.cost(Cost{Each: remaining}), 0, nil)
		}
	}
	return nil // no layer holds more than that
}

// Adjust takes n more tokens from b's layers at once, or gives back what
// is below zero. A non-empty id makes it count once however often it is
// sent (a client's retry after a lost reply): the script remembers the ids
// of the last minute.
func (s *Store) Adjust(ctx context.Context, b Bucket, n Cost, id string) error {
	return s.AdjustLower(ctx, b, n, nil, id)
}

// AdjustLower is Adjust that then, in the same call, leaves layer i at
// most remaining[i] tokens, as LowerEach does; nil remaining lowers
// nothing.
func (s *Store) AdjustLower(ctx context.Context, b Bucket, n Cost, remaining []float64, id string) error {
	withIDs := b
	withIDs.Call = append(slices.Clip(b.Call), b.Keys[0]+SettledSuffix)
	args := s.args(withIDs, "adjust", s.argv.cost(n), id, nil, 2)
	var lows any = ""
	if remaining != nil {
		lows = s.argv.cost(Cost{Each: remaining})
	}
	args = append(args, lows, s.channel)
	cmd, _ := s.script.Run(ctx, withIDs.Call, args...)
	if err := cmd.Err(); err != nil {
		return err
	}
	_, err := s.decode(cmd, withIDs)
	return err
}

// SettledSuffix follows a bucket's key in the key of its settles' ids.
const SettledSuffix = ":settled"

// do runs an operation whose reply says nothing but success.
func (s *Store) do(ctx context.Context, b Bucket, op string, x, y any, tats []int64) error {
	cmd, _ := s.run(ctx, b, op, x, y, tats)
	if err := cmd.Err(); err != nil {
		return err
	}
	_, err := s.decode(cmd, b)
	return err
}

// run runs the script on b's keys with ARGV op, x and y (see script.lua),
// the clock, and each layer's rate, burst and tat.
func (s *Store) run(ctx context.Context, b Bucket, op string, x, y any, tats []int64) (*redis.Cmd, int) {
	return s.script.Run(ctx, b.Call, s.args(b, op, x, y, tats, 0)...)
}

// args returns the ARGV of run, with room for spare more.
func (s *Store) args(b Bucket, op string, x, y any, tats []int64, spare int) []any {
	args := make([]any, 0, 4+3*len(b.Lims)+spare)
	args = append(args, op, x, y, s.Now())
	for i, lim := range b.Lims {
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
func (s *Store) decode(cmd *redis.Cmd, b Bucket) ([]int64, error) {
	v, err := cmd.Int64Slice()
	if err != nil || len(v) != 2+len(b.Keys) {
		return nil, fmt.Errorf("%w: %v", redisx.ErrReply, cmd.Val())
	}
	return v, nil
}

// Now returns the ARGV the scripts read as the time: empty for the
// server's clock, the callers' clock in microseconds otherwise.
func (s *Store) Now() string { return redisx.Now(s.clock) }

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

// cost returns n as the script reads it: one number, or one per layer,
// then "@" and its class when that is above 0, and the minimum shares of
// the classes below it when any has one.
func (c *argvCache) cost(n Cost) any {
	if n.Each == nil && n.Class == 0 && n.Weight <= 0 {
		return c.tokens(n.N)
	}
	b := make([]byte, 0, 8*max(len(n.Each), 1)+2+len(n.Tenant))
	if n.Each == nil {
		b = append(b, redisx.Num(n.N)...)
	}
	for i, x := range n.Each {
		if i > 0 {
			b = append(b, ' ')
		}
		b = append(b, redisx.Num(x)...)
	}
	if n.Class > 0 {
		b = append(b, '@')
		b = strconv.AppendInt(b, int64(n.Class), 10)
		if below := n.Shares[:min(n.Class, len(n.Shares))]; slices.ContainsFunc(below, func(m float64) bool { return m > 0 }) {
			for _, m := range below {
				b = append(b, ':')
				b = strconv.AppendFloat(b, m, 'f', -1, 64)
			}
		}
	}
	if n.Weight > 0 {
		// "|", the weight, "|", the cap, "|", the charge or nothing, "|"
		// and the tenant, last: a tenant's name may hold any byte.
		b = append(b, '|')
		b = strconv.AppendFloat(b, n.Weight, 'f', -1, 64)
		b = append(b, '|')
		b = strconv.AppendInt(b, int64(n.TenantCap), 10)
		b = append(b, '|')
		if n.Charge != 0 {
			b = strconv.AppendFloat(b, n.Charge, 'f', 0, 64)
		}
		b = append(b, '|')
		b = append(b, n.Tenant...)
	}
	return string(b)
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
