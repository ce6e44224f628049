package main

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// arrivals counts a provider's requests by the second they arrived in.
type arrivals struct {
	mu sync.Mutex
	n  map[int64]int
}

func (a *arrivals) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	a.mu.Lock()
	a.n[time.Now().Unix()]++
	a.mu.Unlock()
	time.Sleep(30 * time.Millisecond) // the slots are held meanwhile
	w.WriteHeader(http.StatusOK)
}

// window returns the requests of the n seconds that ended at until.
func (a *arrivals) window(until time.Time, n int) int {
	a.mu.Lock()
	defer a.mu.Unlock()
	sum := 0
	for s := until.Unix() - int64(n); s < until.Unix(); s++ {
		sum += a.n[s]
	}
	return sum
}

// A fleet of metered Transports, for two tenants at two priorities with
// slots, is what quotactl status -json tells: every meter with its
// tokens and queue, both tenants with their weights, the tenant over its
// share waiting, the class pushed back, the slots held, and over five
// seconds the rate the provider counted, within 10%.
//
// The slots admit both tenants' callers alike, so each asks for half the
// rate: free (weight 1, a quarter) is over its share and waits its turn;
// gold (three quarters) is under it, and whether a take of gold's waits
// at a given instant is chance.
func TestStatusOfAFleet(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	provider := &arrivals{n: map[int64]int{}}
	api := httptest.NewServer(provider)
	defer api.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()

	metering := quota.Metering{
		Meters: []quota.Meter{{Name: "input_tokens", Limit: quota.Limit{Rate: 2000, Burst: 4000}}},
		Estimate: func(*http.Request, []byte) (quota.Usage, error) {
			return quota.Usage{"input_tokens": 40}, nil
		},
	}
	var wg sync.WaitGroup
	for w := range 3 { // three workers, each its own Limiter
		l := quota.NewLimiter(srv.Client(t), quota.WithTenants(quota.Tenants{Weights: map[string]float64{"gold": 3, "free": 1}}))
		tr := quota.NewTransport(nil, quota.PerSecond(30), quota.WithLimiter(l), quota.WithKey(quota.Fixed("llm")),
			quota.WithMetering(metering), quota.WithConcurrency(24),
			quota.WithTenant(func(r *http.Request) string { return r.Header.Get("Tenant") }),
			quota.WithPriority(func(r *http.Request) int { p, _ := strconv.Atoi(r.Header.Get("Priority")); return p }))
		client := &http.Client{Transport: tr}
		for g := range 12 {
			wg.Go(func() {
				tenant, priority := []string{"gold", "free"}[g%2], strconv.Itoa(2*((g/2+w)%2))
				for ctx.Err() == nil {
					req, _ := http.NewRequestWithContext(ctx, http.MethodPost, api.URL, nil)
					req.Header.Set("Tenant", tenant)
					req.Header.Set("Priority", priority)
					if resp, err := client.Do(req); err == nil {
						resp.Body.Close()
					}
				}
			})
		}
	}
	defer wg.Wait()

	// The fleet runs eight seconds before the read: the rate's five
	// seconds end three before it.
	time.Sleep(8 * time.Second)
	var st statusJSON
	seen := map[string]bool{}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		out := mustRun(t, nil, "-redis", srv.Addr(), "-json", "status", "llm")
		st = statusJSON{}
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("quotactl status -json printed %s: %v", out, err)
		}
		// What the fleet does at one instant: seen once is enough.
		for _, c := range st.Classes {
			seen["pushed"] = seen["pushed"] || c.Priority == 0 && c.PushedSeconds > 0
		}
		for _, tn := range st.Tenants {
			seen["waiting "+tn.Name] = seen["waiting "+tn.Name] || tn.Waiting
		}
		seen["slots held"] = seen["slots held"] || st.Slots.Held > 0
		seen["queued"] = seen["queued"] || len(st.Layers) == 2 && st.Layers[0].QueueSeconds > 0
		if seen["pushed"] && seen["waiting free"] && seen["slots held"] && seen["queued"] {
			break
		}
	}
	cancel()
	t.Logf("seen %v; status %+v", seen, st)
	for _, what := range []string{"pushed", "waiting free", "slots held", "queued"} {
		if !seen[what] {
			t.Errorf("quotactl status never told of %s", what)
		}
	}
	if len(st.Layers) != 2 || st.Layers[0].Meter != "requests" || st.Layers[0].Rate != 30 ||
		st.Layers[1].Meter != "input_tokens" || st.Layers[1].Rate != 2000 || st.Layers[1].Burst != 4000 {
		t.Fatalf("layers %+v, want requests at 30/s and input_tokens at 2000/s", st.Layers)
	}
	weights := map[string]float64{}
	for _, tn := range st.Tenants {
		weights[tn.Name] = tn.Weight
	}
	if len(weights) != 2 || weights["gold"] != 3 || weights["free"] != 1 {
		t.Errorf("tenants %+v, want gold of weight 3 and free of 1", st.Tenants)
	}
	if len(st.Limiters) != 3 {
		t.Errorf("limiters %v, want the three workers'", st.Limiters)
	}

	until, err := time.Parse(time.RFC3339Nano, st.GrantedUntil)
	if err != nil {
		t.Fatal(err)
	}
	counted := provider.window(until, rateWindow)
	for i, l := range st.Layers {
		reported := l.PerSecond * rateWindow
		want := float64(counted) * []float64{1, 40}[i]
		t.Logf("%s: %v granted in the %d s to %v, the provider counted %d requests", l.Meter, reported, rateWindow, until.Format("15:04:05"), counted)
		if counted < 100 || math.Abs(reported-want) > 0.1*want {
			t.Errorf("%s: %v granted in %d s, want %v within 10%%", l.Meter, reported, rateWindow, want)
		}
	}
}

