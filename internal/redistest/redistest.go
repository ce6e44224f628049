// Package redistest starts real redis-server processes for tests.
//
// Every server is a child process of the test binary, listening on a
// freshly chosen loopback port and writing into a per-test temporary
// directory; nothing is persisted (no RDB, no AOF). A server never relies on
// another instance already running on the machine, and its ports stay
// reserved, while the Server lives, against the other test binaries using
// this package at the same time (go test ./... runs several).
//
// The package provides a single server ([Start]), a Redis Cluster
// ([StartCluster]) and a master/replica pair watched by Sentinel
// ([StartSentinel]), plus fault controls on each process ([Server.Kill],
// [Server.Restart], [Server.Pause], [Server.Resume]).
//
// # Failover
//
// Redis Cluster does not promote a replica that has not completed a sync
// with its master, and a replica promoted while behind lacks the master's
// last writes. A test that kills a master should therefore first call
// [Cluster.WaitInSync] (with the key whose master it kills) or
// [Sentinel.WaitInSync], and kill [Cluster.MasterFor] or
// [Sentinel.CurrentMaster]. StartCluster, StartSentinel and Restart already
// wait for the same condition before they return, but the test's own writes
// and a failover happen after that.
//
// When the redis binaries are not on PATH the tests that need them are
// skipped, unless the environment variable QUOTA_REQUIRE_REDIS is set to 1,
// in which case they fail.
//
// # Goroutines
//
// The helpers report errors with Fatalf on the testing.TB they were given,
// so they must be called from the goroutine running that test (not from
// goroutines the test starts, and not from a subtest when the server belongs
// to the parent test).
package redistest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RequireEnv is the environment variable that turns a missing redis binary
// from a skipped test into a failed one when it is set to "1".
const RequireEnv = "QUOTA_REQUIRE_REDIS"

const (
	// startTimeout bounds how long a process may take to answer PING.
	startTimeout = 10 * time.Second
	// killTimeout bounds how long a killed process may take to be reaped.
	killTimeout = 10 * time.Second
	// logTailLines is how many lines of each server's log a failed test
	// reports.
	logTailLines = 25
	// startAttempts is how many ports Start tries before giving up.
	startAttempts = 20
	// busPortOffset is the distance between a cluster node's client port
	// and its cluster bus port.
	busPortOffset = 10000
	// minPort and maxPort bound the ports handed out; maxPort leaves room
	// for the cluster bus port (port+busPortOffset <= 65535).
	minPort = 20000
	maxPort = 65535 - busPortOffset
)

// Server is a redis-server (or redis-sentinel) child process started by
// [Start]. It is killed when the test that started it finishes.
//
// Its methods report failures with Fatalf on the testing.TB passed to
// [Start] and must therefore be called from that test's goroutine.
type Server struct {
	tb   testing.TB
	bin  string
	dir  string
	log  string
	port int
	// build returns the command-line arguments for a launch on port.
	build func(port int) ([]string, error)
	// settle, when set by StartCluster or StartSentinel, waits after a
	// Restart until the server has rejoined its group.
	settle func() error

	mu     sync.Mutex
	proc   *Proc // nil when not running
	paused bool
}

// Start starts a redis-server on a free loopback port and waits until it
// answers PING. It runs the server with
//
//	--port N --bind 127.0.0.1 --save "" --appendonly no --dir DIR --daemonize no
//
// followed by args, so args may override any of these settings except the
// port. DIR is a fresh temporary directory that also holds the server's log
// (redis.log), whose tail is reported if the server fails to start.
//
// If redis-server is not on PATH the test is skipped, or fails when the
// environment variable QUOTA_REQUIRE_REDIS is 1. The server is killed when
// the test and its subtests finish.
func Start(tb testing.TB, args ...string) *Server {
	tb.Helper()
	bin := lookBinary(tb, "redis-server", serverInstallHint())
	dir := tb.TempDir()
	extra := append([]string(nil), args...)
	s := newServer(tb, bin, dir, func(port int) ([]string, error) {
		a := []string{
			"--port", strconv.Itoa(port),
			"--bind", "127.0.0.1",
			"--save", "",
			"--appendonly", "no",
			"--dir", dir,
			"--daemonize", "no",
		}
		return append(a, extra...), nil
	})
	s.startFresh()
	return s
}

// newServer returns a Server that is not running yet and registers its
// cleanup with tb.
func newServer(tb testing.TB, bin, dir string, build func(int) ([]string, error)) *Server {
	s := &Server{
		tb:    tb,
		bin:   bin,
		dir:   dir,
		log:   filepath.Join(dir, "redis.log"),
		build: build,
	}
	tb.Cleanup(s.cleanup)
	return s
}

