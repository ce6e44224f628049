package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/sharedquota/quota/demo/internal/provider"
)

// TestMain lets the test binary serve as the demo's worker processes, which
// are copies of the running binary.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == workerArg {
		if err := runWorker(); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// requireRedis skips the test when redis-server is missing, or fails it
// when QUOTA_REQUIRE_REDIS=1.
func requireRedis(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err == nil {
		return
	}
	msg := "redis-server not found on PATH; install it with: apt-get install redis-server (Debian/Ubuntu) or brew install redis (macOS), or run make test, which installs it"
	if os.Getenv("QUOTA_REQUIRE_REDIS") == "1" {
		t.Fatal(msg + "; QUOTA_REQUIRE_REDIS=1 requires it")
	}
	t.Skip(msg + "; set QUOTA_REQUIRE_REDIS=1 to fail instead of skipping")
}

// TestDemo runs a short demo with real worker processes and checks its
// JSON summary: local limiters overshoot, the shared bucket does not, and
// the outage phase stays within its bound and logs its transitions.
func TestDemo(t *testing.T) {
	requireRedis(t)
	out := t.TempDir()
	cfg, err := parseFlags([]string{"-workers", "3", "-goroutines", "4", "-rate", "120", "-duration", "3s",
		"-latency", "20ms", "-json", "-out", out}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, cfg, &stdout, &stderr)
	t.Logf("output:\n%s", stderr.String())
	if code != 0 {
		t.Fatalf("exit code %d, want 0", code)
	}
	var sum summary
	if err := json.Unmarshal(stdout.Bytes(), &sum); err != nil {
		t.Fatalf("the summary is not JSON: %v\n%s", err, stdout.String())
	}
	if !sum.OK || len(sum.Phases) != 3 {
		t.Fatalf("summary: ok %v with %d phases, want ok with 3: %v", sum.OK, len(sum.Phases), sum.Failures)
	}
	local, shared, outage := sum.Phases[0], sum.Phases[1], sum.Phases[2]

	if local.XLimit < 2 || local.Refused == 0 {
		t.Errorf("phase 1: %.2fx the limit with %d 429s, want at least 2x and some 429s", local.XLimit, local.Refused)
	}
	if shared.Max1s > shared.Bound1s {
		t.Errorf("phase 2: %d requests in 1 s, bound %d", shared.Max1s, shared.Bound1s)
	}
	// A few requests a second: the rates are coarse, the bounds loose.
	if want := int(0.6 * (float64(sum.Burst) + sum.PerMinute/60*sum.PhaseSeconds)); shared.Requests < want || shared.XLimit > 1.3 {
		t.Errorf("phase 2: %d requests (want at least %d), %.2fx the limit", shared.Requests, want, shared.XLimit)
	}
	if outage.Max1s > outage.Bound1s {
		t.Errorf("phase 3: %d requests in 1 s, bound %d", outage.Max1s, outage.Bound1s)
	}
	if !outage.RedisKilled || outage.OutageLogs == 0 || outage.RecoveryLogs == 0 {
		t.Errorf("phase 3: Redis killed %v, %d outage and %d recovery records, want a kill and both records",
			outage.RedisKilled, outage.OutageLogs, outage.RecoveryLogs)
	}
	for _, f := range []string{sum.PNG, sum.SVG, sum.CSV} {
		if st, err := os.Stat(f); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v, want a file", f, err)
		}
	}
}

func TestMaxInWindow(t *testing.T) {
	t0 := time.Unix(0, 0)
	at := func(ms ...int) []provider.Arrival {
		var a []provider.Arrival
		for _, m := range ms {
			a = append(a, provider.Arrival{At: t0.Add(time.Duration(m) * time.Millisecond)})
		}
		return a
	}
	for _, tc := range []struct {
		arrivals []provider.Arrival
		want     int
	}{
		{nil, 0},
		{at(0), 1},
		{at(0, 1000), 2}, // closed at both ends
		{at(0, 1001), 1},
		{at(0, 500, 900, 1400, 1500), 4},
	} {
		if got := maxInWindow(tc.arrivals, time.Second); got != tc.want {
			t.Errorf("maxInWindow(%v) = %d, want %d", tc.arrivals, got, tc.want)
		}
	}
}

func TestPercentile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3}
	for p, want := range map[float64]float64{0: 1, 50: 3, 99: 5, 100: 5} {
		if got := percentile(xs, p); got != want {
			t.Errorf("percentile(%v, %v) = %v, want %v", xs, p, got, want)
		}
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("percentile(nil) = %v, want 0", got)
	}
}
