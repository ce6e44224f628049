package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of Limits (limit.go): validation and resolution of the burst, the
// same burst wherever a Limit is given, WithLimits' Limit per bucket, the
// error of a cost above the burst, callers that pass one bucket different
// Limits, and layers of Limits across processes and on a Cluster.

// Callers that pass one bucket different Limits are told once: each take
// counts at its own, and Status tells the first, which surprises. The same
// Limit again, or another bucket's, is no warning.
func TestMixedLimitsWarnOnce(t *testing.T) {
	rdb := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()}) // no timeouts a loaded machine passes
	defer rdb.Close()
	logs := &logRecorder{}
	l := NewLimiter(rdb, WithLogger(slog.New(logs)))
	ctx := context.Background()
	steps := []struct {
		name string
		lim  Limit
		want int // warnings so far
	}{{"a", PerSecond(10), 0}, {"a", PerSecond(10), 0}, {"b", PerSecond(1), 0}, {"a", PerSecond(1), 1}, {"a", PerSecond(2), 1}, {"a", PerSecond(10), 1}}
	for i, s := range steps {
		if err := l.Wait(ctx, s.name, s.lim); err != nil {
			t.Fatal(err)
		}
		if n := logs.Count(slog.LevelWarn, "different Limits"); n != s.want {
			t.Fatalf("after Wait %d (%s, %v): %d warnings of different Limits, want %d:\n%s", i, s.name, s.lim, n, s.want, logs)
		}
	}
}

// Validate accepts a Limit exactly when a Wait for one token on it can be
// granted: a burst below 1 holds no whole token, so Validate refuses it,
// and Wait fails on it with ErrInvalidLimit rather than ErrExceedsBurst.
func TestValidateAgreesWithWait(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	for i, lim := range []Limit{
		{Rate: 0.5, Burst: 0.5},
		{Rate: 100, Burst: 0.999},
		{Rate: 1, Burst: math.SmallestNonzeroFloat64},
		{Rate: 0.5, Burst: 1},
		{Rate: 0.5},
		{Rate: 1e-9},
		PerDay(1),
		{Rate: 1, Burst: -1},
	} {
		verr := lim.Validate()
		werr := l.Wait(ctx, "k"+string(rune('a'+i)), lim)
		if (verr == nil) != (werr == nil) {
			t.Errorf("%+v: Validate() = %v, but Wait = %v", lim, verr, werr)
		}
		if werr != nil && !errors.Is(werr, ErrInvalidLimit) {
			t.Errorf("%+v: Wait = %v, want ErrInvalidLimit", lim, werr)
		}
		if lim.Burst > 0 && lim.Burst < 1 && (verr == nil || !errors.Is(verr, ErrInvalidLimit)) {
			t.Errorf("%+v: Validate() = %v, want ErrInvalidLimit for a burst below one token", lim, verr)
		}
	}
}

// A Limit holds the burst its String prints wherever it is given: on a
// Transport, metered or not, and to a Limiter. PerMinute(60) lets 3
// requests go at once, not the 60 a metered Transport held.
func TestOneBurstEverywhere(t *testing.T) {
	_, rdb, _ := newMini(t)
	ctx := context.Background()
	lim := PerMinute(60)
	if s := lim.String(); s != "1/s burst 3" {
		t.Errorf("PerMinute(60).String() = %q, want 1/s burst 3", s)
	}
	requests := Metering{
		Meters:   []Meter{{Name: "tokens", Limit: Limit{Rate: 1000, Burst: 1e6}}},
		Estimate: func(*http.Request, []byte) (Usage, error) { return nil, nil },
	}
	for _, tc := range []struct {
		name string
		opts []TransportOption
	}{
		{"plain", nil},
		{"metered", []TransportOption{WithMetering(requests)}},
	} {
		tr := NewTransport(rdb, lim, append(tc.opts, WithBase(roundTripFunc(okResponse)), WithNoWait(), WithKey(Fixed(tc.name)))...)
		sent := 0
		for range 20 {
			req, _ := http.NewRequest("GET", "https://api.example.com/", nil)
			if resp, err := tr.RoundTrip(req); err == nil {
				resp.Body.Close()
				sent++
			}
		}
		if sent != 3 {
			t.Errorf("%s Transport on %v: %d of 20 requests at once, want 3", tc.name, lim, sent)
		}
		st, err := tr.Limiter().Status(ctx, tc.name)
		if err != nil || st.Limit.String() != lim.String() {
			t.Errorf("%s Transport on %v: Status says %v, %v", tc.name, lim, st.Limit, err)
		}
	}
	l := NewLimiter(rdb)
	granted := 0
	for range 20 {
		if ok, err := l.Allow(ctx, "limiter", lim); err == nil && ok {
			granted++
		}
	}
	if granted != 3 {
		t.Errorf("Allow on %v: %d of 20 at once, want 3", lim, granted)
	}
}

