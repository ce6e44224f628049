package quota

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"go.opentelemetry.io/otel/metric/noop"
)

// newTestBreaker returns a breaker whose questions to Redis are answered
// by answer, recording when each was asked.
func newTestBreaker(policy Policy, answer func(n int) error) (*breaker, *logRecorder, func() []time.Time) {
	logs := &logRecorder{}
	var mu sync.Mutex
	var asked []time.Time
	br := &breaker{
		policy:      policy,
		client:      "test",
		logger:      slog.New(logs),
		remindEvery: remindEvery,
		idle:        probeIdle,
		ask: func(context.Context, bucket) error {
			mu.Lock()
			defer mu.Unlock()
			asked = append(asked, time.Now())
			return answer(len(asked))
		},
	}
	return br, logs, func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(asked)
	}
}

var errDown = errors.New("connection refused")

func TestBreakerBacksOffAndReminds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, logs, asked := newTestBreaker(FailOpen, func(int) error { return errDown })
		b := bucket{name: "k"}
		start := time.Now()
		br.trip(b, errDown)
		if br.mode() != ModeOpen {
			t.Fatalf("mode %v after a trip under FailOpen", br.mode())
		}
		// A request every second keeps the probe going for five minutes.
		for range 300 {
			br.touch(b)
			br.served.Add(1)
			time.Sleep(time.Second)
		}
		synctest.Wait()
		var gaps []time.Duration
		last := start
		for _, at := range asked()[:7] {
			gaps = append(gaps, at.Sub(last))
			last = at
		}
		want := []time.Duration{50, 100, 200, 400, 500, 500, 500}
		for i := range want {
			if gaps[i] != want[i]*time.Millisecond {
				t.Fatalf("the probe asked after %v, want %v ms", gaps, want)
			}
		}
		// One reminder a minute: at 1, 2, 3 and 4 minutes, and at 5 when
		// the fifth minute's probe lands before the loop ends.
		if n := logs.count(slog.LevelError, "still unavailable"); n < 4 || n > 5 {
			t.Errorf("%d reminders in 5 minutes, want one a minute:\n%s", n, logs)
		}
		r, _ := logs.first("still unavailable")
		if served := attrInt(r, "served"); served < 55 || served > 61 {
			t.Errorf("the first reminder says %d requests were served, want about 60", served)
		}
		if n := logs.count(slog.LevelError, "Redis unavailable"); n != 1 {
			t.Errorf("%d records of the outage, want 1", n)
		}
		time.Sleep(2 * probeIdle) // the probe stops
	})
}

func TestBreakerCloses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, logs, asked := newTestBreaker(FallbackLocal(2), func(n int) error {
			if n < 4 {
				return errDown
			}
			return nil
		})
		var order []string
		br.closing = func() error { order = append(order, "closing in "+br.mode().String()); return nil }
		br.closed = func() { order = append(order, "closed in "+br.mode().String()) }
		br.trip(bucket{name: "k"}, errDown)
		time.Sleep(time.Second)
		synctest.Wait()
		if br.mode() != ModeShared || len(asked()) != 4 {
			t.Fatalf("mode %v after %d questions, want shared after 4", br.mode(), len(asked()))
		}
		if len(order) != 2 || order[0] != "closing in local" || order[1] != "closed in shared" {
			t.Errorf("callbacks ran as %q", order)
		}
		if logs.count(slog.LevelInfo, "available again") != 1 {
			t.Errorf("no record of the recovery:\n%s", logs)
		}
	})
}

// TestBreakerHalfOpensWhenIdle: a probe that has served no request for
// the idle time stops, and the breaker stops reporting an outage that
// nobody has checked since.
func TestBreakerHalfOpensWhenIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, logs, asked := newTestBreaker(FailClosed, func(int) error { return errDown })
		br.trip(bucket{name: "k"}, errDown)
		time.Sleep(probeIdle - time.Second)
		if br.mode() != ModeClosed {
			t.Fatalf("mode %v before the probe's idle time, want closed", br.mode())
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if br.mode() != ModeShared || br.probing.Load() {
			t.Fatalf("mode %v, probing %v after the idle time; want shared, no probe", br.mode(), br.probing.Load())
		}
		n := len(asked())
		time.Sleep(time.Hour)
		if len(asked()) != n {
			t.Errorf("the probe asked %d more times after it stopped", len(asked())-n)
		}
		if logs.count(slog.LevelWarn, "the next one asks Redis") != 1 {
			t.Errorf("no record of the half-open breaker:\n%s", logs)
		}
	})
}

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

func TestLocalShares(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		var ls localLimiters
		lim := Limit{Rate: 10, Burst: 4}

		// No queue: a share of 2 workers starts empty, 5/s and burst 2.
		rl, err := ls.get("a", "ka", "ka", lim, 2)
		if err != nil {
			t.Fatal(err)
		}
		if tokens := rl.Tokens(); tokens != -0 && tokens != 0 {
			t.Errorf("a new share holds %v tokens, want 0", tokens)
		}
		time.Sleep(400 * time.Millisecond)
		if tokens := rl.Tokens(); tokens != 2 {
			t.Errorf("the share holds %v tokens after 400ms at 5/s, want its burst, 2", tokens)
		}

		// A queue 1s long: the share owes the tokens that accrue until it
		// has drained, besides its burst.
		ls.granted("kb", time.Second)
		rl, _ = ls.get("b", "kb", "kb", lim, 2)
		if tokens := rl.Tokens(); tokens != -5 {
			t.Errorf("a share behind a 1s queue holds %v tokens, want -5: empty, and owing what accrues in 1s", tokens)
		}

		// A queue is forgotten once it has drained, however long after.
		ls.granted("c", 200*time.Millisecond)
		if d := ls.ahead("c"); d != 200*time.Millisecond {
			t.Errorf("ahead %v, want 200ms", d)
		}
		time.Sleep(401 * time.Millisecond)
		if d := ls.ahead("c"); d != 0 {
			t.Errorf("ahead %v after the queue drained, want 0", d)
		}
		if n := ls.sweepQueues(); n != 1 {
			t.Errorf("%d queues remembered, want 1 (b's)", n)
		}
		time.Sleep(2 * time.Second)
		if n := ls.sweepQueues(); n != 0 {
			t.Errorf("%d queues remembered after all drained, want 0", n)
		}
		// A grant without a wait leaves nothing behind.
		ls.granted("d", 0)
		if _, ok := ls.queues.Load("d"); ok {
			t.Error("a grant without a wait was remembered")
		}
	})
}

// TestUpdateFailuresLoggedOnceAMinute: every failed update is counted, and
// logged at most once a minute, with the failures since the last record.
func TestUpdateFailuresLoggedOnceAMinute(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		logs := &logRecorder{}
		var u updates
		u.init(config{logger: slog.New(logs)}, "test", noop.NewMeterProvider().Meter(ScopeName))
		for range 180 { // one a second for three minutes
			u.failed(updatePause, errDown)
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
