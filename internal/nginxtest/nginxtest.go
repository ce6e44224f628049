// Package nginxtest starts real nginx processes for tests: an HTTP server
// whose requests nginx's limit_req module admits at a rate, for tests of
// clients that meet a server limiting them the way a real one does.
//
// Every server is a child process of the test binary, run in the
// foreground as a single process (daemon off, master_process off) with -p
// a per-test temporary directory that holds its generated configuration
// (nginx.conf), its error log (error.log), pid file and temporary files.
// It listens on 127.0.0.1 on a free port, reserved against the servers
// that internal/redistest starts in this and the other test binaries
// ([redistest.ReservePort]), and is stopped when the test finishes. The
// access log is off.
//
// nginx is looked for on PATH, then in /usr/sbin, /sbin and
// /usr/local/sbin: Debian installs it in /usr/sbin, which is not on a
// user's PATH there. When it is not
// found the test is skipped, unless the environment variable
// QUOTA_REQUIRE_REDIS is set to 1 (as make test does, for redis-server and
// the other programs the tests start), in which case it fails. A package
// whose tests use nginxtest reports those skips once with [Main]. make
// test installs nginx on Debian (scripts/need.sh nginx).
//
// The helpers report errors with Fatalf on the testing.TB they were given,
// so they must be called from the goroutine running that test.
package nginxtest

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// RequireEnv is the environment variable that turns a missing nginx from a
// skipped test into a failed one when it is set to "1". It is
// internal/redistest's.
const RequireEnv = redistest.RequireEnv

// Body is the body of the answers to the requests nginx admits.
const Body = "ok\n"

const (
	// startTimeout bounds how long nginx may take to answer.
	startTimeout = 10 * time.Second
	// stopTimeout bounds how long nginx may take to exit on SIGTERM
	// before it is killed, and then to be reaped.
	stopTimeout = 5 * time.Second
	// startAttempts is how many ports StartLimitReq tries.
	startAttempts = 10
	// logTailLines is how many lines of the error log a failed test
	// reports.
	logTailLines = 25
	// readyPath is the location that answers the readiness probe. It is
	// not rate-limited.
	readyPath = "/.nginxtest/ready"
)

// Server is an nginx child process started by [StartLimitReq]. It is
// stopped when the test that started it finishes.
type Server struct {
	tb      testing.TB
	bin     string
	dir     string
	log     string
	port    int
	release func() // gives the port back; nil once done
	proc    *redistest.Proc
}

// StartLimitReq starts nginx with one rate-limited location, /, and waits
// until it answers. Every request, whatever its path (but
// /.nginxtest/ready, which the start polls), goes through
//
//	limit_req_zone $server_name zone=z:1m rate=RATE;
//	limit_req zone=z burst=BURST nodelay;
//
// one zone for all clients, as a service's shared quota is (burst=BURST is
// left out when burst is 0, nginx's default, since nginx takes only a
// positive one). An admitted GET is answered 200 with [Body], a static
// file; a refused request 503 (nginx's default limit_req_status), with
// nginx's error page and no Retry-After header. With burst 0, two requests
// less than 1/rate seconds apart are not both admitted; burst lets that
// many requests more through at once, after which they are admitted at
// the rate. nginx counts time in milliseconds.
//
// rate is in requests per second. nginx takes whole requests per second
// or per minute, so rate must be a whole number of either: 100 is written
// 100r/s, 0.5 30r/m. (nginx keeps a rate in thousandths of a request per
// second, rounded down: 1r/m admits one request every 62.5 s.)
//
// The static file is served, rather than answered by return, because
// return answers in the rewrite phase, before limit_req's preaccess phase
// runs: it would never be limited. The server name is set, since
// limit_req does not account requests whose key, $server_name, is empty.
func StartLimitReq(tb testing.TB, rate float64, burst int) *Server {
	tb.Helper()
	spec, err := rateSpec(rate)
	if err != nil {
		tb.Fatalf("nginxtest: %v", err)
	}
	if burst < 0 {
		tb.Fatalf("nginxtest: burst %d is negative", burst)
	}
	bin := lookNginx(tb)
	dir := tb.TempDir()
	for _, d := range []string{"html", "tmp"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			tb.Fatalf("nginxtest: %v", err)
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "html", "ok.txt"), []byte(Body), 0o644); err != nil {
		tb.Fatalf("nginxtest: %v", err)
	}
	s := &Server{tb: tb, bin: bin, dir: dir, log: filepath.Join(dir, "error.log")}
	tb.Cleanup(s.cleanup)

	var lastErr error
	for range startAttempts {
		port, release, err := redistest.ReservePort()
		if err != nil {
			tb.Fatalf("nginxtest: %v", err)
		}
		s.port, s.release = port, release
		token := readyToken()
		if err = s.launch(config(spec, burst, port, token), token); err == nil {
			return s
		}
		release()
		s.release = nil
		lastErr = err
		if !errors.Is(err, errPortInUse) {
			break
		}
	}
	tb.Fatalf("nginxtest: starting nginx: %v", lastErr)
	return nil
}

