package status

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// What Redis holds of a bucket is laid out by internal/store (its layers'
// keys and its control record, whose fields core.lua lists) and
// internal/slots (its slots' keys). read reads them all in two pipelines
// to the node of the bucket's hash slot: the clock and the record, then
// the layers the record names and the slots, and reckons from them as the
// scripts do.
func read(ctx context.Context, rdb redis.Cmdable, prefix, name string, at time.Time) (Bucket, error) {
	if name == "" {
		return Bucket{}, errors.New("status: an empty bucket name")
	}
	key := store.Key(prefix, name)
	var clock *redis.TimeCmd
	var record *redis.MapStringStringCmd
	if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		if at.IsZero() {
			clock = p.Time(ctx)
		}
		record = p.HGetAll(ctx, key+store.ControlSuffix)
		return nil
	}); err != nil {
		return Bucket{}, err
	}
	if clock != nil {
		at = clock.Val()
	}
	r := rec{f: record.Val(), now: at.UnixMicro()}
	b := Bucket{Name: name, Now: time.UnixMicro(r.now)}

	suffixes := append([]string{""}, strings.Fields(r.f["layers"])...)
	tats := make([]*redis.StringCmd, len(suffixes))
	var held, waiting *redis.IntCmd
	now := strconv.FormatInt(r.now, 10)
	cmds, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, sfx := range suffixes {
			tats[i] = p.Get(ctx, key+sfx)
		}
		held = p.ZCount(ctx, key+slots.HeldSuffix, "("+now, "+inf")
		waiting = p.ZCount(ctx, key+slots.WaitingSuffix, "("+now, "+inf")
		return nil
	})
	for _, c := range cmds {
		if err := c.Err(); err != nil && err != redis.Nil {
			return Bucket{}, err
		}
	}
	if err != nil && err != redis.Nil {
		return Bucket{}, err
	}
	b.Slots = Slots{Held: int(held.Val()), Waiting: int(waiting.Val())}

	b.PausedSince, b.PausedUntil, b.PausedBy, b.Paused = r.pause()
	if resume := r.num("resume"); resume > float64(r.now) {
		b.ResumesAt = time.UnixMicro(int64(resume))
	}
	for i, sfx := range suffixes {
		l, ok := r.layer(i, sfx, tats[i].Val())
		if !ok {
			if i == 0 {
				break // no Limit known for the first: the others mean nothing alone
			}
			continue
		}
		b.Layers = append(b.Layers, l)
	}
	if len(b.Layers) > 0 {
		b.Classes = r.classes(b.Layers[0])
	}
	b.Tenants = r.tenants()
	b.Limiters, b.Slots.Lingering = r.limiters()
	if err := errors.Join(r.errs...); err != nil {
		return Bucket{}, fmt.Errorf("status: bucket %q: an unreadable record: %w", name, err)
	}
	return b, nil
}

// rec is a control record as read: its fields, the server's clock (µs),
// and what could not be read in it.
type rec struct {
	f    map[string]string
	now  int64
	errs []error
}

// num returns the record's field as a number, 0 when absent.
func (r *rec) num(field string) float64 {
	s, ok := r.f[field]
	if !ok {
		return 0
	}
	v, err := strconv.ParseFloat(s, 64)
	if err != nil {
		r.errs = append(r.errs, fmt.Errorf("%s: %w", field, err))
	}
	return v
}

// pause returns the pause in force, if any, as the scripts read it.
func (r *rec) pause() (since, until time.Time, by string, paused bool) {
	if _, ok := r.f["since"]; !ok {
		return
	}
	s, u := r.num("since"), r.f["until"]
	if u != "forever" {
		end := r.num("until")
		if end <= float64(r.now) {
			return
		}
		until = time.UnixMicro(int64(end))
	}
	return time.UnixMicro(int64(s)), until, r.f["src"], true
}

// shifted returns how far the pause in force moved the layers' queues: a
// layer's queue as it stands before the pause moved it is its tat less
// that (core.lua).
func (r *rec) shifted() float64 {
	if _, _, _, paused := r.pause(); paused {
		return r.num("shifted")
	}
	return 0
}

