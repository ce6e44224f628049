package adapt

import (
	"fmt"
	"net/http"
	"slices"
	"testing"
	"time"
)

func TestCheck(t *testing.T) {
	c, err := Config{}.Check()
	if err != nil || c.Floor != DefaultFloor || c.Rise != DefaultRise || !slices.Equal(c.Refusals, []int{429}) {
		t.Errorf("the zero Config checked as %+v, %v", c, err)
	}
	for _, bad := range []Config{{Floor: -0.1}, {Floor: 1}, {Rise: 2}, {Refusals: []int{200}}, {Refusals: []int{600}}} {
		if _, err := bad.Check(); err == nil {
			t.Errorf("%+v checked", bad)
		}
	}
}

// A refusal carries the share of the bucket's responses of the last half
// second that were accepted, 1 when too few say, and the layers whose
// remaining is below a token; other responses carry nothing.
func TestResponse(t *testing.T) {
	c, _ := Config{Refusals: []int{429, 503}}.Check()
	l := New(c)
	now := time.Unix(1000, 0)
	if _, ok := l.Response("a", 429, nil, nil, 0, nil, now); !ok {
		t.Fatal("a 429 is no refusal")
	}
	if r, _ := l.Response("a", 503, nil, nil, time.Millisecond, nil, now); r.OK != 1 || r.Why != "503" || r.Age != time.Millisecond {
		t.Errorf("with 2 responses seen the refusal carries %+v, want OK 1", r)
	}
	for range 8 {
		if _, ok := l.Response("a", 200, nil, nil, 0, nil, now.Add(100*time.Millisecond)); ok {
			t.Fatal("a 200 is a refusal")
		}
	}
	r, _ := l.Response("a", 429, nil, nil, 0, []float64{-1, 0.5, 3}, now.Add(200*time.Millisecond))
	if r.OK != 8.0/11 || !slices.Equal(r.Named, []bool{false, true, false}) {
		t.Errorf("the refusal carries %+v, want OK 8/11 and the second layer named", r)
	}
	// Half a second on, the first two refusals are out of the window.
	r, _ = l.Response("a", 429, nil, nil, 0, nil, now.Add(500*time.Millisecond))
	if r.OK != 8.0/10 {
		t.Errorf("half a second on the refusal carries OK %v, want 8/10", r.OK)
	}
	if r, _ = l.Response("b", 429, nil, nil, 0, nil, now.Add(time.Hour)); r.OK != 1 {
		t.Errorf("another bucket's refusal carries OK %v", r.OK)
	}
	var none *Learner
	if _, ok := none.Response("a", 429, nil, nil, 0, nil, now); ok {
		t.Error("a nil Learner learned")
	}
}

// A RateLimit-Policy's rates bound the layers it names, told when they
// change and every boundsEvery, with or without a refusal; a bucket of
// one cost takes the least.
func TestPolicyBounds(t *testing.T) {
	c, _ := Config{}.Check()
	l := New(c)
	now := time.Unix(1000, 0)
	h := http.Header{"Ratelimit-Policy": {`"requests";q=60;w=60, "tokens";q=6000;w=60`}}
	r, ok := l.Response("a", 200, h, []string{"requests", "output", "tokens"}, 0, nil, now)
	if !ok || r.Why != "" || !slices.Equal(r.Bounds, []float64{1, -1, 100}) {
		t.Fatalf("a policy told %+v, %v", r, ok)
	}
	if _, ok := l.Response("a", 200, h, []string{"requests", "output", "tokens"}, 0, nil, now.Add(time.Second)); ok {
		t.Error("an unchanged policy was told again within boundsEvery")
	}
	if r, ok := l.Response("a", 200, h, []string{"requests", "output", "tokens"}, 0, nil, now.Add(boundsEvery)); !ok || r.Bounds == nil {
		t.Error("an unchanged policy was not told again after boundsEvery")
	}
	if r, _ := l.Response("b", 429, h, nil, 0, nil, now); r.Why != "429" || !slices.Equal(r.Bounds, []float64{1}) {
		t.Errorf("a refusal with a policy, of one cost, told %+v", r)
	}
}

// A flood of bucket names leaves the Learner no larger than maxBuckets,
// whether the names come at once or apart.
func TestLearnerBounded(t *testing.T) {
	c, _ := Config{}.Check()
	l := New(c)
	now := time.Unix(1000, 0)
	for i := range 3 * maxBuckets {
		l.Response(fmt.Sprint("host-", i), 200, nil, nil, 0, nil, now.Add(time.Duration(i)*time.Millisecond))
		if len(l.seen) > maxBuckets {
			t.Fatalf("%d buckets counted after %d names, want at most %d", len(l.seen), i+1, maxBuckets)
		}
	}
	if len(l.seen) < maxBuckets/4 {
		t.Errorf("only %d buckets kept: the recent ones were forgotten too", len(l.seen))
	}
}
