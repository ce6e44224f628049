package quota

import (
	"errors"
	"log/slog"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sharedquota/quota/internal/logtest"
	"go.opentelemetry.io/otel/metric/noop"
)

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
		recs := logs.All("a bucket update failed")
		if len(recs) != 3 {
			t.Fatalf("%d records of 180 failures in three minutes, want one a minute:\n%s", len(recs), logs)
		}
		if first, second := logtest.AttrInt(recs[0], "earlier_failures"), logtest.AttrInt(recs[1], "earlier_failures"); first != 0 || second != 59 {
			t.Errorf("the records count %d and %d earlier failures, want 0 and 59", first, second)
		}
	})
}
