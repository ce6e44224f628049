package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// screenWait bounds every wait for the screen to show something: a
// refresh a second, on two loaded cores.
const screenWait = 10 * time.Second

// tmuxSkipped counts the tests skipped for want of tmux, for TestMain.
var tmuxSkipped atomic.Int32

const tmuxHint = "install it with: apt-get install tmux (Debian/Ubuntu) or brew install tmux (macOS); make test installs it on Debian"

// needTmux returns the path of tmux. When it is missing the test fails
// under QUOTA_REQUIRE_REDIS=1, as for redis-server, and is skipped
// otherwise, which TestMain repeats after the tests.
func needTmux(t *testing.T) string {
	t.Helper()
	path, err := exec.LookPath("tmux")
	if err == nil {
		return path
	}
	msg := "tmux not found on PATH (" + tmuxHint + ")"
	if os.Getenv(redistest.RequireEnv) == "1" {
		t.Fatalf("%s; %s=1 requires it", msg, redistest.RequireEnv)
	}
	tmuxSkipped.Add(1)
	t.Skipf("%s; set %s=1 to fail instead of skipping", msg, redistest.RequireEnv)
	return ""
}

// buildQuotactl builds the command into a temporary directory of t.
func buildQuotactl(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "quotactl")
	if out, err := exec.Command("go", "build", "-o", bin, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return bin
}

// pane is a tmux session of its own server, 160 by 40, running one
// command under sh, which writes the command's exit status to a file when
// it ends; the pane stays, with what the terminal shows then.
type pane struct {
	t                  *testing.T
	tmux, sock, status string
}

