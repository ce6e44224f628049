package quota

import (
	"context"
	"fmt"
	"math"
	"slices"
	"sync"
	"time"

	"github.com/sharedquota/quota/internal/store"
	"github.com/sharedquota/quota/internal/updates"
	"github.com/sharedquota/quota/internal/usage"
)

// A Meter is one of the limits a provider meters requests on, when a
// request counts a different amount against each: an LLM API meters
// requests, input tokens and output tokens a minute at once. Each Meter of
// a bucket is a layer of its own under a key that names it, and a request
// takes its amount from every one in one script call, all or nothing,
// waiting as long as the slowest.
//
// The first Meter is the bucket's first layer: SetLimit and the CLI's
// limit change it, and a Retry-After pauses the whole bucket.
type Meter struct {
	Name  string // 1 to 64 letters, digits, '_', '-' or '.': "input_tokens"
	Limit Limit
}

// Usage is what a request uses of each of its bucket's Meters, by name:
// Usage{"requests": 1, "input_tokens": 1200, "output_tokens": 1024}.
type Usage map[string]float64

// Reserve waits until the amounts use gives are the caller's in every
// Meter of the bucket called name, and returns them as a Reservation to
// settle once the request's real usage is known. A Meter that use leaves
// out, or gives 0, is taken nothing from and does not hold the caller;
// use must name no Meter the bucket lacks.
//
// The wait is WaitN's: first come, first served across the fleet,
// coalesced with the bucket's other takes, bounded by ctx's deadline or
// MaxWait, under the bucket's pause, and the Policy's while Redis is
// unavailable. Invalid Meters or amounts fail at once with an error
// matching ErrInvalidLimit, ErrInvalidTokens or ErrExceedsBurst.
func (l *Limiter) Reserve(ctx context.Context, name string, meters []Meter, use Usage) (*Reservation, error) {
	o, err := meterAsk(meters, use)
	if err != nil {
		return nil, err
	}
	if _, err := l.acquire(ctx, name, o); err != nil {
		return nil, err
	}
	return &Reservation{l: l, ctx: context.WithoutCancel(ctx), name: name, o: o}, nil
}

// meterAsk returns the ask of use from meters, checked.
func meterAsk(meters []Meter, use Usage) (ask, error) {
	if len(meters) == 0 {
		return ask{}, fmt.Errorf("%w: no Meter given", ErrInvalidLimit)
	}
	o := ask{
		each:   make([]float64, len(meters)),
		meters: make([]string, len(meters)),
		lims:   make([]Limit, len(meters)),
		class:  -1,
	}
	for i, m := range meters {
		if err := store.CheckMeter(m.Name); err != nil {
			return ask{}, fmt.Errorf("%w: %w", ErrInvalidLimit, err)
		}
		for _, other := range meters[:i] {
			if other.Name == m.Name {
				return ask{}, fmt.Errorf("%w: meter %q given twice", ErrInvalidLimit, m.Name)
			}
		}
		n := use[m.Name]
		if !(n >= 0) || math.IsInf(n, 0) {
			return ask{}, fmt.Errorf("%w: %v of meter %q, want a finite number, zero or more", ErrInvalidTokens, n, m.Name)
		}
		o.each[i], o.meters[i], o.lims[i] = n, m.Name, m.Limit
	}
	for k := range use {
		if !slices.ContainsFunc(meters, func(m Meter) bool { return m.Name == k }) {
			return ask{}, fmt.Errorf("%w: no meter %q among the bucket's", ErrInvalidTokens, k)
		}
	}
	o.n = o.each[0]
	return o, nil
}

// A Reservation is what a request took of its bucket's Meters before its
// real usage was known. Settle it with the usage, or Cancel it when the
// request never reached the provider; left alone, it keeps what it took.
type Reservation struct {
	l    *Limiter
	ctx  context.Context // the caller's values, for the settle's span
	name string
	o    ask
	once sync.Once
	// maxPause bounds a settle (see Settle): the Transport's WithMaxPause,
	// or 0 for DefaultMaxPause.
	maxPause time.Duration
	// kept[i]: the provider never gives back what meter i reserved, so
	// neither does a settle (Metering.NoGiveBack); nil: none.
	kept []bool
	// lows, when not nil, is what the provider said remains of each meter
	// at lowsAt (below zero: it did not say), to lower them with the
	// settle's call.
	lows   []float64
	lowsAt time.Time
}

// Reserved returns what the Reservation took of each Meter.
func (r *Reservation) Reserved() Usage {
	u := make(Usage, len(r.o.meters))
	for i, m := range r.o.meters {
		u[m] = r.o.each[i]
	}
	return u
}

