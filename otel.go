package quota

import (
	"context"
	"runtime"
	"time"
	"weak"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the package's spans and
// metrics.
const ScopeName = "github.com/sharedquota/quota"

// The attributes of spans and metrics.
const (
	attrKey        = attribute.Key("quota.key")
	attrRate       = attribute.Key("quota.limit.rate")
	attrBurst      = attribute.Key("quota.limit.burst")
	attrTokens     = attribute.Key("quota.tokens")
	attrWait       = attribute.Key("quota.wait.seconds")
	attrMode       = attribute.Key("quota.mode")
	attrOutcome    = attribute.Key("quota.outcome")
	attrRoundTrips = attribute.Key("quota.redis.round_trips")
	attrBatchSize  = attribute.Key("quota.batch.size")
	attrLimiter    = attribute.Key("quota.limiter")
	attrUpdate     = attribute.Key("quota.update")
	attrPause      = attribute.Key("quota.pause.seconds")
	attrSlots      = attribute.Key("quota.slots.limit")
	attrSlotWait   = attribute.Key("quota.slot.wait.seconds")
	attrSlotState  = attribute.Key("quota.slot.state")
	attrSlotEvent  = attribute.Key("quota.slot.event")
	attrDryRun     = attribute.Key("quota.dry_run")
	attrPriority   = attribute.Key("quota.priority")
	attrTenant     = attribute.Key("quota.tenant")
	attrErrorType  = attribute.Key("error.type")
)

// waitBuckets resolve waits from a millisecond to ten seconds.
var waitBuckets = []float64{0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}

// observer reports acquisitions to OpenTelemetry: a span each, and the
// metrics quota.wait.duration, quota.acquisitions, quota.refunds and
// quota.limiter.mode.
type observer struct {
	tracer       trace.Tracer
	waits        metric.Float64Histogram
	acquisitions metric.Int64Counter
	refunds      metric.Int64Counter
	slotsHeld    metric.Int64UpDownCounter
	slotWaits    metric.Float64Histogram
	slotEvents   metric.Int64Counter
	keys         bool // raw keys as metric attributes
}

func newObserver(cfg config) observer {
	tp, mp := cfg.tracerProvider, cfg.meterProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	o := observer{tracer: tp.Tracer(ScopeName), keys: cfg.metricKeys}
	// Instrument errors leave a no-op instrument in place; a limiter does
	// not fail for want of telemetry.
	o.waits, _ = meter.Float64Histogram("quota.wait.duration",
		metric.WithDescription("How long acquisitions waited for tokens, Redis round trips included; under dry run, the wait they would have had."),
		metric.WithUnit("s"),
		metric.WithExplicitBucketBoundaries(waitBuckets...))
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
		metric.WithExplicitBucketBoundaries(waitBuckets...))
	o.slotEvents, _ = meter.Int64Counter("quota.slot.events",
		metric.WithDescription("What became of concurrency slots: handed (by a release, to a waiter here), lingered, renewed (a lease renewed before its request was sent), lapsed (a lease found ended before then: the request queued again), registered (a slot in use that Redis did not hold, held again)."),
		metric.WithUnit("{event}"))
	return o
}

// The states of a held slot, and what becomes of slots.
const (
	slotHeld      = "held"
	slotLingering = "lingering"

	slotHanded     = "handed"
	slotLingered   = "lingered"
	slotRenewed    = "renewed"
	slotLapsed     = "lapsed"
	slotRegistered = "registered"
)

// attrs returns the attributes of a slot metric of the bucket called name.
func (o *observer) attrs(name string, kv ...attribute.KeyValue) metric.MeasurementOption {
	if o.keys {
		kv = append(kv, attrKey.String(name))
	}
	return metric.WithAttributes(kv...)
}

// slotHeld adds d to the slots held in mode and state.
func (o *observer) slotHeld(mode Mode, name, state string, d int64) {
	ctx := context.Background()
	if o.slotsHeld.Enabled(ctx) {
		o.slotsHeld.Add(ctx, d, o.attrs(name, attrMode.String(mode.String()), attrSlotState.String(state)))
	}
}

// slotEvent counts n events of what became of slots of the bucket called
// name.
func (o *observer) slotEvent(name, event string, n int) {
	ctx := context.Background()
	if o.slotEvents.Enabled(ctx) {
		o.slotEvents.Add(ctx, int64(n), o.attrs(name, attrSlotEvent.String(event)))
	}
}

// observeMode reports l's mode as the gauge quota.limiter.mode: 1 for the
// current mode, 0 for the others. The callback holds l weakly and is
// unregistered when l is collected.
func observeMode(l *Limiter, mp metric.MeterProvider, name string) {
	meter := mp.Meter(ScopeName)
	gauge, err := meter.Int64ObservableGauge("quota.limiter.mode",
		metric.WithDescription("The mode a Limiter grants tokens in: 1 for the current mode, 0 for the others."),
		metric.WithUnit("{mode}"))
	if err != nil {
		return
	}
	wl := weak.Make(l)
	reg, err := meter.RegisterCallback(func(_ context.Context, o metric.Observer) error {
		l := wl.Value()
		if l == nil {
			return nil
		}
		current := l.Mode()
		for _, m := range []Mode{ModeShared, ModeLocal, ModeOpen, ModeClosed} {
			v := int64(0)
			if m == current {
				v = 1
			}
			o.ObserveInt64(gauge, v, metric.WithAttributes(attrLimiter.String(name), attrMode.String(m.String())))
		}
		return nil
	}, gauge)
	if err == nil {
		runtime.AddCleanup(l, func(r metric.Registration) { _ = r.Unregister() }, reg)
	}
}

