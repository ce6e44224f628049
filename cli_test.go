package quota

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
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
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "REDIS_URL="+redisURL)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	done := time.Now()
	if err != nil {
		t.Fatalf("quotactl %s: %v: %s", strings.Join(args, " "), err, errOut.String())
	}
	return done, out.String()
}
