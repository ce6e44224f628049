package updates

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sharedquota/quota/internal/logtest"
	"github.com/sharedquota/quota/internal/obs"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	tracenoop "go.opentelemetry.io/otel/trace/noop"
)

// TestUpdateFailuresLoggedOnceAMinute: every failed update is counted, and
// logged at most once a minute, with the failures since the last record.
func TestUpdateFailuresLoggedOnceAMinute(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		logs := &logtest.Recorder{}
		o := obs.New(tracenoop.NewTracerProvider().Tracer("test"), metricnoop.NewMeterProvider().Meter("test"), false, nil)
		u := New(o, slog.New(logs), "test")
		for range 180 { // one a second for three minutes
			u.Failed(Pause, errors.New("connection refused"))
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

// TestStartDropsBeyondItsBound: updates run in the background, each under
// Timeout, their errors passed through fail; those that find maxUpdates
// running are dropped as failures.
func TestStartDropsBeyondItsBound(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		logs := &logtest.Recorder{}
		o := obs.New(tracenoop.NewTracerProvider().Tracer("test"), metricnoop.NewMeterProvider().Meter("test"), false, nil)
		u := New(o, slog.New(logs), "test")
		errDown := errors.New("connection refused")
		var mu sync.Mutex
		var failed []error
		block := func(ctx context.Context) error { <-ctx.Done(); return errDown }
		for range maxUpdates + 1 {
			u.Start(context.Background(), "b", []Update{{Kind: Lower, Run: block}}, func(ctx context.Context, err error) error {
				if _, ok := ctx.Deadline(); !ok {
					t.Error("an update without a deadline")
				}
				mu.Lock()
				defer mu.Unlock()
				failed = append(failed, err)
				return err
			})
		}
		if !strings.Contains(logs.String(), errTooMany.Error()) {
			t.Errorf("the update beyond the bound was not dropped:\n%s", logs)
		}
		if err := u.Wait(context.Background()); err != nil {
			t.Fatal(err)
		}
		if len(failed) != maxUpdates {
			t.Errorf("%d failures passed to fail, want %d", len(failed), maxUpdates)
		}
	})
}
