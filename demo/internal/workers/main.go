package workers

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"testing"
)

// Main is a demo command's main function. With arg as its first
// argument the binary is one of the command's workers, and runs
// runWorker; otherwise it parses its flags with parse, runs run until it
// ends or the process is interrupted, and exits with run's code (2 for
// bad flags).
func Main[C any](name, arg string, runWorker func() error, parse func([]string, io.Writer) (C, error),
	run func(ctx context.Context, cfg C, stdout, stderr io.Writer) int) {
	if len(os.Args) > 1 && os.Args[1] == arg {
		if err := runWorker(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	cfg, err := parse(os.Args[1:], os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", name, err)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, cfg, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// TestMain is a demo command's TestMain: it lets the test binary serve
// as the command's workers, which are copies of the running binary.
func TestMain(m *testing.M, arg string, runWorker func() error) {
	if len(os.Args) > 1 && os.Args[1] == arg {
		if err := runWorker(); err != nil {
			os.Stderr.WriteString(err.Error() + "\n")
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// RequireRedis skips t when redis-server is missing, or fails it when
// QUOTA_REQUIRE_REDIS=1.
func RequireRedis(t testing.TB) {
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
