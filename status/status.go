// Package status reads a bucket of package github.com/sharedquota/quota
// whole from Redis, as an operator asks of it: how close the fleet is to
// each limit, who waits, and why. quota.Limiter.Status and the quotactl
// command read through it.
//
// It reads with two pipelined round trips to the node of the bucket's hash
// slot, no script and nothing that blocks Redis, and writes nothing: a
// bucket no Limiter used lately reads as the zero Bucket but for its name
// and the clock.
package status

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

// A Bucket is what Redis holds of one bucket.
type Bucket struct {
	// Name is the bucket's name.
	Name string
	// Now is the server's clock when it was read.
	Now time.Time
	// Layers are the bucket's layers, the first layer's first: one for
	// each Limit a request obeys (quota.WithLayers) or each thing it
	// meters (quota.Metering). A layer the fleet's Limiters did not name
	// lately is missing; no layer at all when none used the bucket lately
	// and there is no override.
	Layers []Layer
	// Paused tells whether a pause is in force; PausedSince is when it
	// began and PausedUntil when it ends, the zero Time for a pause with
	// no end. PausedBy tells who set its end: "provider" (a Retry-After,
	// or none remaining until a reset) or "operator" (quota.Limiter.Pause).
	Paused      bool
	PausedSince time.Time
	PausedUntil time.Time
	PausedBy    string
	// ResumesAt is when the fleet leaves its local shares after an outage
	// of Redis (quota.FallbackLocal): no grant is given before it. The
	// zero Time when none is ahead.
	ResumesAt time.Time
	// Classes are the priority classes with a queue, the highest first
	// (quota.ContextWithPriority); class 0 is among them when a higher
	// class pushed it.
	Classes []Class
	// Tenants are the tenants that asked lately (quota.WithTenants),
	// in order of name.
	Tenants []Tenant
	// Slots are the bucket's concurrency slots (quota.WithConcurrency).
	Slots Slots
	// Limiters are the ids of the Limiters that used the bucket in the
	// last five seconds: "host/pid/random", in order.
	Limiters []string
}

// A Layer is one of a bucket's layers.
type Layer struct {
	// Meter is what the layer meters when each layer meters its own
	// (quota.Metering: "requests", then the Meters'); "" when every layer
	// counts a request's one cost.
	Meter string
	// Rate and Burst are the layer's Limit in force: tokens a second, and
	// the most it holds. Override tells whether it is an operator's
	// (quota.Limiter.SetLimit), which only the first layer may have;
	// Learned, when not nil, that it is a rate the fleet learned below
	// the layer's Limit (quota.Adaptive).
	Rate     float64
	Burst    float64
	Override bool
	Learned  *Learned
	// Daily, when not nil, tells that the layer is a daily quota
	// (quota.Daily), a count and not a rate: Rate is its average, Burst
	// its count, and Tokens what is left of it today. A first layer's is
	// not told: its record names no count.
	Daily *Daily
	// Tokens is what the layer holds now, out of Burst; below zero when
	// grants are queued beyond it. Queue is how long until the last grant
	// already given falls due: how long a caller arriving now would wait,
	// pauses aside.
	Tokens float64
	Queue  time.Duration
	// Granted is what the layer granted in each of the last History
	// seconds (tokens that callers went on, net of what settles gave
	// back), the oldest first; the last is the second that ended at
	// GrantedUntil. The fleet's Limiters tell their grants within a
	// second, so a second is counted once it is three seconds past.
	Granted      []float64
	GrantedUntil time.Time
}

// Learned is what the fleet learned of the provider's real limit below a
// layer's Limit (quota.Adaptive): the layer's Rate is the rate learned.
type Learned struct {
	// Floor and Ceiling bound the rate: the least it may be cut to, and
	// the layer's Limit's rate, where it stops learning, or the rate the
	// provider's RateLimit-Policy allows when lower.
	Floor, Ceiling float64
	// CutAt is when a refusal last cut it, from the rate CutFrom, and Why
	// that refusal's status ("429"); zero and "" for none (a policy's).
	CutAt   time.Time
	CutFrom float64
	Why     string
}

// Daily is what a daily quota (quota.Daily) counted.
type Daily struct {
	// Reset is the time of day it refills at, in the zone named Zone.
	Reset time.Duration
	Zone  string
	// Used is what it counted today, out of the layer's Burst; Tomorrow,
	// what the takes that found today spent counted against the next day.
	Used, Tomorrow float64
	// Ends is when today ends and the count refills. It is the zero Time,
	// and Used and Tomorrow are 0, when this machine does not know the
	// zone (its time zone database lacks it).
	Ends time.Time
}

// History is the most seconds a Layer's Granted holds.
const History = 60

// PerSecond returns what the layer granted a second over the last n
// seconds of Granted (all of them when fewer), or 0 for none.
func (l Layer) PerSecond(n int) float64 {
	g := l.Granted[max(0, len(l.Granted)-n):]
	if len(g) == 0 {
		return 0
	}
	sum := 0.0
	for _, v := range g {
		sum += v
	}
	return sum / float64(len(g))
}

// A Class is a priority class with a queue, in the bucket's first layer.
type Class struct {
	Priority int
	// Queue is how long a take of the class arriving now would wait,
	// pauses aside: behind the grants of its class and those above.
	Queue time.Duration
	// Pushed is how far the takes of higher classes have pushed the
	// class's grants back, in all, since its record was made.
	Pushed time.Duration
}

// A Tenant is a tenant that asked of the bucket lately.
type Tenant struct {
	// Name is the tenant's, "" for the tenants the Limiters do not keep
	// apart (quota.Tenants.Max).
	Name   string
	Weight float64
	// Waiting tells whether some of its takes wait for their turn.
	Waiting bool
	// Granted is what the first layer granted it since it last asked
	// after a pause of its own; Share is that out of what every tenant
	// read was granted, 0 to 1.
	Granted float64
	Share   float64
}

// Slots are a bucket's concurrency slots.
type Slots struct {
	// Held are the slots held, their leases alive; Waiting, the callers
	// queued for one.
	Held, Waiting int
	// Lingering are those of Held whose requests ended while the provider
	// may still work on them (quota.WithSlotLinger), as the Limiters that
	// hold them told with their last read of the record, within a second.
	Lingering int
}

// Read reads the bucket called name under prefix (quota.WithPrefix) from
// rdb: a *redis.Client or a *redis.ClusterClient, as the Limiters use. Now
// is the server's clock (TIME).
func Read(ctx context.Context, rdb redis.Cmdable, prefix, name string) (Bucket, error) {
	return read(ctx, rdb, prefix, name, time.Time{})
}

// ReadAt is Read with now as the clock, for a fleet whose Limiters keep a
// clock of their own (quota.WithClock) and whose Redis user may not run
// TIME; a zero now is the server's, as Read's.
func ReadAt(ctx context.Context, rdb redis.Cmdable, prefix, name string, now time.Time) (Bucket, error) {
	return read(ctx, rdb, prefix, name, now)
}
