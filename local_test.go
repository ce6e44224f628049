package quota

import (
	"errors"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"go.opentelemetry.io/otel/metric/noop"
)

func attrInt(r slog.Record, key string) int64 {
	v := int64(-1)
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value.Int64()
		}
		return true
	})
	return v
}

// TestUpdateFailuresLoggedOnceAMinute: every failed update is counted, and
// logged at most once a minute, with the failures since the last record.
func TestUpdateFailuresLoggedOnceAMinute(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		logs := &logRecorder{}
		var u updates
		u.init(config{logger: slog.New(logs)}, "test", noop.NewMeterProvider().Meter(ScopeName))
		for range 180 { // one a second for three minutes
			u.failed(updatePause, errors.New("connection refused"))
			time.Sleep(time.Second)
		}
		recs := logs.all("a bucket update failed")
		if len(recs) != 3 {
			t.Fatalf("%d records of 180 failures in three minutes, want one a minute:\n%s", len(recs), logs)
		}
		if first, second := attrInt(recs[0], "earlier_failures"), attrInt(recs[1], "earlier_failures"); first != 0 || second != 59 {
			t.Errorf("the records count %d and %d earlier failures, want 0 and 59", first, second)
		}
	})
}
