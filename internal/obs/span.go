package obs

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// The outcomes of an acquisition, as its span and metrics name them.
const (
	Granted   = "granted"
	Refused   = "refused"
	Cancelled = "cancelled"
	Failed    = "error"
)

// A Sentinel is what an error that matches Err means: its error.type, the
// outcome it gives an acquisition, and whether it is permanent.
type Sentinel struct {
	Err       error
	Type      string
	Outcome   string
	Permanent bool
}

// Sentinels is the one table of what each error means. Earlier rows win.
type Sentinels []Sentinel

// of returns the row that err matches, or false.
func (s Sentinels) of(err error) (Sentinel, bool) {
	for _, row := range s {
		if errors.Is(err, row.Err) {
			return row, true
		}
	}
	return Sentinel{}, false
}

// Outcome names how an acquisition that ended with err ended.
func (s Sentinels) Outcome(err error) string {
	if err == nil {
		return Granted
	}
	if row, ok := s.of(err); ok {
		return row.Outcome
	}
	return Failed
}

// ErrorType is the low-cardinality error.type of err.
func (s Sentinels) ErrorType(err error) string {
	if row, ok := s.of(err); ok {
		return row.Type
	}
	return "_OTHER"
}

// Permanent reports whether err matches a row that says it is permanent.
func (s Sentinels) Permanent(err error) bool {
	row, ok := s.of(err)
	return ok && row.Permanent
}

// A Span follows one acquisition. Its span ends before the request it
// gates is sent, so that the HTTP client span does not include the wait.
// The Limiter sets its exported fields as the acquisition goes.
type Span struct {
	o     *Obs
	span  trace.Span
	name  string // the bucket's
	start time.Time

	Mode  string // how the tokens were granted or refused
	Trips int    // Redis round trips

	Slots    int           // the bucket's concurrency slots, when one was asked for
	SlotWait time.Duration // how long the wait for it took

	// Under WithDryRun, the acquisition is recorded with the wait it would
	// have had instead of the time it took.
	DryRun bool
	Wait   time.Duration

	Priority int // recorded when above 0

	// The tenant, when the tokens are for one (see WithTenants): its name
	// on the span; on the metrics, its name when listed in
	// Tenants.Weights, "other" when not, so that traffic adds no series.
	tenantSpan, tenantMetric string
}

// Start starts the span of an acquisition of n tokens of the bucket
// called name.
func (o *Obs) Start(ctx context.Context, name string, n float64) (context.Context, Span) {
	ctx, span := o.tracer.Start(ctx, "quota.wait") // kind internal, the default
	if span.IsRecording() {
		span.SetAttributes(AttrKey.String(name), AttrTokens.Float64(n))
	}
	return ctx, Span{o: o, span: span, name: name, start: time.Now()}
}

// Tenant records the tenant the tokens are for, listed or not.
func (s *Span) Tenant(name string, listed bool) {
	s.tenantSpan, s.tenantMetric = name, name
	if !listed {
		s.tenantMetric = "other"
	}
}

// Limit records the Limit, its burst resolved.
func (s *Span) Limit(rate, burst float64) {
	if s.span.IsRecording() {
		s.span.SetAttributes(AttrRate.Float64(rate), AttrBurst.Float64(burst))
	}
}

// End ends the span of an acquisition that ended with err, and records
// its metrics.
func (s *Span) End(err error) {
	ctx := context.Background()
	o := s.o
	metrics := o.acquisitions.Enabled(ctx) || o.waits.Enabled(ctx)
	if !metrics && !s.span.IsRecording() {
		return // nobody listens: build no attributes
	}
	waited := time.Since(s.start).Seconds()
	attrs := []attribute.KeyValue{AttrMode.String(s.Mode), AttrOutcome.String(o.names.Outcome(err))}
	if err != nil {
		attrs = append(attrs, AttrErrorType.String(o.names.ErrorType(err)))
	}
	if s.DryRun {
		waited = s.Wait.Seconds()
		attrs = append(attrs, AttrDryRun.Bool(true))
	}
	if s.Priority > 0 {
		attrs = append(attrs, AttrPriority.Int(s.Priority))
	}
	if o.keys {
		attrs = append(attrs, AttrKey.String(s.name))
	}
	if metrics {
		set := metric.WithAttributes(attrs...)
		if s.tenantMetric != "" {
			set = metric.WithAttributes(append(attrs[:len(attrs):len(attrs)], AttrTenant.String(s.tenantMetric))...)
		}
		o.acquisitions.Add(ctx, 1, set)
		o.waits.Record(ctx, waited, set)
		if s.Slots > 0 {
			o.slotWaits.Record(ctx, s.SlotWait.Seconds(), set)
		}
	}

	if !s.span.IsRecording() {
		return
	}
	s.span.SetAttributes(attrs...)
	if s.tenantMetric != "" {
		s.span.SetAttributes(AttrTenant.String(s.tenantSpan))
	}
	s.span.SetAttributes(AttrWait.Float64(waited), AttrRoundTrips.Int(s.Trips))
	if s.Slots > 0 {
		s.span.SetAttributes(AttrSlots.Int(s.Slots), AttrSlotWait.Float64(s.SlotWait.Seconds()))
	}
	if err != nil {
		s.span.SetStatus(codes.Error, o.names.ErrorType(err))
	}
	s.span.End()
}