// Settle tells the bucket what the request really used: of each Meter
// that used names, it takes what the reservation missed, or gives back
// what it overcounted; a Meter used leaves out keeps its reservation, as
// do amounts that are not finite numbers of zero or more. The update is
// one script call in the background: Settle returns at once. A settle
// takes at most what the Meter refills in the longest pause a provider
// may put on the bucket (WithMaxPause, DefaultMaxPause when pauses are
// off); the rest is counted in quota.settle.cut. Only the first Settle or
// Cancel of a Reservation counts, and Redis counts it once however often
// go-redis sends it.
func (r *Reservation) Settle(used Usage) {
	if r == nil {
		return
	}
	r.once.Do(func() {
		extra := usage.Extra(r.o.meters, r.o.each, used, r.kept)
		r.l.adjust(r.ctx, r.name, r.o, extra, r.lowsNow(extra), r.maxPause)
	})
}

// Cancel gives back everything the Reservation took, for a request that
// never reached the provider. Only the first Settle or Cancel counts.
func (r *Reservation) Cancel() {
	if r == nil {
		return
	}
	r.once.Do(func() {
		extra := make([]float64, len(r.o.each))
		for i, n := range r.o.each {
			extra[i] = -n
		}
		r.l.adjust(r.ctx, r.name, r.o, extra, r.lows, r.maxPause)
	})
}

// lower sends alone the lows a settle was to carry, for a response whose
// usage was never known.
func (r *Reservation) lower() {
	if r == nil || r.lows == nil {
		return
	}
	r.once.Do(func() {
		none := make([]float64, len(r.o.each))
		r.l.adjust(r.ctx, r.name, r.o, none, r.lowsNow(none), r.maxPause)
	})
}

// lowsNow returns what the provider's meters hold now, as r.lows said of
// them at r.lowsAt, a settle's extra taken (see usage.Lows).
func (r *Reservation) lowsNow(extra []float64) []float64 {
	return usage.Lows(r.lows, r.lowsAt, func(i int) float64 { return r.o.lims[i].Rate }, extra)
}

// adjust takes extra[i] more from each layer of the bucket of o, or gives
// back what is below zero, and lowers layer i to lows[i] when lows is not
// nil and lows[i] is not below zero, in one call in the background,
// bounded as Settle says with maxPause. It does nothing while Redis is
// unavailable: the local shares know no debt.
func (l *Limiter) adjust(ctx context.Context, name string, o ask, extra, lows []float64, maxPause time.Duration) {
	if l.Mode() != ModeShared {
		return
	}
	b, err := l.inForce(name, o.lims, o.meters)
	if err != nil {
		return // cannot be: the take resolved the same bucket
	}
	if u, ok := l.settle(ctx, b, o, extra, lows, maxPause); ok {
		l.startUpdates(ctx, b, []updates.Update{u})
	}
}

// settle returns the update of a settle of o on b, the one settle path of
// WithSettle and of Reservations: it takes extra[i] more from layer i, at
// most what the layer refills in maxPause (see usage.Bound), counting the
// rest as cut, gives back what is below zero, charges o's tenant for what
// it used, and lowers the layers to lows (see adjust). It reports false
// when there is nothing to do.
func (l *Limiter) settle(ctx context.Context, b bucket, o ask, extra, lows []float64, maxPause time.Duration) (updates.Update, bool) {
	if maxPause <= 0 {
		maxPause = DefaultMaxPause // pauses off: the bound is the default's
	}
	some := false
	for i := range extra {
		if bound := usage.Bound(b.limit(i).Rate, maxPause); extra[i] > bound {
			l.obs.Cut(ctx, b.Name, extra[i]-bound)
			extra[i] = bound
		}
		some = some || extra[i] != 0
	}
	if !some && lows == nil {
		return updates.Update{}, false
	}
	c := store.Cost{N: extra[0], Each: extra}
	asked := o.cost()
	used := make([]float64, len(extra))
	for i := range extra {
		used[i] = max(asked.Of(i)+extra[i], 0)
	}
	l.charge(ctx, b, o, store.Cost{Each: used}, &c)
	if b.ctl != nil {
		l.controls.Count(b.ctl, time.Now(), 0, extra) // the fleet's rate counts what was used
	}
	id := usage.SettleID()
	return updates.Update{Kind: updates.Settle, Run: func(ctx context.Context) error {
		return l.store.AdjustLower(ctx, b.Bucket, c, lows, id)
	}}, true
}

// inForce returns the bucket called name with layers lims (metering
// meters, when not nil) under the control record the Limiter knows.
func (l *Limiter) inForce(name string, lims []Limit, meters []string) (bucket, error) {
	b, err := l.bucket(name, lims, meters...)
	if err != nil {
		return b, err
	}
	if e := l.controls.Lookup(b.Keys[0]); e != nil {
		b.ctl, b.passed = e, b.limit(0)
		b = b.under(e)
	}
	return b, nil
}
