package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"os"
	"os/exec"
	"strings"
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

// TestDemoPause runs a short demo with -pause and checks its fourth phase:
// the provider sent its 429, heard nothing in the second half of the pause,
// and received requests again after it. The fleet is small enough that the
// requests granted before the 429 all go out in the pause's first half.
func TestDemoPause(t *testing.T) {
	requireRedis(t)
	out := t.TempDir()
	cfg, err := parseFlags([]string{"-workers", "2", "-goroutines", "2", "-rate", "1200", "-duration", "3s",
		"-latency", "20ms", "-pause", "1s", "-json", "-out", out}, os.Stderr)
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
	if !sum.OK || len(sum.Phases) != 4 {
		t.Fatalf("summary: ok %v with %d phases, want ok with 4: %v", sum.OK, len(sum.Phases), sum.Failures)
	}
	p := sum.Phases[3]
	if p.Pause == nil || !p.Pause.Sent || p.Refused == 0 {
		t.Fatalf("phase 4: pause %+v with %d 429s, want a 429 sent", p.Pause, p.Refused)
	}
	if !strings.Contains(stderr.String(), "demo     | the provider answered 429 with Retry-After: 1") {
		t.Error("phase 4 did not log the 429")
	}
	if p.Max1s > p.Bound1s {
		t.Errorf("phase 4: %d requests in 1 s, bound %d", p.Max1s, p.Bound1s)
	}
	if p.Pause.SecondHalf != 0 {
		t.Errorf("phase 4: %d requests arrived in the second half of the pause, want none (%+v)", p.Pause.SecondHalf, *p.Pause)
	}
	rest := sum.PhaseSeconds - p.Pause.SentAtS - p.Pause.RetryAfterS
	if want := max(1, int(0.5*sum.PerMinute/60*rest)); p.Pause.After < want {
		t.Errorf("phase 4: %d requests after the pause, want at least %d in its last %.1fs", p.Pause.After, want, rest)
	}
}

// TestPauseFlag checks -pause: whole seconds in Retry-After, at least 1,
// and a pause that leaves the phase time to resume.
func TestPauseFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want time.Duration // the Retry-After; -1 for an error
	}{
		{nil, 0},
		{[]string{"-pause", "2s"}, 2 * time.Second},
		{[]string{"-pause", "1500ms"}, 2 * time.Second},
		{[]string{"-pause", "10ms"}, time.Second},
		{[]string{"-pause", "-1s"}, -1},
		{[]string{"-pause", "7s"}, -1}, // more than half of the default 12s
		{[]string{"-pause", "1s", "-duration", "1s"}, -1},
	} {
		cfg, err := parseFlags(tc.args, io.Discard)
		switch {
		case tc.want < 0 && err == nil:
			t.Errorf("%v: no error", tc.args)
		case tc.want >= 0 && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case tc.want >= 0 && cfg.retryAfter() != tc.want:
			t.Errorf("%v: Retry-After %v, want %v", tc.args, cfg.retryAfter(), tc.want)
		}
	}
}

// TestSummarizePause checks which arrivals count as during the pause, in
// its second half and after it.
func TestSummarizePause(t *testing.T) {
	start := time.Unix(0, 0)
	r := phaseResult{phase: phase{pause: time.Second}, start: start, pauseSent: 4 * time.Second}
	for _, ms := range []int{3900, 4000, 4100, 4499, 4500, 4999, 5000, 6000} {
		r.arrivals = append(r.arrivals, provider.Arrival{At: start.Add(time.Duration(ms) * time.Millisecond)})
	}
	got := *summarizePause(r)
	want := pauseSummary{RetryAfterS: 1, Sent: true, SentAtS: 4, During: 4, LastMS: 999, SecondHalf: 2, After: 2}
	if got != want {
		t.Errorf("summarizePause = %+v, want %+v", got, want)
	}
	if got := *summarizePause(phaseResult{phase: phase{pause: time.Second}}); got != (pauseSummary{RetryAfterS: 1}) {
		t.Errorf("summarizePause without a 429 = %+v", got)
	}
}

// TestWritePause checks the line under the table for a fleet that paused
// at once, one that paused late, one that did not and a 429 never sent.
func TestWritePause(t *testing.T) {
	s := summary{PerMinute: 600}
	for _, tc := range []struct {
		pause  pauseSummary
		waitMS float64
		want   string
	}{
		{pauseSummary{RetryAfterS: 2, Sent: true, SentAtS: 4.8, After: 30}, 100,
			"the fleet paused at once; 30 arrived after the pause."},
		{pauseSummary{RetryAfterS: 2, Sent: true, SentAtS: 4.8, During: 5, LastMS: 480, After: 30}, 500,
			"5 requests arrived after it and before the pause ended:\n  the fleet paused 480 ms after the 429, 1520 ms before the pause ended; 30 arrived after the pause.\n"},
		{pauseSummary{RetryAfterS: 2, Sent: true, SentAtS: 4.8, During: 20, LastMS: 1900, SecondHalf: 10, After: 30}, 3000,
			"the last 1900 ms after the 429: the fleet did not pause; 30 arrived after the pause.\n  Requests waited 3.00s at p50, longer than the pause"},
		{pauseSummary{RetryAfterS: 2}, 0, "no request reached the provider"},
	} {
		var b strings.Builder
		s.writePause(&b, phaseSummary{Phase: 4, WaitP50MS: tc.waitMS, Pause: &tc.pause})
		if !strings.Contains(b.String(), tc.want) {
			t.Errorf("%+v:\n%s\nwant it to contain %q", tc.pause, b.String(), tc.want)
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