// layer returns layer i, whose key ends in sfx and holds tat ("" for
// none: a full layer), or false when its Limit is not known.
func (r *rec) layer(i int, sfx, tat string) (Layer, bool) {
	var l Layer
	switch {
	case i == 0 && r.f["rate"] != "":
		l.Rate, l.Burst, l.Override, l.Meter = r.num("rate"), r.num("burst"), true, r.f["meter"]
	case i == 0:
		rate, burst, ok := strings.Cut(r.f["seen"], " ")
		if !ok || rate == "" { // none told
			return Layer{}, false
		} else if strings.HasPrefix(rate, "d") {
			return r.daily(l, rate, burst, sfx, tat)
		}
		l.Rate, l.Burst, l.Meter = parse(&r.errs, rate), parse(&r.errs, burst), r.f["meter"]
	default:
		lim := strings.TrimPrefix(sfx, ":")
		if meter, rest, ok := strings.Cut(lim, ":"); ok {
			l.Meter, lim = meter, rest
		}
		rate, burst, _ := strings.Cut(lim, "/")
		if strings.HasPrefix(rate, "d") {
			return r.daily(l, rate, burst, sfx, tat)
		}
		l.Rate, l.Burst = parse(&r.errs, rate), parse(&r.errs, burst)
	}
	if !(l.Rate > 0 && l.Burst > 0) {
		return Layer{}, false
	}
	if s := r.f["l:"+sfx]; s != "" && !l.Override {
		if lr := parse(&r.errs, s); lr > 0 && lr < l.Rate {
			l.Learned = r.learned(sfx, l.Rate)
			l.Rate, l.Burst = lr, max(1, l.Burst*lr/l.Rate) // at the Limit's time to fill
		}
	}
	l.Tokens, l.Queue = l.Burst, 0
	if tat != "" {
		l.Tokens, l.Queue = level(l, parse(&r.errs, tat)-r.shifted(), r.now)
	}
	l.Granted, l.GrantedUntil = r.history(sfx)
	return l, true
}

// daily returns the daily layer (internal/daily) l whose key ends in sfx,
// spec (daily.Key) and count n naming it, and which holds tat: its count
// today and tomorrow, as daily.lua reads them.
func (r *rec) daily(l Layer, spec, n, sfx, tat string) (Layer, bool) {
	count := parse(&r.errs, n)
	at, loc, err := daily.ParseKey(spec)
	if !(count > 0) || at < 0 {
		return Layer{}, false
	}
	l.Rate, l.Burst, l.Tokens = daily.Rate(count), count, count
	l.Daily = &Daily{Reset: at, Zone: strings.ReplaceAll(spec[strings.IndexByte(spec, '@')+1:], ".", "/")}
	if err == nil {
		d := l.Daily
		d.Zone = loc.String()
		v := 0.0
		if tat != "" {
			v = parse(&r.errs, tat)
		}
		d.Used, d.Tomorrow, d.Ends = daily.Count(v, time.UnixMicro(r.now), count, at, loc)
		l.Tokens = count - d.Used
		if d.Used >= count {
			l.Queue = d.Ends.Sub(time.UnixMicro(r.now)) // the next take counts against tomorrow
		}
	}
	l.Granted, l.GrantedUntil = r.history(sfx)
	return l, true
}

// learned returns what the fleet learned of the layer whose key ends in
// sfx, of a Limit of rate limit: its record's m:<sfx>, "<peak> <cut>
// <step> <cross> <floor> <rise> <top> <why>" (internal/store's
// learn.lua).
func (r *rec) learned(sfx string, limit float64) *Learned {
	f := strings.Fields(r.f["m:"+sfx])
	if len(f) < 7 {
		return &Learned{Ceiling: limit}
	}
	l := &Learned{Ceiling: limit, CutFrom: parse(&r.errs, f[0]), Floor: parse(&r.errs, f[4]) * limit}
	if top := parse(&r.errs, f[6]); top > 0 && top < limit {
		l.Ceiling = top // a RateLimit-Policy's
	}
	if cut := int64(parse(&r.errs, f[1])); cut > 0 {
		l.CutAt = time.UnixMicro(cut).UTC()
	}
	if len(f) > 7 {
		l.Why = f[7]
	}
	return l
}

