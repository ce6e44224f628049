package quota

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// ScopeName is the instrumentation scope of the package's spans.
const ScopeName = "github.com/sharedquota/quota"

// observer reports acquisitions to OpenTelemetry.
type observer struct {
	tracer trace.Tracer
}

func newObserver(cfg config) observer {
	tp := cfg.tracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return observer{tracer: tp.Tracer(ScopeName)}
}

// waitSpan is the span of one acquisition, ended before the request it
// gates is sent, so that the HTTP client span does not include the wait.
type waitSpan struct {
	span  trace.Span
	mode  Mode          // how the tokens were granted or refused
	wait  time.Duration // the wait the shared bucket asked for
	trips int           // Redis round trips
}

func (o observer) start(ctx context.Context, key string, lim Limit, n float64) (context.Context, *waitSpan) {
	ctx, span := o.tracer.Start(ctx, "quota.wait", trace.WithSpanKind(trace.SpanKindInternal))
	if span.IsRecording() {
		span.SetAttributes(
			attribute.String("quota.key", key),
			attribute.Float64("quota.limit.rate", lim.Rate),
			attribute.Float64("quota.limit.burst", lim.Burst),
			attribute.Float64("quota.tokens", n),
		)
	}
	return ctx, &waitSpan{span: span}
}

func (s *waitSpan) end(err error) {
	if !s.span.IsRecording() {
		return
	}
	s.span.SetAttributes(
		attribute.Float64("quota.wait.seconds", s.wait.Seconds()),
		attribute.String("quota.mode", s.mode.String()),
		attribute.Int("quota.redis.round_trips", s.trips),
		attribute.String("quota.outcome", outcome(err)),
	)
	if err != nil {
		s.span.SetStatus(codes.Error, "")
		s.span.SetAttributes(attribute.String("error.type", errorType(err)))
	}
	s.span.End()
}

// outcome names how an acquisition ended.
func outcome(err error) string {
	switch {
	case err == nil:
		return "granted"
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, ErrWouldExceedDeadline):
		return "cancelled"
	case errors.Is(err, ErrUnavailable), errors.Is(err, ErrWouldExceedDeadline):
		return "refused"
	}
	return "error"
}

// errorType is the low-cardinality error.type of err.
func errorType(err error) string {
	for _, s := range []struct {
		err  error
		name string
	}{
		{ErrWouldExceedDeadline, "would_exceed_deadline"},
		{ErrUnavailable, "unavailable"},
		{ErrScript, "script"},
		{ErrInvalidLimit, "invalid_limit"},
		{ErrInvalidTokens, "invalid_tokens"},
		{ErrExceedsBurst, "exceeds_burst"},
		{ErrInvalidKey, "invalid_key"},
		{context.Canceled, "canceled"},
		{context.DeadlineExceeded, "deadline_exceeded"},
	} {
		if errors.Is(err, s.err) {
			return s.name
		}
	}
	return "_OTHER"
}
