// Package obs reports what a Limiter does to OpenTelemetry: a span for
// each acquisition and for each update of a bucket in the background, and
// the package's metrics. It owns the instruments, their attributes and
// the names of outcomes and errors (see Sentinels); the Limiter tells it
// what happened in strings, the names its modes and errors have in the
// telemetry.
package obs

import (
	"context"
	"runtime"
	"time"
	"weak"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// The attributes of spans and metrics.
const (
	AttrKey        = attribute.Key("quota.key")
	AttrRate       = attribute.Key("quota.limit.rate")
	AttrBurst      = attribute.Key("quota.limit.burst")
	AttrTokens     = attribute.Key("quota.tokens")
	AttrWait       = attribute.Key("quota.wait.seconds")
	AttrMode       = attribute.Key("quota.mode")
	AttrOutcome    = attribute.Key("quota.outcome")
	AttrRoundTrips = attribute.Key("quota.redis.round_trips")
	AttrBatchSize  = attribute.Key("quota.batch.size")
	AttrLimiter    = attribute.Key("quota.limiter")
	AttrUpdate     = attribute.Key("quota.update")
	AttrPause      = attribute.Key("quota.pause.seconds")
	AttrSlots      = attribute.Key("quota.slots.limit")
	AttrSlotWait   = attribute.Key("quota.slot.wait.seconds")
	AttrSlotState  = attribute.Key("quota.slot.state")
	AttrSlotEvent  = attribute.Key("quota.slot.event")
	AttrLayer      = attribute.Key("quota.layer")
	AttrDryRun     = attribute.Key("quota.dry_run")
	AttrPriority   = attribute.Key("quota.priority")
	AttrTenant     = attribute.Key("quota.tenant")
	AttrErrorType  = attribute.Key("error.type")
)

// WaitBuckets resolve waits from a millisecond to ten seconds.
var WaitBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// The states of a held slot, and what becomes of slots.
const (
	Held      = "held"
	Lingering = "lingering"

	Handed     = "handed"
	Lingered   = "lingered"
	Renewed    = "renewed"
	Lapsed     = "lapsed"
	Registered = "registered"
)

// Obs reports a Limiter's acquisitions, slots and updates: a span for
// each acquisition (see Span) and update, and the metrics
// quota.wait.duration, quota.acquisitions, quota.refunds,
// quota.slots.held, quota.slot.wait.duration, quota.slot.events,
// quota.update.failures, quota.settle.cut, quota.settle.unknown and
// quota.rate.learned.
type Obs struct {
	tracer       trace.Tracer
	names        Sentinels
	waits        metric.Float64Histogram
	acquisitions metric.Int64Counter
	refunds      metric.Int64Counter
	slotsHeld    metric.Int64UpDownCounter
	slotWaits    metric.Float64Histogram
	slotEvents   metric.Int64Counter
	failures     metric.Int64Counter
	cut          metric.Float64Counter
	unknown      metric.Int64Counter
	learned      metric.Float64Gauge
	keys         bool // raw keys as metric attributes
}

// New returns the Obs that reports to tracer and meter, naming errors as
// names says; with keys, the acquisition and slot metrics carry the
// bucket's name.
func New(tracer trace.Tracer, meter metric.Meter, keys bool, names Sentinels) *Obs {
	o := &Obs{tracer: tracer, names: names, keys: keys}
	// Instrument errors leave a no-op instrument in place; a limiter does
	// not fail for want of telemetry.
	o.waits, _ = meter.Float64Histogram("quota.wait.duration",
		metric.WithDescription("How long acquisitions waited for tokens, Redis round trips included; under dry run, the wait they would have had."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(WaitBuckets...))
	o.acquisitions, _ = meter.Int64Counter("quota.acquisitions",
		metric.WithDescription("Acquisitions by outcome (granted, refused, cancelled, error) and mode."),
		metric.WithUnit("{acquisition}"))
	o.refunds, _ = meter.Int64Counter("quota.refunds",
		metric.WithDescription("Cancelled waits that handed their tokens back to the bucket."),
		metric.WithUnit("{refund}"))
	o.slotsHeld, _ = meter.Int64UpDownCounter("quota.slots.held",
		metric.WithDescription("Concurrency slots held now, by mode and state: held, or lingering after a request that ended while the provider may still work on it."),
		metric.WithUnit("{slot}"))
	o.slotWaits, _ = meter.Float64Histogram("quota.slot.wait.duration",
		metric.WithDescription("How long acquisitions waited for a concurrency slot."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(WaitBuckets...))
	o.slotEvents, _ = meter.Int64Counter("quota.slot.events",
		metric.WithDescription("What became of concurrency slots: handed (by a release, to a waiter here), lingered, renewed (a lease renewed before its request was sent), lapsed (a lease found ended before then: the request queued again), registered (a slot in use that Redis did not hold, held again)."),
		metric.WithUnit("{event}"))
	o.failures, _ = meter.Int64Counter("quota.update.failures",
		metric.WithDescription("Bucket updates (pause, lower, settle, settle_local) that failed or were dropped."),
		metric.WithUnit("{update}"))
	o.cut, _ = meter.Float64Counter("quota.settle.cut",
		metric.WithDescription("Tokens a settle reported beyond its bound (see WithSettle) and did not take."),
		metric.WithUnit("{token}"))
	o.unknown, _ = meter.Int64Counter("quota.settle.unknown",
		metric.WithDescription("Metered responses that ended before they told their usage (closed or cut short, or a stream without it): their reservations stand."),
		metric.WithUnit("{response}"))
	o.learned, _ = meter.Float64Gauge("quota.rate.learned",
		metric.WithDescription("The rate the fleet learned of the provider's real limit (quota.Adaptive), by layer; 0 when the layer is back at its Limit."),
		metric.WithUnit("{token}/s"))
	return o
}

// Learned records the rate the fleet learned for the layer of the bucket
// called name, 0 for none.
func (o *Obs) Learned(name, layer string, rate float64) {
	ctx := context.Background()
	if o.learned.Enabled(ctx) {
		o.learned.Record(ctx, rate, o.attrs(name, AttrLayer.String(layer)))
	}
}

// attrs returns the attributes of a slot metric of the bucket called name.
func (o *Obs) attrs(name string, kv ...attribute.KeyValue) metric.MeasurementOption {
	if o.keys {
		kv = append(kv, AttrKey.String(name))
	}
	return metric.WithAttributes(kv...)
}

// SlotHeld adds d to the slots held in mode and state (Held or
// Lingering).
func (o *Obs) SlotHeld(mode, name, state string, d int64) {
	ctx := context.Background()
	if o.slotsHeld.Enabled(ctx) {
		o.slotsHeld.Add(ctx, d, o.attrs(name, AttrMode.String(mode), AttrSlotState.String(state)))
	}
}

// SlotEvent counts n events of what became of slots of the bucket called
// name (Handed, Lingered, Renewed, Lapsed or Registered).
func (o *Obs) SlotEvent(name, event string, n int) {
	ctx := context.Background()
	if o.slotEvents.Enabled(ctx) {
		o.slotEvents.Add(ctx, int64(n), o.attrs(name, AttrSlotEvent.String(event)))
	}
}

// Refunded counts a cancelled wait that handed its tokens back.
func (o *Obs) Refunded(ctx context.Context) { o.refunds.Add(ctx, 1) }

// UpdateFailed counts an update of kind that failed with err, or was
// dropped.
func (o *Obs) UpdateFailed(kind string, err error) {
	o.failures.Add(context.Background(), 1, metric.WithAttributes(AttrUpdate.String(kind), AttrErrorType.String(o.names.ErrorType(err))))
}

// Cut counts n tokens a settle of the bucket called name did not take.
func (o *Obs) Cut(ctx context.Context, name string, n float64) {
	o.cut.Add(ctx, n, metric.WithAttributes(AttrKey.String(name)))
}

// Unknown counts a metered response that ended before it told its usage.
func (o *Obs) Unknown(ctx context.Context) { o.unknown.Add(ctx, 1) }

// ObserveMode reports the mode current returns of owner as the gauge
// quota.limiter.mode of the Limiter called name: 1 for the current mode,
// 0 for the other modes. The callback holds owner weakly and is
// unregistered when owner is collected; current must not hold it.
func ObserveMode[T any](meter metric.Meter, owner *T, name string, modes []string, current func(*T) string) {
	gauge, err := meter.Int64ObservableGauge("quota.limiter.mode",
		metric.WithDescription("The mode a Limiter grants tokens in: 1 for the current mode, 0 for the others."),
		metric.WithUnit("{mode}"))
	if err != nil {
		return
	}
	wo := weak.Make(owner)
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		owner := wo.Value()
		if owner == nil {
			return nil
		}
		now := current(owner)
		for _, m := range modes {
			v := int64(0)
			if m == now {
				v = 1
			}
			o.ObserveInt64(gauge, v, metric.WithAttributes(AttrLimiter.String(name), AttrMode.String(m)))
		}
		return nil
	}, gauge)
	if err == nil {
		runtime.AddCleanup(owner, func(r metric.Registration) { _ = r.Unregister() }, reg)
	}
}

// Update starts the span of a change the provider's answer makes to the
// bucket called bucket (quota.pause, quota.lower, quota.settle) and returns
// the function that ends it.
func (o *Obs) Update(ctx context.Context, span, bucket string) (context.Context, func(error)) {
	ctx, s := o.tracer.Start(ctx, span) // kind internal, the default
	if !s.IsRecording() {
		return ctx, func(error) {}
	}
	s.SetAttributes(AttrKey.String(bucket))
	return ctx, func(err error) {
		if err != nil {
			s.SetStatus(codes.Error, "")
			s.SetAttributes(AttrErrorType.String(o.names.ErrorType(err)))
		}
		s.End()
	}
}

// Pause records on the update span in ctx, if any, the pause it puts on
// its bucket.
func Pause(ctx context.Context, d time.Duration) {
	trace.SpanFromContext(ctx).SetAttributes(AttrPause.Float64(d.Seconds()))
}

// BatchSize records on the wait span in ctx, if any, how many takes shared
// the Redis call of its take (quota.batch.size): 1 for a call of its own.
func BatchSize(ctx context.Context, n int) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(AttrBatchSize.Int(n))
	}
}