// waitSpan follows one acquisition. Its span ends before the request it
// gates is sent, so that the HTTP client span does not include the wait.
type waitSpan struct {
	o     *observer
	span  trace.Span
	name  string // the bucket's
	start time.Time
	mode  Mode // how the tokens were granted or refused
	trips int  // Redis round trips

	slots    int           // the bucket's concurrency slots, when one was asked for
	slotWait time.Duration // how long the wait for it took

	// Under WithDryRun, the acquisition is recorded with the wait it would
	// have had instead of the time it took.
	dryRun bool
	wait   time.Duration

	priority int // recorded when above 0

	// The tenant, when the tokens are for one (see WithTenants): its name
	// on the span; on the metrics, its name when listed in
	// Tenants.Weights, "other" when not, so that traffic adds no series.
	tenantSpan, tenantMetric string
}

// tenant records the tenant the tokens are for.
func (s *waitSpan) tenant(name string, listed bool) {
	s.tenantSpan, s.tenantMetric = name, name
	if !listed {
		s.tenantMetric = "other"
	}
}

func (o *observer) start(ctx context.Context, name string, n float64) (context.Context, waitSpan) {
	ctx, span := o.tracer.Start(ctx, "quota.wait") // kind internal, the default
	if span.IsRecording() {
		span.SetAttributes(attrKey.String(name), attrTokens.Float64(n))
	}
	return ctx, waitSpan{o: o, span: span, name: name, start: time.Now()}
}

// limit records the Limit, its burst resolved.
func (s *waitSpan) limit(lim Limit) {
	if s.span.IsRecording() {
		s.span.SetAttributes(attrRate.Float64(lim.Rate), attrBurst.Float64(lim.Burst))
	}
}

func (s *waitSpan) end(err error) {
	ctx := context.Background()
	metrics := s.o.acquisitions.Enabled(ctx) || s.o.waits.Enabled(ctx)
	if !metrics && !s.span.IsRecording() {
		return // nobody listens: build no attributes
	}
	waited := time.Since(s.start).Seconds()
	attrs := []attribute.KeyValue{attrMode.String(s.mode.String()), attrOutcome.String(outcome(err))}
	if err != nil {
		attrs = append(attrs, attrErrorType.String(errorType(err)))
	}
	if s.dryRun {
		waited = s.wait.Seconds()
		attrs = append(attrs, attrDryRun.Bool(true))
	}
	if s.priority > 0 {
		attrs = append(attrs, attrPriority.Int(s.priority))
	}
	if s.o.keys {
		attrs = append(attrs, attrKey.String(s.name))
	}
	if metrics {
		set := metric.WithAttributes(attrs...)
		if s.tenantMetric != "" {
			set = metric.WithAttributes(append(attrs[:len(attrs):len(attrs)], attrTenant.String(s.tenantMetric))...)
		}
		s.o.acquisitions.Add(ctx, 1, set)
		s.o.waits.Record(ctx, waited, set)
		if s.slots > 0 {
			s.o.slotWaits.Record(ctx, s.slotWait.Seconds(), set)
		}
	}

	if !s.span.IsRecording() {
		return
	}
	s.span.SetAttributes(attrs...)
	if s.tenantMetric != "" {
		s.span.SetAttributes(attrTenant.String(s.tenantSpan))
	}
	s.span.SetAttributes(attrWait.Float64(waited), attrRoundTrips.Int(s.trips))
	if s.slots > 0 {
		s.span.SetAttributes(attrSlots.Int(s.slots), attrSlotWait.Float64(s.slotWait.Seconds()))
	}
	if err != nil {
		s.span.SetStatus(codes.Error, errorType(err))
	}
	s.span.End()
}

// update starts the span of a change the provider's answer makes to the
// bucket called bucket (quota.pause, quota.lower, quota.settle) and returns
// the function that ends it.
func (o *observer) update(ctx context.Context, span, bucket string) (context.Context, func(error)) {
	ctx, s := o.tracer.Start(ctx, span) // kind internal, the default
	if !s.IsRecording() {
		return ctx, func(error) {}
	}
	s.SetAttributes(attrKey.String(bucket))
	return ctx, func(err error) {
		if err != nil {
			s.SetStatus(codes.Error, "")
			s.SetAttributes(attrErrorType.String(errorType(err)))
		}
		s.End()
	}
}

// batchSize records on the wait span in ctx, if any, how many takes shared
// the Redis call of its take (quota.batch.size): 1 for a call of its own.
func batchSize(ctx context.Context, n int) {
	if span := trace.SpanFromContext(ctx); span.IsRecording() {
		span.SetAttributes(attrBatchSize.Int(n))
	}
}
