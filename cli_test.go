package quota

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// quotaBinary builds the command cmd/quotactl into a temporary directory of
// t and returns its path.
func quotaBinary(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "quotactl")
	build := exec.Command("go", "build", "-o", bin, "./cmd/quotactl")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/quotactl: %v\n%s", err, out)
	}
	return bin
}

// quotaCmd runs the quotactl binary with REDIS_URL set to redisURL and
// returns when it exited and what it printed; it fails the test unless it
// exits 0.
func quotaCmd(t *testing.T, bin, redisURL string, args ...string) (time.Time, string) {
	t.Helper()
	code, out, errOut := quotaExec(t, bin, redisURL, args...)
	done := time.Now()
	if code != 0 {
		t.Fatalf("quotactl %s: exit %d: %s", strings.Join(args, " "), code, errOut)
	}
	return done, out
}

// quotaExec runs the quotactl binary with REDIS_URL set to redisURL and
// returns its exit status and what it printed on stdout and stderr.
func quotaExec(t *testing.T, bin, redisURL string, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "REDIS_URL="+redisURL)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("quotactl %s: %v", strings.Join(args, " "), err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// TestCLI runs the built quotactl as the user of the README's ACL line:
// flags after the subcommand, the warning of a bucket that Redis does not
// hold, and the exit statuses. list needs +scan, which that user lacks: it
// fails with exit 1 and the reason, and lists the buckets as a user who
// may scan. It builds the binary: make test runs it, not make check.
func TestCLI(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	if err := admin.Do(ctx, append([]any{"ACL", "SETUSER", "limiter"}, splitRule(aclLimiter)...)...).Err(); err != nil {
		t.Fatal(err)
	}
	bin := quotaBinary(t)
	url := "redis://limiter:limiter-secret@" + srv.Addr()
	l := NewLimiter(admin)
	if err := l.Wait(ctx, "api.example.com", PerSecond(10)); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := quotaExec(t, bin, url, "status", "api.example.com", "-json")
	if code != 0 || errOut != "" || !strings.Contains(out, `"name":"api.example.com","limit":{"rate":10,"burst":30}`) {
		t.Errorf("quotactl status NAME -json: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = quotaExec(t, bin, url, "limit", "api.example.org", "300/min", "-json")
	const warning = `quotactl: warning: no bucket "api.example.org" under prefix "quota:" in Redis (a typo?); `
	if code != 0 || !strings.HasPrefix(errOut, warning) || strings.Count(errOut, "\n") != 1 ||
		out != `{"name":"api.example.org","action":"limit","override":{"rate":5,"burst":15}}`+"\n" {
		t.Errorf("quotactl limit on an unknown bucket: exit %d, stdout %q, stderr %q; want exit 0, the override and the warning", code, out, errOut)
	}
	if st, err := l.Status(ctx, "api.example.org"); err != nil || st.Override == nil || *st.Override != (Limit{Rate: 5, Burst: 15}) {
		t.Errorf("after quotactl limit on an unknown bucket, Status = %+v, %v", st, err)
	}

	code, out, errOut = quotaExec(t, bin, url, "list")
	if code != 1 || out != "" || !strings.HasPrefix(errOut, "quotactl: redis at "+srv.Addr()+": NOPERM") || !strings.Contains(errOut, "scan") {
		t.Errorf("quotactl list without +scan: exit %d, stdout %q, stderr %q; want exit 1 and NOPERM", code, out, errOut)
	}
	code, out, errOut = quotaExec(t, bin, "redis://"+srv.Addr(), "list")
	if code != 0 || errOut != "" || out != "api.example.com\napi.example.org\n" {
		t.Errorf("quotactl list: exit %d, stdout %q, stderr %q; want both buckets", code, out, errOut)
	}

	for _, args := range [][]string{{"status", "--", "-json", "x"}, {"limit", "x", "10/week"}, {"list", "-prefix"}} {
		code, out, errOut = quotaExec(t, bin, url, args...)
		if code != 2 || out != "" || !strings.HasSuffix(errOut, "\nrun 'quotactl -h' for usage\n") {
			t.Errorf("quotactl %q: exit %d, stdout %q, stderr %q; want exit 2 and the hint", args, code, out, errOut)
		}
	}
	if code, out, _ = quotaExec(t, bin, url, "list", "-h"); code != 0 || !strings.HasPrefix(out, "usage:\n  quotactl ") {
		t.Errorf("quotactl list -h: exit %d, stdout %q", code, out)
	}
}
