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

// TestPriorityPhase runs the phase with priorities, small, with real
// worker processes: the user's requests jump the queue, and the picture
// is written.
func TestPriorityPhase(t *testing.T) {
	workers.RequireRedis(t)
	out := t.TempDir()
	cfg := config{workers: 2, goroutines: 20, duration: 5 * time.Second, out: out, phases: []int{2}}
	var stdout, stderr bytes.Buffer
	code := run(context.Background(), cfg, &stdout, &stderr)
	t.Logf("\n%s%s", stdout.String(), stderr.String())
	if code != 0 {
		t.Fatalf("exit %d, want 0", code)
	}
	if !strings.Contains(stdout.String(), "Phase 2: WithPriority") || strings.Contains(stdout.String(), "Phase 1") {
		t.Errorf("the output does not run phase 2 alone:\n%s", stdout.String())
	}
	for _, name := range []string{"priority-demo.png", "priority-demo.svg"} {
		if fi, err := os.Stat(filepath.Join(out, name)); err != nil || fi.Size() < 1000 {
			t.Errorf("%s: %v, want a picture", name, err)
		}
	}
}

func TestVerdict(t *testing.T) {
	quick, slow := []sample{{Wait: 0.15}, {Wait: 0.16}}, []sample{{Wait: 0.15}, {Wait: 0.3}}
	for _, tc := range []struct {
		r    result
		fail bool
	}{
		{result{phase: phase{priority: 5}, user: quick}, false},
		{result{phase: phase{priority: 5}, user: slow}, true},
		{result{phase: phase{priority: 5}}, true},
		{result{phase: phase{priority: 5}, user: quick, failed: 1}, true},
		{result{phase: phase{priority: 0}, user: []sample{{Wait: 4.5}}}, false},
	} {
		if err := verdict(tc.r); (err != nil) != tc.fail {
			t.Errorf("verdict of priority %d, waits %v, %d failed: %v, want failure %v", tc.r.priority, tc.r.user, tc.r.failed, err, tc.fail)
		}
	}
}

func TestFlags(t *testing.T) {
	for _, args := range [][]string{{"-duration", "3s"}, {"-workers", "0"}, {"extra"}} {
		if _, err := parseFlags(args, io.Discard); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
	c, err := parseFlags(nil, io.Discard)
	if err != nil || c.workers != 3 || c.goroutines != 30 || c.duration != 10*time.Second {
		t.Errorf("the defaults: %+v, %v", c, err)
	}
}
