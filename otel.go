package quota

import (
	"github.com/sharedquota/quota/internal/obs"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/metric"
)

// newObs returns what reports a Limiter's work to the tracer and meter
// providers of cfg, the global ones by default, and the meter.
func newObs(cfg config) (*obs.Obs, metric.Meter) {
	tp, mp := cfg.tracerProvider, cfg.meterProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	meter := mp.Meter(ScopeName)
	return obs.New(tp.Tracer(ScopeName), meter, cfg.metricKeys, sentinels), meter
}

// observeMode reports l's mode as the gauge quota.limiter.mode, with l's
// name; the gauge does not keep l alive.
func observeMode(l *Limiter, meter metric.Meter, name string) {
	modes := []string{ModeShared.String(), ModeLocal.String(), ModeOpen.String(), ModeClosed.String()}
	obs.ObserveMode(meter, l, name, modes, func(l *Limiter) string { return l.Mode().String() })
}