func startPane(t *testing.T, tmux string, command ...string) *pane {
	t.Helper()
	dir := t.TempDir()
	conf := filepath.Join(dir, "tmux.conf")
	if err := os.WriteFile(conf, []byte("set -g remain-on-exit on\nset -g status off\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	p := &pane{t: t, tmux: tmux, sock: filepath.Join(dir, "sock"), status: filepath.Join(dir, "status")}
	// sh -c SCRIPT STATUS COMMAND...: $0 is STATUS, "$@" the command.
	args := []string{"-f", conf, "new-session", "-d", "-x", "160", "-y", "40", "-s", "top", "-e", "LANG=C.UTF-8",
		"sh", "-c", `"$@"; echo $? >"$0"`, p.status}
	args = append(args, command...)
	p.run(args...)
	t.Cleanup(func() { _ = exec.Command(tmux, "-S", p.sock, "kill-server").Run() })
	return p
}

func (p *pane) run(args ...string) string {
	p.t.Helper()
	out, err := exec.Command(p.tmux, append([]string{"-u", "-S", p.sock}, args...)...).CombinedOutput()
	if err != nil {
		p.t.Fatalf("tmux %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// screen returns what the pane shows, with its colors' escapes when
// colors.
func (p *pane) screen(colors bool) string {
	p.t.Helper()
	if colors {
		return p.run("capture-pane", "-p", "-e", "-t", "top")
	}
	return p.run("capture-pane", "-p", "-t", "top")
}

func (p *pane) keys(keys ...string) {
	p.t.Helper()
	p.run(append([]string{"send-keys", "-t", "top"}, keys...)...)
}

// waitFor polls the screen until ok says it shows what, and returns it;
// it fails the test after screenWait.
func (p *pane) waitFor(what string, ok func(screen string) bool) string {
	p.t.Helper()
	deadline := time.Now().Add(screenWait)
	for {
		s := p.screen(false)
		if ok(s) {
			return s
		}
		if time.Now().After(deadline) {
			p.t.Fatalf("after %v the screen does not show %s:\n%s", screenWait, what, s)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// exited waits up to within for the command to end and returns its exit
// status, or fails the test.
func (p *pane) exited(within time.Duration) int {
	p.t.Helper()
	start := time.Now()
	for {
		if b, err := os.ReadFile(p.status); err == nil && strings.HasSuffix(string(b), "\n") {
			code, err := strconv.Atoi(strings.TrimSpace(string(b)))
			if err != nil {
				p.t.Fatalf("exit status %q", b)
			}
			return code
		}
		if time.Since(start) > within {
			p.t.Fatalf("the command still runs %v after the key; screen:\n%s", within, p.screen(false))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// rateOf returns the rate the list shows for the bucket called name, and
// whether it shows one.
func rateOf(screen, name string) (float64, bool) {
	f := rowFields(screen, name)
	if len(f) < 2 {
		return 0, false
	}
	r, err := strconv.ParseFloat(f[1], 64)
	return r, err == nil
}

// clockRE is the time of the latest reading, at the end of the title.
var clockRE = regexp.MustCompile(`(\d\d:\d\d:\d\d)\s*$`)

func clockOf(screen string) string {
	first, _, _ := strings.Cut(screen, "\n")
	m := clockRE.FindStringSubmatch(first)
	if m == nil {
		return ""
	}
	return m[1]
}

// TestTopTmux runs quotactl top in a terminal (tmux) against a real
// Redis and a fleet taking from three buckets, and reads its screen: each
// bucket's line; the rate it shows against the fleet's own count over the
// same seconds; a pause; a bucket whole and back; and a clean exit on q,
// and on Ctrl-C from "top NAME".
func TestTopTmux(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	tmux := needTmux(t)
	srv := redistest.Start(t)
	bin := buildQuotactl(t)
	rdb := srv.Client(t)
	f := startFleet(t, rdb)
	f.take("api", 4, quota.Limit{Rate: 50, Burst: 5}, 0, 0)
	f.take("geocoder", 3, quota.PerMinute(300), 2, 300*time.Millisecond)
	f.take("smtp-relay", 1, quota.Limit{Rate: 2, Burst: 1}, 0, 0)

	p := startPane(t, tmux, bin, "-redis", srv.Addr(), "top")
	p.waitFor("each bucket's line with a rate", func(s string) bool {
		for _, name := range []string{"api", "geocoder", "smtp-relay"} {
			if _, ok := rateOf(s, name); !ok {
				return false
			}
		}
		return strings.Contains(s, "3 buckets") && strings.Contains(rowOf(s, "api"), "50/s")
	})

	checkRate(t, p, f)

	if err := f.l.Pause(context.Background(), "api", time.Minute); err != nil {
		t.Fatal(err)
	}
	p.waitFor("api paused by the operator", func(s string) bool {
		row := rowOf(s, "api")
		return strings.Contains(row, "by operator, ") && strings.Contains(row, "s left")
	})

	p.keys("Enter")
	p.waitFor("a bucket whole", func(s string) bool { return strings.Contains(s, "   bucket ") && strings.Contains(s, "LAYER") })
	p.keys("Escape")
	p.waitFor("the list again", func(s string) bool { return strings.Contains(s, "3 buckets") && rowOf(s, "geocoder") != "" })

	p.keys("q")
	if code := p.exited(2 * time.Second); code != 0 {
		t.Errorf("quotactl top exited %d on q; want 0", code)
	}
	if s := p.screen(false); strings.Contains(s, "quotactl top") || strings.Contains(s, "geocoder") {
		t.Errorf("after q the terminal still shows top:\n%s", s)
	}

	// top NAME opens on the bucket; Ctrl-C ends it as q does.
	p = startPane(t, tmux, bin, "-redis", srv.Addr(), "top", "api")
	p.waitFor("api whole, paused", func(s string) bool {
		return strings.Contains(s, "bucket api") && strings.Contains(s, "by operator, ") &&
			strings.Contains(s, "50/s, burst 5") && strings.Contains(s, "limiters  1 ")
	})
	p.keys("C-c")
	if code := p.exited(2 * time.Second); code != 0 {
		t.Errorf("quotactl top api exited %d on Ctrl-C; want 0", code)
	}
}

// checkRate compares the rate top shows for api with the fleet's own
// count. The rate is what the bucket granted a second over five whole
// seconds that ended three seconds before top read it (status.Layer's
// Granted); the fleet's callers of api ask without pause, at the bucket's
// rate, so once they have run for nine seconds the count over the six
// seconds that ended two seconds ago holds those five. Three readings
// must each be within 10% of it.
func checkRate(t *testing.T, p *pane, f *fleet) {
	t.Helper()
	for f.count("api", time.Time{}, time.Now().Add(-9*time.Second)) == 0 {
		time.Sleep(100 * time.Millisecond)
	}
	clock := ""
	deadline := time.Now().Add(2 * screenWait)
	for n := 0; n < 3; {
		if time.Now().After(deadline) {
			t.Fatalf("%d readings of api's rate in %v; want 3", n, 2*screenWait)
		}
		s := p.screen(false)
		now := time.Now()
		if c := clockOf(s); c != "" && c != clock {
			clock = c
			r, ok := rateOf(s, "api")
			if !ok {
				t.Fatalf("no rate of api on the screen:\n%s", s)
			}
			counted := float64(f.count("api", now.Add(-8*time.Second), now.Add(-2*time.Second))) / 6
			if diff := r - counted; diff > 0.1*counted || diff < -0.1*counted || counted < 40 {
				t.Errorf("top shows api at %.1f/s; the fleet counted %.1f/s over the seconds it reads; want within 10%%, about 50/s", r, counted)
			}
			n++
		}
		time.Sleep(50 * time.Millisecond)
	}
}
