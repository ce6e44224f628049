package store

import (
	"context"
	"math"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// learner is a bucket on a real server, on a clock the test moves.
type learner struct {
	t   *testing.T
	s   *Store
	b   Bucket
	now time.Time
}

func newLearner(t *testing.T, lims ...Limit) *learner {
	srv := redistest.Start(t)
	l := &learner{t: t, now: time.UnixMicro(1_000_000_000_000)}
	l.s = NewStore(srv.Client(t), Options{Clock: func() time.Time { return l.now }, Channel: "ch"})
	l.b = New("quota:", "learn", lims)
	l.read() // the Limiters' read records the Limit they pass
	return l
}

// take takes n tokens from every layer, waiting as long as it must.
func (l *learner) take(n float64) Grant {
	l.t.Helper()
	g, err := l.s.Take(context.Background(), l.b, Tokens(n), time.Hour)
	if err != nil || !g.Granted() {
		l.t.Fatalf("take: %+v, %v", g, err)
	}
	return g
}

// refuse tells of a refusal of a request sent age ago.
func (l *learner) refuse(age time.Duration, ok float64, named ...bool) {
	l.t.Helper()
	if err := l.s.Refuse(context.Background(), l.b, Refusal{Age: age, OK: ok, Floor: 0.1, Rise: 0.01, Why: "429", Named: named}); err != nil {
		l.t.Fatal(err)
	}
}

// read makes a Limiter's read, and returns the learned rates.
func (l *learner) read() []float64 {
	l.t.Helper()
	layers := ""
	for i, k := range l.b.Keys[1:] {
		if i > 0 {
			layers += " "
		}
		layers += k[len(l.b.Keys[0]):]
	}
	r, err := l.s.Record(context.Background(), l.b.Keys, RecordOp{Op: "read", ID: "a", Limit: l.b.Lims[0], Layers: layers})
	if err != nil {
		l.t.Fatal(err)
	}
	return r.Learned
}

func near(a, b float64) bool { return math.Abs(a-b) < 1e-6*math.Max(1, math.Abs(b)) }

// A refusal cuts the rate once an overload: the refusals of requests
// sent before the cut (and its grace) take it deeper at most to the share
// accepted of the rate it was cut from, however many come; one of a
// request sent after it cuts again, never below the floor.
func TestRefusalsCutOnceAnOverload(t *testing.T) {
	l := newLearner(t, Limit{Rate: 100, Burst: 100})
	l.refuse(10*time.Millisecond, 1)
	if got := l.read(); len(got) != 1 || !near(got[0], 90) {
		t.Fatalf("after a refusal the learned rate is %v, want 90 (0.9 of 100)", got)
	}
	for i := range 5 { // the same overload, told by five processes
		l.now = l.now.Add(100 * time.Millisecond)
		l.refuse(time.Duration(i)*100*time.Millisecond+50*time.Millisecond, 0.9/0.95) // sent up to 50ms after the cut
	}
	if got := l.read(); !near(got[0], 90) {
		t.Fatalf("refusals of requests sent before the cut moved the rate to %v", got)
	}
	for i := range 5 { // the same, who saw 0.7 accepted: one cut, deeper
		l.now = l.now.Add(10 * time.Millisecond)
		l.refuse(time.Duration(i)*10*time.Millisecond+550*time.Millisecond, 0.7/0.95)
	}
	if got := l.read(); !near(got[0], 70) {
		t.Fatalf("refusals of the same overload that saw 0.7 accepted left %v, want 70 (0.7 of 100, once)", got)
	}
	l.now = l.now.Add(time.Second)
	l.refuse(10*time.Millisecond, 0.6) // sent after the cut: a new overload
	if got := l.read(); !near(got[0], 63) {
		t.Fatalf("a refusal after the cut left %v, want 63 (0.9 of 70)", got)
	}
	for range 30 {
		l.now = l.now.Add(time.Second)
		l.refuse(10*time.Millisecond, 0)
	}
	if got := l.read(); !near(got[0], 10) {
		t.Fatalf("thirty cuts left %v, want the floor, 10", got)
	}
}

// A cut moves the grants already given out as a change of Limit does:
// a caller queued 1 s behind at 100/s is 2 s behind at 50/s.
func TestCutMovesTheQueue(t *testing.T) {
	l := newLearner(t, Limit{Rate: 100, Burst: 100})
	l.take(100) // the burst
	g := l.take(100)
	if g.Wait != time.Second {
		t.Fatalf("a take behind the burst waits %v, want 1s", g.Wait)
	}
	l.refuse(0, 1)                       // to 90
	l.refuse(time.Millisecond, 0.5/0.95) // the same overload: half
	r, err := l.s.Record(context.Background(), l.b.Keys, RecordOp{Op: "read", ID: "a", Limit: l.b.Lims[0]})
	if err != nil {
		t.Fatal(err)
	}
	if due := r.Anchors[0].Due(g.Pos[0]) - l.now.UnixMicro(); due != 2_000_000 {
		t.Errorf("after the cut to 50/s the grant falls due in %dµs, want 2s", due)
	}
	if g := l.take(50); g.Wait != 3*time.Second {
		t.Errorf("a take of 50 after it waits %v, want 3s (2s of queue, then 1s at 50/s)", g.Wait)
	}
}

// The rate rises only while the callers queue and no cut came for an
// interval, once an interval however many Limiters read: back to the
// peak by halves, then past it faster and faster, to the Limit, where the
// layer stops learning.
func TestRiseOnceAnInterval(t *testing.T) {
	l := newLearner(t, Limit{Rate: 100, Burst: 100})
	l.refuse(0, 1)                       // to 90
	l.refuse(time.Millisecond, 0.5/0.95) // the same overload: to 50
	l.now = l.now.Add(time.Second)
	if got := l.read(); !near(got[0], 50) {
		t.Fatalf("with nobody queued the rate rose to %v", got)
	}
	for range 4 {
		l.take(100) // the callers queue
	}
	l.now = l.now.Add(time.Second)
	for range 10 { // ten Limiters read in the same instant
		l.read()
	}
	if got := l.read(); !near(got[0], 75) {
		t.Fatalf("a second queued: %v, want 75, half the gap to the peak of 100, once", got)
	}
	rates := []float64{}
	for range 30 {
		l.take(50)
		l.now = l.now.Add(time.Second)
		got := l.read()
		if got == nil {
			rates = append(rates, 100)
			break
		}
		rates = append(rates, got[0])
	}
	t.Logf("rates by second: %.1f", rates)
	if rates[len(rates)-1] != 100 || len(rates) < 6 {
		t.Fatalf("the rate rose by %v, want back to 100 in more than 5 s", rates)
	}
	for i := 1; i < len(rates); i++ {
		if rates[i] <= rates[i-1] {
			t.Fatalf("the rate fell while nothing refused: %v", rates)
		}
	}
}

// A refusal that names a meter cuts that meter's layer alone; one that
// names none cuts the layers whose callers queue.
func TestRefusalNamesALayer(t *testing.T) {
	l := newLearner(t, Limit{Rate: 10, Burst: 10}, Limit{Rate: 1000, Burst: 1000})
	l.refuse(0, 1, false, true)
	if got := l.read(); len(got) != 2 || got[0] != 0 || !near(got[1], 900) {
		t.Fatalf("a refusal naming the second layer: learned %v, want [0 900]", got)
	}
	l.take(20) // the first layer owes
	l.now = l.now.Add(time.Second)
	l.refuse(0, 1)
	if got := l.read(); !near(got[0], 9) || !near(got[1], 900) {
		t.Fatalf("a refusal naming none, the first layer queued: learned %v, want [9 900]", got)
	}
}

// A RateLimit-Policy below the Limit bounds the rate: it cuts it at once,
// without a refusal, and the rise stops there; one at or above the Limit
// lifts the bound.
func TestPolicyBoundsTheRate(t *testing.T) {
	l := newLearner(t, Limit{Rate: 100, Burst: 100})
	bound := func(v float64) {
		t.Helper()
		if err := l.s.Refuse(context.Background(), l.b, Refusal{Floor: 0.1, Rise: 0.01, Bounds: []float64{v}}); err != nil {
			t.Fatal(err)
		}
	}
	bound(0)
	if got := l.read(); got != nil {
		t.Fatalf("a policy of the Limit made the layer learn %v", got)
	}
	bound(60)
	if got := l.read(); !near(got[0], 60) {
		t.Fatalf("a policy of 60/s left the rate at %v", got)
	}
	for range 20 {
		l.take(100)
		l.now = l.now.Add(time.Second)
		l.read()
	}
	if got := l.read(); !near(got[0], 60) {
		t.Fatalf("the rate rose past the policy to %v", got)
	}
	bound(0) // the policy is lifted: the rate rises to the Limit
	for range 30 {
		l.take(100)
		l.now = l.now.Add(time.Second)
		if l.read() == nil {
			return
		}
	}
	t.Fatalf("with the policy lifted the rate stayed at %v", l.read())
}

// An operator's override wins: while it is in force the first layer
// learns nothing and computes with the override; once cleared, it takes
// the rate learned before, and learns again.
func TestOverrideFreezesLearning(t *testing.T) {
	l := newLearner(t, Limit{Rate: 100, Burst: 100})
	l.refuse(0, 1) // to 90
	ctx := context.Background()
	if _, err := l.s.Record(ctx, l.b.Keys[:1], RecordOp{Op: "limit", Limit: Limit{Rate: 200, Burst: 200}}); err != nil {
		t.Fatal(err)
	}
	l.now = l.now.Add(time.Second)
	l.refuse(0, 1)
	l.take(200)
	if g := l.take(200); g.Wait != time.Second {
		t.Errorf("under an override of 200/s a take of 200 behind the burst waits %v, want 1s", g.Wait)
	}
	if got := l.read(); !near(got[0], 90) {
		t.Fatalf("under an override the learned rate moved to %v", got)
	}
	if _, err := l.s.Record(ctx, l.b.Keys[:1], RecordOp{Op: "clear"}); err != nil {
		t.Fatal(err)
	}
	l.now = l.now.Add(time.Second)
	l.refuse(0, 1)
	if got := l.read(); !near(got[0], 81) {
		t.Fatalf("after the override a refusal left %v, want 81 (0.9 of 90)", got)
	}
}
