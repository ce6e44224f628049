package nginxtest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/sharedquota/quota/internal/redistest"
)

// sbinDirs are where nginx is looked for after PATH: Debian installs it
// in /usr/sbin, which is not on a user's PATH there.
var sbinDirs = []string{"/usr/sbin", "/sbin", "/usr/local/sbin"}

// skipped counts the tests skipped for want of nginx, for Main.
var skipped atomic.Int32

// lookNginx finds nginx on PATH or in sbinDirs. When it is missing the
// test is skipped, or fails if QUOTA_REQUIRE_REDIS=1.
func lookNginx(tb testing.TB) string {
	tb.Helper()
	if path, err := exec.LookPath("nginx"); err == nil {
		return path
	}
	for _, d := range sbinDirs {
		path := filepath.Join(d, "nginx")
		if fi, err := os.Stat(path); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return path
		}
	}
	msg := fmt.Sprintf("nginxtest: nginx not found on PATH nor in %s (%s)", strings.Join(sbinDirs, ", "), installHint())
	if os.Getenv(RequireEnv) == "1" {
		tb.Fatalf("%s; %s=1 requires it", msg, RequireEnv)
	}
	skipped.Add(1)
	tb.Skipf("%s; set %s=1 to fail instead of skipping", msg, RequireEnv)
	return ""
}

// Main runs a package's tests as m.Run does and returns its exit code.
// When tests were skipped for want of nginx, it then says so once, with
// [redistest.Skipped]'s banner. Call it from TestMain:
// os.Exit(nginxtest.Main(m)). A package whose tests also start Redis
// calls redistest.Main instead, then [Skipped].
func Main(m *testing.M) int {
	code := m.Run()
	Skipped()
	return code
}

// Skipped reports the tests skipped so far for want of nginx, if any, with
// [redistest.Skipped]'s banner.
func Skipped() {
	redistest.Skipped(int(skipped.Load()), "nginx", installHint())
}

// installHint tells how to install nginx.
func installHint() string {
	if runtime.GOOS == "darwin" {
		return "install it with: brew install nginx"
	}
	return "install it with: apt-get install nginx (Debian/Ubuntu) or brew install nginx (macOS)"
}