// URL returns the server's base URL, "http://127.0.0.1:PORT".
func (s *Server) URL() string {
	return "http://" + net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

// errPortInUse marks a launch that failed because its port was taken.
var errPortInUse = errors.New("port already in use")

// launch writes conf, starts nginx with it and waits until the readiness
// location answers with token, which conf has it answer. On failure the
// process is gone and the error includes the tail of the error log.
func (s *Server) launch(conf, token string) error {
	if err := os.WriteFile(filepath.Join(s.dir, "nginx.conf"), []byte(conf), 0o644); err != nil {
		return err
	}
	args := []string{"-p", s.dir + string(filepath.Separator), "-e", s.log, "-c", "nginx.conf"}
	p, err := redistest.Launch("nginxtest", s.bin, args, s.dir, s.log)
	if err != nil {
		return err
	}
	s.proc = p

	client := &http.Client{
		Timeout:   time.Second,
		Transport: &http.Transport{DisableKeepAlives: true, Proxy: nil},
	}
	defer client.CloseIdleConnections()
	deadline := time.Now().Add(startTimeout)
	for {
		if !p.Running() {
			s.proc = nil
			out := p.Output()
			err := fmt.Errorf("nginx exited before answering (%v); %s:\n%s", p.Err(), s.log, redistest.Tail(out, 40))
			if bytes.Contains(out, []byte("Address already in use")) {
				err = fmt.Errorf("%w: %w", errPortInUse, err)
			}
			return err
		}
		if ready(client, s.URL()+readyPath, token) {
			return nil
		}
		if time.Now().After(deadline) {
			_ = s.stop()
			return fmt.Errorf("nginx did not answer on %s within %v; %s:\n%s",
				s.URL(), startTimeout, s.log, redistest.Tail(p.Output(), 40))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ready reports whether url answers 200 with token: our nginx, and not
// another process that took the port, is listening.
func ready(client *http.Client, url, token string) bool {
	resp, err := client.Get(url)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 1<<10))
	return err == nil && resp.StatusCode == http.StatusOK && string(b) == token
}

// stop ends the process, if running: SIGTERM, then SIGKILL if it has not
// exited within stopTimeout.
func (s *Server) stop() error {
	p := s.proc
	if p == nil {
		return nil
	}
	s.proc = nil
	if !p.Running() {
		return nil
	}
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		_ = p.Cmd.Process.Kill()
	}
	select {
	case <-p.Exited():
		return nil
	case <-time.After(stopTimeout):
	}
	if err := p.Cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("killing nginx %d: %w", p.Cmd.Process.Pid, err)
	}
	select {
	case <-p.Exited():
		return nil
	case <-time.After(stopTimeout):
		return fmt.Errorf("nginx %d did not exit within %v of SIGKILL", p.Cmd.Process.Pid, stopTimeout)
	}
}

// cleanup stops nginx and gives its port back. If the test failed it
// first logs the tail of the error log, which the removal of the test's
// temporary directory is about to delete.
func (s *Server) cleanup() {
	if s.tb.Failed() {
		s.tb.Logf("nginxtest: nginx %s, last lines of %s:\n%s",
			s.URL(), s.log, redistest.LogTail(s.log, logTailLines))
	}
	if err := s.stop(); err != nil {
		s.tb.Errorf("nginxtest: %v", err)
	}
	if s.release != nil {
		s.release()
		s.release = nil
	}
}
