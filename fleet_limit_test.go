package quota

import (
	"context"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// TestSettledFleetKeepsItsLimit: 4 Limiters x 8 goroutines reserve 1
// request and 1,000 output tokens each, as a request to an LLM API with
// max_tokens 1,000 does, hand the request on when the reservation is
// granted, and settle it 100 ms later with 10 to 60% of the output used,
// the provider having given the rest back. A check bucket at the fleet's
// output Limit, charged the whole reservation at each hand-off and given
// back the unused part when the answer ends, as the provider counts, must
// not go below zero by more than checkMargin: the fleet hands on no more
// than its own limit. The requests meter binds nothing; it must not hold
// a reservation past the instant the give-backs have moved its output
// tokens to, and let it go later beside others held with it. The fleet
// sends about 2 script calls a request: a take (fewer when takes share a
// call), a settle, and its Limiters' reads of the control record while
// callers sleep.
func TestSettledFleetKeepsItsLimit(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	const (
		limiters, goroutines = 4, 8
		maxTokens            = 1000
		latency              = 100 * time.Millisecond
		run                  = 3 * time.Second
		// checkMargin covers hand-offs late behind their grants while
		// the check bucket is full, at the start: 50 ms of the Limit.
		checkMargin = 380.0
		// maxCalls: 2 with a margin for the reads, a Limiter's every
		// control.WaitRefresh while callers sleep, and for takes that
		// share no call.
		maxCalls = 2.2
	)
	output := Limit{Rate: 7600, Burst: 7600}
	meters := []Meter{
		{Name: "requests", Limit: Limit{Rate: 95, Burst: 95}},
		{Name: MeterOutputTokens, Limit: output},
	}
	type event struct {
		at time.Time
		n  float64 // tokens: below zero a hand-off, above a give-back
	}
	var (
		mu     sync.Mutex
		events []event
		seq    int
		used   float64 // output tokens used, in all
	)
	cmds := make([]*cmdCounter, limiters)
	ls := make([]*Limiter, limiters)
	for i := range ls {
		rdb := srv.Client(t)
		cmds[i] = newCmdCounter()
		rdb.AddHook(cmds[i])
		ls[i] = NewLimiter(rdb)
	}
	ctx, cancel := context.WithTimeout(context.Background(), run)
	defer cancel()
	var wg sync.WaitGroup
	for _, l := range ls {
		for range goroutines {
			wg.Go(func() {
				for ctx.Err() == nil {
					r, err := l.Reserve(ctx, "settled-fleet", meters, Usage{"requests": 1, MeterOutputTokens: maxTokens})
					if err != nil {
						return // the run's end
					}
					mu.Lock()
					events = append(events, event{time.Now(), -maxTokens})
					u := math.Round(maxTokens * (0.1 + 0.5*float64(seq*37%100)/100))
					seq++
					used += u
					mu.Unlock()
					time.Sleep(latency)
					mu.Lock()
					events = append(events, event{time.Now(), maxTokens - u})
					mu.Unlock()
					r.Settle(Usage{MeterOutputTokens: u})
				}
			})
		}
	}
	wg.Wait()
	for _, l := range ls {
		if err := l.Flush(context.Background()); err != nil {
			t.Fatal(err)
		}
	}

	slices.SortFunc(events, func(a, b event) int { return a.at.Compare(b.at) })
	level, last := output.Burst, events[0].at
	lowest, at, handOffs := level, time.Duration(0), 0
	for _, e := range events {
		level = min(output.Burst, level+output.Rate*e.at.Sub(last).Seconds())
		level = min(output.Burst, level+e.n)
		last = e.at
		if e.n < 0 {
			handOffs++
		}
		if level < lowest {
			lowest, at = level, e.at.Sub(events[0].at)
		}
	}
	calls := 0
	ops := map[string]int{}
	for _, c := range cmds {
		for op, n := range c.byOp() {
			ops[op] += n
			calls += n
		}
	}
	perReq := float64(calls) / float64(handOffs)
	t.Logf("%d hand-offs in %v, %.0f output tokens used; check bucket lowest %.0f at %v; %.2f script calls a request %v",
		handOffs, run, used, lowest, at.Round(time.Millisecond), perReq, ops)
	if lowest < -checkMargin {
		t.Errorf("the check bucket at the fleet's output Limit went %.0f below zero at %v, want at most %.0f: the fleet handed on more than its limit", -lowest, at.Round(time.Millisecond), checkMargin)
	}
	if perReq > maxCalls {
		t.Errorf("%.2f script calls a request, want at most %.2f", perReq, maxCalls)
	}
}