// A bucket whose rate the fleet learned below its Limit: status tells
// the rate in force, its floor and ceiling, and the refusal that cut it,
// in text and JSON.
func TestStatusTellsTheLearnedRate(t *testing.T) {
	srv := redistest.Start(t)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	defer api.Close()
	tr := quota.NewTransport(srv.Client(t), quota.PerSecond(50), quota.WithKey(quota.Fixed("learning")),
		quota.WithAdaptive(quota.Adaptive{}))
	resp, err := (&http.Client{Transport: tr}).Get(api.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	tr.Limiter().Flush(context.Background())
	var st statusJSON
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		st = statusJSON{}
		if err := json.Unmarshal([]byte(mustRun(t, nil, "-redis", srv.Addr(), "-json", "status", "learning")), &st); err != nil {
			t.Fatal(err)
		}
		if len(st.Layers) == 1 && st.Layers[0].Learned != nil {
			break
		}
	}
	if len(st.Layers) != 1 || st.Layers[0].Learned == nil {
		t.Fatalf("status -json tells no learned rate: %+v", st.Layers)
	}
	l := st.Layers[0]
	if l.Rate != 45 || l.Burst != 135 || *l.Learned != (learnedJSON{Floor: 2.5, Ceiling: 50, CutAt: l.Learned.CutAt, CutFrom: 50, Why: "429"}) || l.Learned.CutAt == "" {
		t.Errorf("status -json tells a layer of %v/s burst %v, learned %+v; want 45/s burst 135, cut from 50 by a 429, floor 2.5, ceiling 50", l.Rate, l.Burst, *l.Learned)
	}
	if out := mustRun(t, nil, "-redis", srv.Addr(), "status", "learning"); !strings.Contains(out, "limit    45/s, burst 135 (learned; see below)") ||
		!strings.Contains(out, "learned  rate 45/s (ceiling 50/s, floor 150/m), cut from 50/s at ") {
		t.Errorf("status tells:\n%s", out)
	}
}

// A daily layer's count: quotactl status tells what is used and when the
// day refills, in text and JSON.
func TestStatusTellsTheDay(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	l := quota.NewLimiter(srv.Client(t))
	// Reset half a day from now: the takes and the reads fall in one day.
	hour := time.Now().UTC().Add(12 * time.Hour).Hour()
	day := quota.Daily(5, time.Duration(hour)*time.Hour, time.UTC)
	for range 3 {
		if ok, err := l.AllowN(context.Background(), "api", 1, quota.PerSecond(100), day); !ok || err != nil {
			t.Fatalf("a take of a day of 5: %v, %v", ok, err)
		}
	}
	out := mustRun(t, nil, "-redis", srv.Addr(), "status", "api")
	t.Logf("quotactl status api:\n%s", out)
	if !strings.Contains(out, fmt.Sprintf("5 a day from %02d:00 UTC, 3 used, refills in ", hour)) {
		t.Errorf("status tells no day of 5 with 3 used:\n%s", out)
	}
	var st statusJSON
	if err := json.Unmarshal([]byte(mustRun(t, nil, "-redis", srv.Addr(), "-json", "status", "api")), &st); err != nil {
		t.Fatal(err)
	}
	if len(st.Layers) != 2 || st.Layers[1].Daily == nil || st.Layers[1].Daily.Used != 3 || st.Layers[1].Daily.Zone != "UTC" ||
		st.Layers[1].Daily.Reset != fmt.Sprintf("%02d:00", hour) || st.Layers[1].Daily.Ends == nil || st.Layers[1].Tokens != 2 {
		t.Errorf("status -json tells the layers %+v; want a second, daily, 3 used of 5 and its end", st.Layers)
	}
}
