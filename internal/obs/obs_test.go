package obs

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"testing"
	"time"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

var (
	errFirst = errors.New("first")
	errLater = fmt.Errorf("later: %w", errFirst)
)

func TestSentinels(t *testing.T) {
	names := Sentinels{
		{Err: errLater, Type: "later", Outcome: Refused},
		{Err: errFirst, Type: "first", Outcome: Failed, Permanent: true},
		{Err: context.Canceled, Type: "canceled", Outcome: Cancelled},
	}
	for _, c := range []struct {
		err              error
		outcome, errType string
		permanent        bool
	}{
		{nil, Granted, "_OTHER", false},
		{fmt.Errorf("wrapped: %w", errLater), Refused, "later", false}, // the earlier row wins
		{errFirst, Failed, "first", true},
		{context.Canceled, Cancelled, "canceled", false},
		{errors.New("unknown"), Failed, "_OTHER", false},
	} {
		if got := names.Outcome(c.err); got != c.outcome {
			t.Errorf("Outcome(%v) = %q, want %q", c.err, got, c.outcome)
		}
		if got := names.ErrorType(c.err); got != c.errType {
			t.Errorf("ErrorType(%v) = %q, want %q", c.err, got, c.errType)
		}
		if got := names.Permanent(c.err); got != c.permanent {
			t.Errorf("Permanent(%v) = %v, want %v", c.err, got, c.permanent)
		}
	}
}

// TestObserveModeLetsGo: the gauge reports its owner's mode, and stops
// once the owner is collected.
func TestObserveModeLetsGo(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer mp.Shutdown(context.Background())
	type owner struct{ mode string }
	o := &owner{mode: "b"}
	ObserveMode(mp.Meter("test"), o, "l", []string{"a", "b"}, func(o *owner) string { return o.mode })
	points := func() map[string]int64 {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(context.Background(), &rm); err != nil {
			t.Fatal(err)
		}
		out := map[string]int64{}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				for _, dp := range m.Data.(metricdata.Gauge[int64]).DataPoints {
					mode, _ := dp.Attributes.Value(AttrMode)
					out[mode.AsString()] = dp.Value
				}
			}
		}
		return out
	}
	if got := points(); got["a"] != 0 || got["b"] != 1 || len(got) != 2 {
		t.Fatalf("the gauge reports %v, want a=0 b=1", got)
	}
	runtime.KeepAlive(o)
	o = nil
	for deadline := time.Now().Add(5 * time.Second); ; {
		runtime.GC()
		if len(points()) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("the gauge still reports a collected owner")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
