package store

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// takeSpec is one take of a batch: n tokens, waiting at most maxWait.
type takeSpec struct {
	n       float64
	maxWait time.Duration
}

// A batch is the same takes one after another: with the clock stopped, so
// that every take sees the same instant, a batch's replies and the state it
// leaves equal those of the same takes each in a call of its own, for
// weighted takes, for layers, and with a refusal in the middle, after
// which the next takes still go.
func TestBatchEqualsTakesOneAfterAnother(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	var now atomic.Int64
	now.Store(time.Now().UnixNano())
	s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
	ctx := context.Background()
	for _, tc := range []struct {
		name  string
		lims  []Limit
		takes []takeSpec
	}{
		{"weighted", []Limit{{Rate: 10, Burst: 3}}, []takeSpec{{3, time.Hour}, {1, time.Hour}, {3, time.Hour}, {2, time.Hour}, {1, time.Hour}}},
		{"layers", []Limit{{Rate: 10, Burst: 3}, {Rate: 4, Burst: 6}}, []takeSpec{{1, time.Hour}, {3, time.Hour}, {2, time.Hour}, {1, time.Hour}, {3, time.Hour}, {2, time.Hour}}},
		{"a refusal", []Limit{{Rate: 10, Burst: 2}, {Rate: 5, Burst: 4}}, []takeSpec{{2, time.Hour}, {2, time.Second}, {2, 100 * time.Millisecond}, {1, time.Second}, {2, 0}, {1, time.Hour}}},
		// Granted at once, yet with a key that outlives the test's reads:
		// a bucket that never makes anyone wait keeps its key a
		// millisecond, and the clock that expires keys is the server's.
		{"all at once", []Limit{{Rate: 10, Burst: 100}}, []takeSpec{{1, 0}, {5, 0}, {1, 0}}},
		{"at once, then a wait", []Limit{{Rate: 1, Burst: 3}}, []takeSpec{{1, 0}, {1, 0}, {1, time.Hour}, {1, time.Hour}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			now.Add(int64(time.Hour)) // every bucket of before is full again
			batch := New("quota:", "batch-"+tc.name, tc.lims)
			alone := New("quota:", "alone-"+tc.name, tc.lims)
			var qs []*queuedTake
			for _, sp := range tc.takes {
				qs = append(qs, &queuedTake{ctx: ctx, n: Tokens(sp.n), maxWait: sp.maxWait})
			}
			if err := s.takeAll(ctx, batch, qs); err != nil {
				t.Fatal(err)
			}
			refused := 0
			for i, sp := range tc.takes {
				want, err := s.takeOne(ctx, alone, Tokens(sp.n), sp.maxWait)
				if err != nil {
					t.Fatal(err)
				}
				got := qs[i].g
				if got.Outcome != want.Outcome || got.Wait != want.Wait || fmt.Sprint(got.Tats) != fmt.Sprint(want.Tats) {
					t.Errorf("take %d of %v: batched %+v, alone %+v", i+1, sp.n, got, want)
				}
				if got.Size != len(qs) || got.Trips != 1 {
					t.Errorf("take %d: size %d, %d trips; want %d and 1", i+1, got.Size, got.Trips, len(qs))
				}
				if !got.Granted() {
					refused++
				}
			}
			if tc.name == "a refusal" && refused == 0 {
				t.Error("no take refused: the case does not test a refusal")
			}
			for i := range tc.lims {
				b, _ := rdb.Get(ctx, batch.Keys[i]).Result()
				a, _ := rdb.Get(ctx, alone.Keys[i]).Result()
				if a != b {
					t.Errorf("layer %d: batched leaves %q, alone %q", i+1, b, a)
				}
			}
		})
	}
}
