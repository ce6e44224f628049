package quota

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

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

// Weighted requests across processes: grants of 3 tokens each never take
// more than the bucket allows in any window of their due instants, counted
// in tokens.
func TestWeightedAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	lim := Limit{Rate: 30, Burst: 15}
	const cost = 3
	reports := runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: "weighted", Limit: lim, Cost: cost, Goroutines: 10, Duration: 3 * time.Second})
	grants := mergeStamps(reports)
	got := checkExact(t, "due instants", dues(t, grants), lim, time.Second, cost)
	t.Logf("%d grants of %d tokens; at most %d tokens due in any 1s window (bound %d)", len(grants), cost, got, bound(lim, time.Second))
	checkSpacing(t, grants, cost, lim.Rate)
	checkJitter(t, grants)
	if want := int(0.9 * (lim.Burst + lim.Rate*3) / cost); len(grants) < want {
		t.Errorf("%d grants, want at least %d", len(grants), want)
	}
}

// A provider that counts none remaining, while the bucket is full: with
// its headers read, three processes stop bursting after their first
// requests; without them they spend the bucket's burst.
func TestProviderHeadersAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	const burst = 30
	run := func(headers bool) int {
		srv := redistest.Start(t)
		var mu sync.Mutex
		arrivals := 0
		prov := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			mu.Lock()
			arrivals++
			mu.Unlock()
			w.Header().Set("X-RateLimit-Remaining", "0")
		}))
		defer prov.Close()
		runWorkers(t, 3, workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(prov.URL, "http://"), URL: prov.URL, Headers: headers,
			Limit: Limit{Rate: 1, Burst: burst}, Goroutines: 1, Duration: 2 * time.Second})
		mu.Lock()
		defer mu.Unlock()
		return arrivals
	}
	plain, following := run(false), run(true)
	t.Logf("3 processes, a provider counting none remaining, a bucket of %d at 1/s for 2s: %d requests without the headers, %d following them", burst, plain, following)
	// Without the headers the burst goes out at once. Following them, the
	// first three requests, then the refill of one a second, and the
	// callers still waiting when the run ends: 7. The bucket is lowered in
	// the background, so a process's next take may reach Redis before the
	// lowering does and spend a token of the burst: a few more on a loaded
	// machine, never the burst.
	if plain < burst || following > plain/2 {
		t.Errorf("%d requests following the provider's count, %d without: want the burst of %d without, and at most half that following", following, plain, burst)
	}
}