// startFresh launches the server on newly picked ports until one launch
// succeeds. Launches that fail because the port was taken in the meantime
// are retried on another port.
func (s *Server) startFresh() {
	s.tb.Helper()
	var lastErr error
	for range startAttempts {
		port, err := reservePort()
		if err != nil {
			s.tb.Fatalf("redistest: %v", err)
		}
		s.mu.Lock()
		err = s.launchLocked(port)
		if err != nil {
			s.port = 0
		}
		s.mu.Unlock()
		if err == nil {
			return
		}
		releasePort(port)
		lastErr = err
		if !errors.Is(err, errPortInUse) {
			break
		}
	}
	s.tb.Fatalf("redistest: starting %s: %v", filepath.Base(s.bin), lastErr)
}

// cleanup kills the process and gives its port back. If the test failed
// it first logs the tail of the server's log, which the removal of the
// test's temporary directory is about to delete.
func (s *Server) cleanup() {
	if s.tb.Failed() {
		s.tb.Logf("redistest: %s %s, last lines of %s:\n%s",
			filepath.Base(s.bin), s.Addr(), s.log, LogTail(s.log, logTailLines))
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.killLocked(); err != nil {
		s.tb.Errorf("redistest: %v", err)
	}
	if s.port != 0 {
		releasePort(s.port)
	}
}

// Addr returns the server's address, "127.0.0.1:PORT".
func (s *Server) Addr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.Port()))
}

// Port returns the server's TCP port. It stays the same across
// [Server.Restart].
func (s *Server) Port() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.port
}

// Dir returns the server's working directory, which holds its log file.
func (s *Server) Dir() string { return s.dir }

// LogFile returns the path of the file receiving the server's stdout and
// stderr across all its launches.
func (s *Server) LogFile() string { return s.log }

// Client returns a go-redis client connected to the server. Each opts
// function may adjust the options before the client is created (Addr is
// preset). The client is closed when the test finishes, before the server
// is killed.
func (s *Server) Client(tb testing.TB, opts ...func(*redis.Options)) *redis.Client {
	tb.Helper()
	o := &redis.Options{Addr: s.Addr()}
	for _, f := range opts {
		f(o)
	}
	c := redis.NewClient(o)
	tb.Cleanup(func() { _ = c.Close() })
	return c
}

// Kill sends SIGKILL to the server (resuming it first if it is paused) and
// waits for it to exit. Killing a server that is not running does nothing.
func (s *Server) Kill() {
	s.tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.killLocked(); err != nil {
		s.tb.Fatalf("redistest: %v", err)
	}
}

// Restart kills the server if it is running and starts it again on the same
// port with the same arguments, waiting until it answers PING. Since nothing
// is saved, a plain server comes back empty; a cluster node keeps its
// cluster configuration file and a sentinel its rewritten configuration.
//
// A node of a [Cluster] or of a [Sentinel] setup is also waited for until
// it has rejoined: see [Cluster.WaitInSync] and [Sentinel.WaitInSync] for
// what that means. Restart then returns with the node's replicas (or the
// node itself, as a replica) in sync, ready to be killed again.
func (s *Server) Restart() {
	s.tb.Helper()
	if err := s.relaunch(); err != nil {
		s.tb.Fatalf("redistest: restarting %s: %v", s.Addr(), err)
	}
	if s.settle != nil {
		if err := s.settle(); err != nil {
			s.tb.Fatalf("redistest: %s restarted but did not rejoin: %v", s.Addr(), err)
		}
	}
}

// relaunch kills the process, if running, and launches it on its port.
func (s *Server) relaunch() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.killLocked(); err != nil {
		return err
	}
	var err error
	// The port can stay busy for a moment after the old process dies.
	for attempt := 0; attempt < 5; attempt++ {
		if err = s.launchLocked(s.port); !errors.Is(err, errPortInUse) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	return err
}

// Pause stops the server with SIGSTOP. The kernel still accepts
// connections and buffers requests for it, but it answers nothing until
// [Server.Resume]. Pausing a paused server does nothing.
func (s *Server) Pause() {
	s.tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.proc == nil || !s.proc.Running() {
		s.tb.Fatalf("redistest: pausing %s: server is not running", s.addrLocked())
	}
	if s.paused {
		return
	}
	if err := stopProcess(s.proc.Cmd.Process); err != nil {
		s.tb.Fatalf("redistest: pausing %s: %v", s.addrLocked(), err)
	}
	s.paused = true
}

