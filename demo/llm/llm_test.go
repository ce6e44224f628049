package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/demo/internal/workers"
)

// TestMain lets the test binary serve as the demo's worker processes.
func TestMain(m *testing.M) { workers.TestMain(m, workerArg, runWorker) }

// TestSettledPhase runs the settled fleet's phase, small, with real
// worker processes: no 429, at least minSettled of the output limit, and
// the picture written.
func TestSettledPhase(t *testing.T) {
	workers.RequireRedis(t)
	out := t.TempDir()
	cfg := config{workers: 2, goroutines: 4, duration: 5 * time.Second, out: out, phases: []int{3}}
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), cfg, &stdout, &stderr)
	t.Logf("\n%s%s", stdout.String(), stderr.String())
	if code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	if !strings.Contains(stdout.String(), "Phase 3: Shared buckets in Redis, settled") || strings.Contains(stdout.String(), "Phase 1") {
		t.Errorf("the output does not run phase 3 alone:\n%s", stdout.String())
	}
	for _, name := range []string{"llm-demo.png", "llm-demo.svg"} {
		if fi, err := os.Stat(filepath.Join(out, name)); err != nil || fi.Size() < 1000 {
			t.Errorf("%s: %v, want a picture", name, err)
		}
	}
}

func TestVerdict(t *testing.T) {
	for _, tc := range []struct {
		r    result
		fail bool
	}{
		{result{phase: phase{mode: modeSettled}, used: 0.93}, false},
		{result{phase: phase{mode: modeSettled}, used: 0.7}, true},
		{result{phase: phase{mode: modeSettled}, used: 0.93, refusals: []time.Time{time.Now()}}, true},
		{result{phase: phase{mode: modeOwn}, used: 1, refusals: []time.Time{time.Now()}}, false},
	} {
		if err := verdict(tc.r); (err != nil) != tc.fail {
			t.Errorf("verdict of %s, %.2f used, %d 429s: %v, want failure %v", tc.r.mode, tc.r.used, len(tc.r.refusals), err, tc.fail)
		}
	}
}

func TestFlags(t *testing.T) {
	for _, args := range [][]string{{"-duration", "2s"}, {"-workers", "0"}, {"extra"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
	c, err := parseFlags(nil, io.Discard)
	if err != nil || c.workers != 4 || c.goroutines != 8 || c.duration != 10*time.Second {
		t.Errorf("the defaults: %+v, %v", c, err)
	}
}
