package store

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
)

// A Cost is what an operation asks of each layer of a bucket: N of every
// layer or, when Each is set, Each[i] of layer i (a bucket whose layers
// meter different things: requests, input tokens, output tokens).
type Cost struct {
	N     float64
	Each  []float64 // nil, or one per layer
	Class int       // the take's priority class, 0 to MaxClass (see classes.lua)
	// Shares are the classes' minimum shares of the rate, by class, 0 or
	// in (0, 1); a take reads those below its class. nil: none.
	Shares []float64
	// Tenant names the tenant the take is for, when Weight is above 0: the
	// bucket's rate is shared between the tenants that wait, by weight
	// (see tenants.lua). TenantCap is the most tenants the bucket keeps
	// apart, of which this one is not sure to be one; 0 for a tenant that
	// always is.
	Tenant    string
	Weight    float64
	TenantCap int
	// Charge, for an adjust, is how much longer (µs) the tenant's take is
	// now reckoned to have held the bucket, below 0 when shorter: a settle
	// that gives tokens back gives the tenant's share that much back.
	Charge float64
	// Since, for a take held before, is when it was first held, µs on
	// the server's clock (its Grant's Now); 0 for one never held. The
	// oldest held take of a tenant is admitted before the tenant's
	// others (see tenants.lua).
	Since int64
}

// FairQueue is the longest queue of a bucket that a take for a tenant
// joins (tenants.lua's fairQueue).
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

// An Outcome is what a take came to.
type Outcome uint8

// The outcomes of a take, as the take's script replies them (script.lua).
const (
	_        Outcome = iota
	Granted          // the tokens were taken; Wait is until they have accrued
	TooLong          // the wait would exceed the caller's; nothing was taken, Wait is what it would have been
	Paused           // the bucket is paused until a resume; nothing was taken
	Resuming         // the fleet has yet to leave its local shares after an outage; nothing was taken
	Crowded          // the take would push a lower class past its minimum share; nothing was taken, Wait is until it has room
	Held             // another tenant's turn, or the bucket's queue is full (see tenants.lua); nothing was taken, Wait is until the take may be admitted
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
	Tats    []int64       // µs, a layer each; identify the take for its refund (nil when granted without a wait)
	Pos     []float64     // the grant's position in each layer's timeline (see Anchor); nil without a wait
	Ev      int64         // the count of the bucket's timeline's moves when the take ran
	Now     int64         // when the take ran, µs on the server's clock (0 without a wait)
	Pushed  []int64       // how far pushes had moved each class's queue in each layer, class 0's first, k each; nil on a bucket no class above 0 took from
	Trips   int           // the Redis round trips of its call
	Size    int           // the takes its call served, when takes share calls; 0 otherwise or when none was sent
}

// Granted reports whether the take was granted.
func (g Grant) Granted() bool { return g.Outcome == Granted }

// CostTime returns how long c takes to accrue at the rate of b's slowest
// layer for it; a daily layer's count is no time.
func (b Bucket) CostTime(c Cost) time.Duration {
	var d time.Duration
	for i, lim := range b.Lims {
		if lim.Zone == nil {
			d = max(d, time.Duration(c.Of(i)/lim.Rate*float64(time.Second)))
		}
	}
	return d
}

// TatsMoved returns the tats that identify the take of g for its refund
// once a pause (or a change) has moved its grant d later.
func (g Grant) TatsMoved(d time.Duration) []int64 {
	if d == 0 || g.Tats == nil {
		return g.Tats
	}
	tats := slices.Clone(g.Tats)
	for i := range tats {
		tats[i] += d.Microseconds()
	}
	return tats
}

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
	cmd, trips := s.takeScript.Run(ctx, b.Call, s.takeArgs(b, caller{n, maxWait})...)
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

// TakeCall returns the KEYS and ARGV of the take's script for a take of n
// from b with a longest wait of maxWait, for a script that runs the take
// inside its own (internal/slots, see TakeSource), and whose reply Decode
// reads.
func (s *Store) TakeCall(b Bucket, n Cost, maxWait time.Duration) (keys []string, args []any) {
	return b.Call, s.takeArgs(b, caller{n, maxWait})
}

// The take's ARGV (script.lua), by name: the call's, then each caller's
// from takeCallers on, each in the form's stride, then the layers'
// Limits.
const (
	takeOp      = iota // "take"
	takeNow            // now in µs, or "" for the server's clock
	takeForm           // what each caller's ARGV hold (core.lua's uses): usesPlain, usesClass or usesTenant
	takeChannel        // announces the takes' pushes; "" for none
	takeCallers        // the first caller's first
)

