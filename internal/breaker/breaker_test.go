package breaker

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/sharedquota/quota/internal/logtest"
)

// The modes the tests open breakers in, and their names.
const (
	local int32 = iota + 1
	open
	closed
)

var modeNames = map[int32]string{Closed: "shared", local: "local", open: "open", closed: "closed"}

const idle = time.Minute

type logRecorder = logtest.Recorder

// newTestBreaker returns a breaker whose questions to Redis are answered
// by answer, recording when each was asked.
func newTestBreaker(open int32, answer func(n int) error) (*Breaker, func(context.Context) error, *logRecorder, func() []time.Time) {
	logs := &logRecorder{}
	var mu sync.Mutex
	var asked []time.Time
	br := New(Config{
		Client:      "test",
		Policy:      "test policy",
		Logger:      slog.New(logs),
		RemindEvery: time.Minute,
		Idle:        idle,
		Open:        open,
		Name:        func(m int32) string { return modeNames[m] },
		Describe:    func(m int32) string { return "requests now go to mode " + modeNames[m] },
		Level:       func(int32) slog.Level { return slog.LevelError },
	})
	ask := func(context.Context) error {
		mu.Lock()
		defer mu.Unlock()
		asked = append(asked, time.Now())
		return answer(len(asked))
	}
	return br, ask, logs, func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(asked)
	}
}

var errDown = errors.New("connection refused")

func TestBreakerBacksOffAndReminds(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, ask, logs, asked := newTestBreaker(open, func(int) error { return errDown })
		start := time.Now()
		br.Trip("k", ask, errDown)
		if br.Mode() != open {
			t.Fatalf("mode %v after a trip", br.Mode())
		}
		// A request every second keeps the probe going for five minutes.
		for range 300 {
			br.Touch(ask)
			br.Served()
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
		if n := logs.Count(slog.LevelError, "still unavailable"); n < 4 || n > 5 {
			t.Errorf("%d reminders in 5 minutes, want one a minute:\n%s", n, logs)
		}
		r, _ := logs.First("still unavailable")
		if served := logtest.AttrInt(r, "served"); served < 55 || served > 61 {
			t.Errorf("the first reminder says %d requests were served, want about 60", served)
		}
		if n := logs.Count(slog.LevelError, "Redis unavailable"); n != 1 {
			t.Errorf("%d records of the outage, want 1", n)
		}
		time.Sleep(2 * idle) // the probe stops
	})
}

func TestBreakerCloses(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, ask, logs, asked := newTestBreaker(local, func(n int) error {
			if n < 4 {
				return errDown
			}
			return nil
		})
		var order []string
		br.cfg.Closing = func() error { order = append(order, "closing in "+modeNames[br.Mode()]); return nil }
		br.cfg.Closed = func() { order = append(order, "closed in "+modeNames[br.Mode()]) }
		br.Trip("k", ask, errDown)
		time.Sleep(time.Second)
		synctest.Wait()
		if br.Mode() != Closed || len(asked()) != 4 {
			t.Fatalf("mode %v after %d questions, want closed after 4", br.Mode(), len(asked()))
		}
		if len(order) != 2 || order[0] != "closing in local" || order[1] != "closed in shared" {
			t.Errorf("callbacks ran as %q", order)
		}
		if logs.Count(slog.LevelInfo, "available again") != 1 {
			t.Errorf("no record of the recovery:\n%s", logs)
		}
	})
}

// TestBreakerHalfOpensWhenIdle: a probe that has served no request for
// the idle time stops, and the breaker stops reporting an outage that
// nobody has checked since.
func TestBreakerHalfOpensWhenIdle(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		br, ask, logs, asked := newTestBreaker(closed, func(int) error { return errDown })
		br.Trip("k", ask, errDown)
		time.Sleep(idle - time.Second)
		if br.Mode() != closed {
			t.Fatalf("mode %v before the probe's idle time, want the open mode", br.Mode())
		}
		time.Sleep(2 * time.Second)
		synctest.Wait()
		if br.Mode() != Closed || br.probing.Load() {
			t.Fatalf("mode %v, probing %v after the idle time; want closed, no probe", br.Mode(), br.probing.Load())
		}
		n := len(asked())
		time.Sleep(time.Hour)
		if len(asked()) != n {
			t.Errorf("the probe asked %d more times after it stopped", len(asked())-n)
		}
		if logs.Count(slog.LevelWarn, "the next one asks Redis") != 1 {
			t.Errorf("no record of the half-open breaker:\n%s", logs)
		}
	})
}