// level returns what layer l holds at now when its tat is tat (µs), and
// how long a caller arriving then would wait, pauses aside.
func level(l Layer, tat float64, now int64) (tokens float64, queue time.Duration) {
	owed := (tat - float64(now)) / 1e6
	if owed <= 0 {
		return l.Burst, 0
	}
	return l.Burst - owed*l.Rate, max(0, time.Duration((owed-l.Burst/l.Rate)*1e9)).Round(time.Microsecond)
}

// settled is how long after a second ends it is counted whole: a
// Limiter tells its grants with its next read of the record, within a
// second (internal/control's Refresh), and the read may take as long
// again.
const settled = 3

// history returns the grants of the layer whose key ends in sfx, by
// second, up to the last second counted whole, and when that second ended.
// The record keeps them as "<latest second> <its grants> <the second
// before's> ..." (record.lua's tally).
func (r *rec) history(sfx string) ([]float64, time.Time) {
	last := r.now/1e6 - settled // the last second counted whole
	g := make([]float64, History)
	f := strings.Fields(r.f["h:"+sfx])
	if len(f) > 0 {
		top := int64(parse(&r.errs, f[0]))
		for j, v := range f[1:] {
			sec := top - int64(j)
			if back := last - sec; back >= 0 && back < History {
				g[History-1-back] = parse(&r.errs, v)
			}
		}
	}
	return g, time.Unix(last+1, 0)
}

// classes returns the priority classes with a queue or pushed back in the
// first layer l, the highest first. Class c's tail is t<c>: (for c above
// 0; class 0's is the layer's own), and how far it was pushed, in
// positions of the layer's timeline, p<c>: (classes.lua).
func (r *rec) classes(l Layer) []Class {
	pmax := int(r.num("pmax"))
	if pmax == 0 {
		return nil // no class but 0 took from the bucket
	}
	scale := 1.0
	if a := strings.Fields(r.f["a:"]); len(a) == 3 {
		scale = parse(&r.errs, a[2])
	}
	var cs []Class
	for c := pmax; c >= 0; c-- {
		cl := Class{Priority: c, Queue: l.Queue}
		if c > 0 {
			if t, ok := r.f["t"+strconv.Itoa(c)+":"]; ok {
				_, cl.Queue = level(l, parse(&r.errs, t)-r.shifted(), r.now)
			} else {
				cl.Queue = 0
			}
		}
		if c < pmax {
			cl.Pushed = time.Duration(r.num("p"+strconv.Itoa(c)+":") * scale * 1e3).Round(time.Microsecond)
		}
		if cl.Queue > 0 || cl.Pushed > 0 {
			cs = append(cs, cl)
		}
	}
	return cs
}

// tenants returns the tenants the record holds, f:<tenant> = "<finish>
// <weight> <waiting until> <asked last> <ticket> <ticket> <ticket>
// <granted>" (tenants.lua).
func (r *rec) tenants() []Tenant {
	var ts []Tenant
	total := 0.0
	for field, v := range r.f {
		name, ok := strings.CutPrefix(field, "f:")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) < 4 {
			r.errs = append(r.errs, fmt.Errorf("%s: %q", field, v))
			continue
		}
		t := Tenant{Name: name, Weight: parse(&r.errs, f[1]), Waiting: parse(&r.errs, f[2]) >= float64(r.now)}
		if len(f) >= 8 {
			t.Granted = parse(&r.errs, f[7])
		}
		total += t.Granted
		ts = append(ts, t)
	}
	slices.SortFunc(ts, func(a, b Tenant) int { return cmp.Compare(a.Name, b.Name) })
	for i := range ts {
		if total > 0 {
			ts[i].Share = ts[i].Granted / total
		}
	}
	return ts
}

// limiters returns the ids of the Limiters whose use has not lapsed, and
// the slots they hold lingering: u:<id> holds until when, in ms, and
// those slots when there are any (record.lua).
func (r *rec) limiters() (ids []string, lingering int) {
	for field, v := range r.f {
		id, ok := strings.CutPrefix(field, "u:")
		until, n, _ := strings.Cut(v, " ")
		if ok && parse(&r.errs, until) > float64(r.now/1000) {
			ids = append(ids, id)
			if n != "" {
				lingering += int(parse(&r.errs, n))
			}
		}
	}
	slices.Sort(ids)
	return ids, lingering
}

// parse reads a number, adding its error to errs.
func parse(errs *[]error, s string) float64 {
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		*errs = append(*errs, fmt.Errorf("a number %q", s))
	}
	return v
}