// Resume continues a server stopped by [Server.Pause] with SIGCONT.
// Resuming a server that is not paused does nothing.
func (s *Server) Resume() {
	s.tb.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.resumeLocked(); err != nil {
		s.tb.Fatalf("redistest: %v", err)
	}
}

// Running reports whether the server process is alive (possibly paused).
func (s *Server) Running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.proc != nil && s.proc.Running()
}

// Paused reports whether the server is stopped by [Server.Pause].
func (s *Server) Paused() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.paused
}

func (s *Server) addrLocked() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port))
}

func (s *Server) resumeLocked() error {
	if !s.paused {
		return nil
	}
	if s.proc != nil && s.proc.Running() {
		if err := continueProcess(s.proc.Cmd.Process); err != nil {
			return fmt.Errorf("resuming %s: %w", s.addrLocked(), err)
		}
	}
	s.paused = false
	return nil
}

// killLocked kills the current process, if any, and waits for it.
func (s *Server) killLocked() error {
	p := s.proc
	if p == nil {
		return nil
	}
	if err := s.resumeLocked(); err != nil {
		return err
	}
	s.proc = nil
	if !p.Running() {
		return nil
	}
	if err := p.Cmd.Process.Kill(); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("killing %s: %w", s.addrLocked(), err)
	}
	select {
	case <-p.Exited():
		return nil
	case <-time.After(killTimeout):
		return fmt.Errorf("killing %s: process %d did not exit within %v", s.addrLocked(), p.Cmd.Process.Pid, killTimeout)
	}
}

// errPortInUse marks a launch that failed because its port was taken.
var errPortInUse = errors.New("port already in use")