func TestLimitResolve(t *testing.T) {
	for _, tc := range []struct {
		lim  Limit
		want Limit
	}{
		{PerSecond(10), Limit{Rate: 10, Burst: 30}},
		{PerMinute(300), Limit{Rate: 5, Burst: 15}},
		{PerMinute(6), Limit{Rate: 0.1, Burst: 1}},
		{PerHour(3600), Limit{Rate: 1, Burst: 3}},
		{Limit{Rate: 2, Burst: 1}, Limit{Rate: 2, Burst: 1}},
	} {
		got, err := tc.lim.resolve()
		if err != nil || math.Abs(got.Rate-tc.want.Rate) > 1e-12 || got.Burst != tc.want.Burst {
			t.Errorf("%+v.resolve() = %+v, %v; want %+v", tc.lim, got, err, tc.want)
		}
	}
	if s := PerSecond(5).String(); s != "5/s burst 15" {
		t.Errorf("String() = %q", s)
	}
}

func TestTransportPerKeyLimits(t *testing.T) {
	_, rdb, _ := newMini(t)
	tr := NewTransport(rdb, Limit{Rate: 1, Burst: 1},
		WithBase(roundTripFunc(okResponse)),
		WithLimits(map[string]Limit{"fast.example.com": {Rate: 1, Burst: 10}}))
	// Each request may wait half a second; the next token of a host is a
	// second away once its burst is spent.
	get := func(host string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
		defer cancel()
		req, _ := http.NewRequestWithContext(ctx, "GET", "https://"+host+"/", nil)
		_, err := tr.RoundTrip(req)
		return err
	}
	for i := 0; i < 10; i++ {
		if err := get("fast.example.com"); err != nil {
			t.Fatalf("request %d to the burst-10 host: %v", i+1, err)
		}
	}
	if err := get("slow.example.com"); err != nil {
		t.Fatal(err)
	}
	if err := get("slow.example.com"); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("second request to the burst-1 host: err = %v, want a deadline error", err)
	}
}

// TestExceedsBurstSaysWhatToDo: the error of a cost above the burst names
// the bucket, the burst and the fix.
func TestExceedsBurstSaysWhatToDo(t *testing.T) {
	_, rdb, _ := newMini(t)
	err := NewLimiter(rdb).WaitN(context.Background(), "daily", 5, PerDay(10000))
	if !errors.Is(err, ErrExceedsBurst) {
		t.Fatalf("got %v, want ErrExceedsBurst", err)
	}
	for _, want := range []string{`"daily"`, "holds 1 at most", "a zero Burst is three seconds of Rate", "set the Limit's Burst to 5 or more"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q does not say %q", err, want)
		}
	}
}

// threeLayers bind in turn: the first over a fraction of a second, the
// second over a second or two, the third beyond.
var threeLayers = []Limit{{Rate: 20, Burst: 4}, {Rate: 10, Burst: 8}, {Rate: 6, Burst: 12}}

// checkLayers asserts that in windows of several lengths the due instants
// of the grants obey every layer's bound exactly, and reports the Redis
// commands per grant and how late callers woke.
func checkLayers(t *testing.T, reports []workerReport, layers []Limit) {
	t.Helper()
	grants := mergeStamps(reports)
	var cmds int64
	for _, r := range reports {
		cmds += r.Commands
	}
	perGrant := float64(cmds) / float64(len(grants))
	t.Logf("%d grants, %d Redis commands: %.3f per grant with %d layers", len(grants), cmds, perGrant, len(layers))
	if perGrant > 1.1 {
		t.Errorf("%.3f Redis commands per grant, want at most 1.1", perGrant)
	}
	due := dues(t, grants)
	for _, w := range []time.Duration{250 * time.Millisecond, time.Second, 2 * time.Second} {
		tightest := layers[0]
		for i, lim := range layers {
			checkExact(t, fmt.Sprintf("layer %d (%v)", i+1, lim), due, lim, w, 1)
			if bound(lim, w) < bound(tightest, w) {
				tightest = lim
			}
		}
		t.Logf("at most %d grants due in any %v window (tightest layer %v allows %d)", maxInWindow(due, w), w, tightest, bound(tightest, w))
	}
	fastest := 0.0
	for _, lim := range layers {
		fastest = max(fastest, lim.Rate)
	}
	checkSpacing(t, grants, 1, fastest)
	checkJitter(t, grants)
	// The slowest layer binds in the long run: it must not starve callers.
	if want := 28; len(grants) < want { // 90% of Burst 12 + 6/s for 3s
		t.Errorf("%d grants in 3s, want at least %d", len(grants), want)
	}
}

func TestLayersAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	reports := runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: "layers", Limit: threeLayers[0], Layers: threeLayers[1:], Goroutines: 10, Duration: 3 * time.Second})
	checkLayers(t, reports, threeLayers)
}

func TestLayersOnCluster(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 1)
	cc := cluster.Client(t)
	l := NewLimiter(cc)
	b, err := l.bucket("layers-cluster", threeLayers)
	if err != nil {
		t.Fatal(err)
	}
	// Every layer's key is in the bucket's slot: a CROSSSLOT reply is
	// impossible by construction.
	for _, key := range b.Keys {
		slot, err := cc.ClusterKeySlot(context.Background(), key).Result()
		first, _ := cc.ClusterKeySlot(context.Background(), b.Keys[0]).Result()
		if err != nil || slot != first {
			t.Fatalf("%s is in slot %d, the bucket in %d (%v)", key, slot, first, err)
		}
	}
	reports := runWorkers(t, 3, workerSpec{Cluster: cluster.Addrs(), Key: "layers-cluster", Limit: threeLayers[0], Layers: threeLayers[1:], Goroutines: 10, Duration: 3 * time.Second})
	checkLayers(t, reports, threeLayers)
}