// What a call uses beyond the scripts' core (core.lua's ARGV[3]), which
// for a take is the form of its callers: the ARGV each caller has before
// its amount of each layer are its longest wait; and its class and the
// classes' minimum shares; and its tenant, the tenant's weight and cap,
// and when the take was first held.
const (
	usesPlain  = "plain"
	usesClass  = "class"
	usesTenant = "tenant"
)

// A caller is one caller's part of a take: its tokens and its longest
// wait.
type caller struct {
	n       Cost
	maxWait time.Duration
}

// takeArgs returns the ARGV of a take of b for callers, served in their
// order.
func (s *Store) takeArgs(b Bucket, callers ...caller) []any {
	k := len(b.Lims)
	form, stride, channel := usesPlain, 1+k, ""
	for _, c := range callers {
		switch {
		case c.n.Weight > 0:
			form, stride = usesTenant, 7+k
		case c.n.Class > 0 && form == usesPlain:
			form, stride = usesClass, 3+k
		}
		if c.n.Class > 0 {
			channel = s.channel
		}
	}
	args := make([]any, takeCallers, takeCallers+len(callers)*stride+2*k)
	args[takeOp], args[takeNow], args[takeForm], args[takeChannel] = "take", s.Now(), form, channel
	for _, c := range callers {
		args = append(args, s.argv.micros(c.maxWait.Microseconds()))
		if form != usesPlain {
			args = append(args, c.n.Class, shares(c.n))
		}
		if form == usesTenant {
			var weight any = 0
			if c.n.Weight > 0 {
				weight = strconv.FormatFloat(c.n.Weight, 'f', -1, 64)
			}
			args = append(args, c.n.Tenant, weight, c.n.TenantCap, c.n.Since)
		}
		for i := range k {
			args = append(args, s.argv.tokens(c.n.Of(i)))
		}
	}
	for _, lim := range b.Lims {
		rate, burst := s.limit(lim)
		args = append(args, rate, burst)
	}
	return args
}

// shares returns the minimum shares of the classes below n's, as the
// take's script reads them: separated by spaces, "" when none has one.
func shares(n Cost) string {
	below := n.Shares[:min(n.Class, len(n.Shares))]
	if !slices.ContainsFunc(below, func(m float64) bool { return m > 0 }) {
		return ""
	}
	b := make([]byte, 0, 8*len(below))
	for i, m := range below {
		if i > 0 {
			b = append(b, ' ')
		}
		b = strconv.AppendFloat(b, m, 'f', -1, 64)
	}
	return string(b)
}

// Decode reads the reply to a take of b for one caller, its integers in
// order: 0 alone when it was granted without a wait.
func Decode(b Bucket, v []int64) (Grant, error) {
	if len(v) == 1 && v[0] == 0 {
		return Grant{Outcome: Granted}, nil
	}
	var g Grant
	err := decode(len(b.Keys), 1, v, func(_ int, r Grant) { g = r })
	return g, err
}

// decode reads the table reply to a take of callers callers from k
// layers (see script.lua), and tells each caller's Grant in order.
func decode(k, callers int, v []int64, each func(c int, g Grant)) error {
	stride := 2 + 2*k
	rest := len(v) - stride*callers
	if rest < 2 || (rest-2)%k != 0 || rest-2 > MaxClass*k {
		return fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	for c := range callers {
		if r := v[c*stride:]; !(r[0] > 0 && r[0] < int64(maxOutcome) && r[1] >= 0) {
			return fmt.Errorf("%w: %v", redisx.ErrReply, v)
		}
	}
	trailer := v[stride*callers:]
	var pushed []int64
	if len(trailer) > 2 {
		pushed = trailer[2:]
	}
	for c := range callers {
		r := v[c*stride : (c+1)*stride : (c+1)*stride]
		g := Grant{
			Outcome: Outcome(r[0]),
			Wait:    time.Duration(r[1]) * time.Microsecond,
			Pos:     positions(r[2+k:]),
			Ev:      trailer[0],
			Now:     trailer[1],
			Pushed:  pushed,
		}
		if g.Outcome != Granted || g.Wait != 0 {
			g.Tats = r[2 : 2+k : 2+k]
		}
		each(c, g)
	}
	return nil
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