// launchLocked starts the binary on port and waits until it answers PING.
// On failure the process is gone and the error includes the log tail.
func (s *Server) launchLocked(port int) error {
	args, err := s.build(port)
	if err != nil {
		return err
	}
	p, err := Launch("redistest", s.bin, args, s.dir, s.log)
	if err != nil {
		return err
	}
	s.port = port
	s.proc = p
	s.paused = false

	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	deadline := time.Now().Add(startTimeout)
	for {
		if !p.Running() {
			s.proc = nil
			out := p.Output()
			err := fmt.Errorf("%s exited before answering PING (%v); log:\n%s", addr, p.Err(), Tail(out, 40))
			if bytes.Contains(out, []byte("Address already in use")) ||
				bytes.Contains(out, []byte("Failed listening on port")) {
				err = fmt.Errorf("%w: %w", errPortInUse, err)
			}
			return err
		}
		if pingRaw(addr, p.Cmd.Process.Pid) == nil {
			return nil
		}
		if time.Now().After(deadline) {
			_ = s.killLocked()
			return fmt.Errorf("%s did not answer PING within %v; log:\n%s", addr, startTimeout, Tail(p.Output(), 40))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// pingRaw sends an inline PING over a new connection and expects +PONG,
// then checks with INFO server that the process answering is the one with
// process ID pid: another process may have started a server on the same
// port a moment earlier, and its PONG must not pass for our server's.
func pingRaw(addr string, pid int) error {
	conn, err := net.DialTimeout("tcp", addr, 500*time.Millisecond)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := conn.Write([]byte("PING\r\nINFO server\r\n")); err != nil {
		return err
	}
	r := bufio.NewReader(conn)
	line, err := r.ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != "+PONG" {
		return fmt.Errorf("PING answered %q", strings.TrimSpace(line))
	}
	// INFO answers with a bulk string: $LENGTH CRLF DATA CRLF.
	line, err = r.ReadString('\n')
	if err != nil {
		return err
	}
	n, err := strconv.Atoi(strings.TrimPrefix(strings.TrimSpace(line), "$"))
	if err != nil || !strings.HasPrefix(line, "$") {
		return fmt.Errorf("INFO server answered %q", strings.TrimSpace(line))
	}
	info := make([]byte, n)
	if _, err := io.ReadFull(r, info); err != nil {
		return err
	}
	if got := infoField(string(info), "process_id"); got != strconv.Itoa(pid) {
		return fmt.Errorf("%s is answered by process %s, not by %d", addr, got, pid)
	}
	return nil
}

// quoteArgs quotes empty and blank-containing arguments for the log.
func quoteArgs(args []string) []string {
	out := make([]string, len(args))
	for i, a := range args {
		if a == "" || strings.ContainsAny(a, " \t") {
			a = strconv.Quote(a)
		}
		out[i] = a
	}
	return out
}

// lookBinary finds name on PATH. When it is missing the test is skipped, or
// fails if QUOTA_REQUIRE_REDIS=1; hint tells how to install it.
func lookBinary(tb testing.TB, name, hint string) string {
	tb.Helper()
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	msg := fmt.Sprintf("redistest: %s not found on PATH (%s)", name, hint)
	if os.Getenv(RequireEnv) == "1" {
		tb.Fatalf("%s; %s=1 requires it", msg, RequireEnv)
	}
	skipped.Store(tb.Name(), true)
	tb.Skipf("%s; set %s=1 to fail instead of skipping", msg, RequireEnv)
	return ""
}

// skipped holds the names of the tests skipped for want of a binary, for
// Main.
var skipped sync.Map

// Main runs a package's tests as m.Run does and returns its exit code.
// When tests were skipped for want of redis-server, it then says so once:
// how many, and how to run them. It writes to the terminal when there is
// one, since go test ./... shows nothing of a package that passed but its
// summary line, and to stderr otherwise. Call it from TestMain:
// os.Exit(redistest.Main(m)).
func Main(m *testing.M) int {
	code := m.Run()
	n := 0
	skipped.Range(func(any, any) bool { n++; return true })
	Skipped(n, "redis-server", serverInstallHint())
	return code
}

// Skipped tells, when n is above zero, that n tests were skipped for want
// of tool, and how to install it (hint): on the terminal when there is
// one, since go test ./... shows nothing of a package that passed but its
// summary line, and to stderr otherwise.
func Skipped(n int, tool, hint string) {
	if n == 0 {
		return
	}
	var w io.Writer = os.Stderr
	if tty, err := os.OpenFile("/dev/tty", os.O_WRONLY, 0); err == nil {
		defer tty.Close()
		w = tty
	}
	fmt.Fprintf(w, "\n"+
		"**********************************************************************\n"+
		"  %d test(s) SKIPPED: they need %s, which is not on PATH.\n"+
		"  Nothing they check was checked. To run them: %s,\n"+
		"  or run make test, which installs it on Debian.\n"+
		"**********************************************************************\n\n",
		n, tool, hint)
}

// serverInstallHint tells how to install redis-server and redis-cli.
func serverInstallHint() string {
	if runtime.GOOS == "darwin" {
		return "install it with: brew install redis"
	}
	return "install it with: apt-get install redis-server (Debian/Ubuntu) or brew install redis (macOS)"
}

// sentinelInstallHint tells how to install redis-sentinel.
func sentinelInstallHint() string {
	if runtime.GOOS == "darwin" {
		return "install it with: brew install redis"
	}
	return "install it with: apt-get install redis-sentinel (Debian/Ubuntu) or brew install redis (macOS)"
}

// Port allocation.
//
// Ports are drawn at random from [minPort, maxPort]. Where possible both the
// port and port+busPortOffset lie outside the kernel's ephemeral range, so
// that outgoing connections cannot grab a port while a server is down
// between Kill and Restart.
//
// A port and its bus port are reserved for the life of the Server, also
// while it is killed, and not only among the servers of this test binary:
// each reserved port is also locked (flock) through a file in
// os.TempDir()/redistest-ports, so that the other test binaries that
// `go test ./...` runs at the same time, or tests of another checkout, do
// not start a server on it either. Without that, another binary could start
// a cluster node on the port of a master a test has just killed; the killed
// master's peers would then reach a node with another ID at its address,
// flag the master "noaddr", stop counting it as failing, and never fail it
// over. The locks end with the process, however it exits. Processes that
// start servers by other means are detected by test-listening and, if they
// win a race, by the retry in startFresh.
var (
	portMu       sync.Mutex
	portReserved = map[int]*os.File{} // port -> its lock file, nil if none
	portOnce     sync.Once
	portChoices  []int
)

// portLockDir is the directory of the lock files that reserve ports across
// processes.
var portLockDir = filepath.Join(os.TempDir(), "redistest-ports")

// reservePort picks and reserves a port whose bus port is also free.
func reservePort() (int, error) {
	portOnce.Do(func() { portChoices = candidatePorts() })
	portMu.Lock()
	defer portMu.Unlock()
	for range 1000 {
		p := portChoices[rand.IntN(len(portChoices))]
		b := p + busPortOffset
		if _, ok := portReserved[p]; ok {
			continue
		}
		if _, ok := portReserved[b]; ok {
			continue
		}
		lp, ok := lockPort(p)
		if !ok {
			continue
		}
		lb, ok := lockPort(b)
		if !ok || !canListen(p) || !canListen(b) {
			closeLock(lp)
			closeLock(lb)
			continue
		}
		portReserved[p] = lp
		portReserved[b] = lb
		return p, nil
	}
	return 0, errors.New("no free loopback port found")
}

// releasePort gives back a port reserved by reservePort.
func releasePort(p int) {
	portMu.Lock()
	defer portMu.Unlock()
	for _, q := range []int{p, p + busPortOffset} {
		closeLock(portReserved[q])
		delete(portReserved, q)
	}
}

// ReservePort reserves a free loopback port for a server that another
// package's test helper starts (nginxtest's), against the servers of this
// package and those of the other test binaries using it, as the ports of
// [Start] are (see Port allocation above), with the port 10000 above it,
// which a cluster node would use as its bus port. release gives both back;
// the reservation also ends with the process.
func ReservePort() (port int, release func(), err error) {
	port, err = reservePort()
	if err != nil {
		return 0, nil, err
	}
	return port, func() { releasePort(port) }, nil
}

// lockPort locks port's file in portLockDir. It reports false if another
// process (or another Server of this one) holds the lock. When the lock
// file cannot be created at all it reports true with a nil file: the port
// is then coordinated within this process only.
func lockPort(port int) (*os.File, bool) {
	if err := os.MkdirAll(portLockDir, 0o777); err != nil {
		return nil, true
	}
	// Read-only is enough for flock and lets other users lock a file this
	// user created.
	f, err := os.OpenFile(filepath.Join(portLockDir, strconv.Itoa(port)), os.O_RDONLY|os.O_CREATE, 0o644)
	if err != nil {
		return nil, true
	}
	if err := lockFile(f); err != nil {
		f.Close()
		return nil, false
	}
	return f, true
}

// closeLock releases a lock taken by lockPort; f may be nil.
func closeLock(f *os.File) {
	if f != nil {
		f.Close()
	}
}

// canListen reports whether 127.0.0.1:port can be listened on right now.
func canListen(port int) bool {
	ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		return false
	}
	ln.Close()
	return true
}

// candidatePorts lists the ports in [minPort, maxPort] that, together with
// their bus ports, avoid the ephemeral range; all of them if none do.
func candidatePorts() []int {
	lo, hi := ephemeralRange()
	in := func(p int) bool { return p >= lo && p <= hi }
	var ports []int
	for p := minPort; p <= maxPort; p++ {
		if !in(p) && !in(p+busPortOffset) {
			ports = append(ports, p)
		}
	}
	if len(ports) == 0 {
		for p := minPort; p <= maxPort; p++ {
			ports = append(ports, p)
		}
	}
	return ports
}

// ephemeralRange returns the kernel's range for outgoing local ports.
func ephemeralRange() (lo, hi int) {
	lo, hi = 49152, 65535 // IANA default, used by macOS and BSDs
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return lo, hi
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return lo, hi
	}
	l, err1 := strconv.Atoi(f[0])
	h, err2 := strconv.Atoi(f[1])
	if err1 != nil || err2 != nil {
		return lo, hi
	}
	return l, h
}

// queryTimeout bounds each command the helpers send while polling.
const queryTimeout = 2 * time.Second

// pollInterval is how often the waits for replicas to be in sync check.
const pollInterval = 100 * time.Millisecond

// adminClient returns a short-lived client for helper queries to addr.
func adminClient(addr string) *redis.Client {
	return redis.NewClient(&redis.Options{
		Addr:            addr,
		DialTimeout:     queryTimeout,
		ReadTimeout:     queryTimeout,
		WriteTimeout:    queryTimeout,
		MaxRetries:      -1,
		PoolSize:        1,
		DisableIdentity: true,
	})
}

// infoField returns the value of field in an INFO or CLUSTER INFO reply.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// waitFor polls cond every interval until it returns nil or timeout
// elapses, and returns the last error.
func waitFor(timeout, interval time.Duration, cond func(ctx context.Context) error) error {
	deadline := time.Now().Add(timeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), queryTimeout)
		err := cond(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("timed out after %v: %w", timeout, err)
		}
		time.Sleep(interval)
	}
}

// Long skips the test under go test -short (make check): a test that
// takes long, runs several processes or a Cluster, or kills servers.
func Long(tb testing.TB) {
	tb.Helper()
	if testing.Short() {
		tb.Skip("long: skipped under -short; make test runs it")
	}
}
