package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// errNoRedis says that redis-server is not on PATH.
var errNoRedis = errors.New("redis-server not found on PATH; install it with: apt-get install redis-server")

const (
	// serverStartTimeout bounds how long a server may take to answer PING.
	serverStartTimeout = 10 * time.Second
	// serverAttempts is how many free ports are tried before giving up.
	serverAttempts = 5
)

// server is a redis-server child process on a loopback port, with nothing
// persisted.
type server struct {
	cmd    *exec.Cmd
	addr   string
	dir    string
	out    *lockedBuffer
	exited chan struct{}
}

// startServer starts bin on a free loopback port and waits until it
// answers PING. It retries on another port when the one picked was taken
// in the meantime.
func startServer(ctx context.Context, bin string) (*server, error) {
	path, err := exec.LookPath(bin)
	if err != nil {
		return nil, errNoRedis
	}
	var lastErr error
	for range serverAttempts {
		s, err := launch(ctx, path)
		if err == nil {
			return s, nil
		}
		lastErr = err
		if ctx.Err() != nil {
			break
		}
	}
	return nil, lastErr
}

// launch runs one redis-server on a port that was free a moment ago.
func launch(ctx context.Context, path string) (*server, error) {
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "quota-bench-")
	if err != nil {
		return nil, err
	}
	s := &server{
		addr:   net.JoinHostPort("127.0.0.1", strconv.Itoa(port)),
		dir:    dir,
		out:    &lockedBuffer{},
		exited: make(chan struct{}),
	}
	s.cmd = exec.Command(path,
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no",
		"--dir", dir, "--daemonize", "no")
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	s.cmd.SysProcAttr = sysProcAttr()
	if err := s.cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	go func() { _ = s.cmd.Wait(); close(s.exited) }()
	if err := s.waitReady(ctx); err != nil {
		s.stop()
		return nil, fmt.Errorf("redis-server on %s: %w\n%s", s.addr, err, s.out.String())
	}
	return s, nil
}

// waitReady polls the server with PING until it answers or exits.
func (s *server) waitReady(ctx context.Context) error {
	rdb := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer rdb.Close()
	deadline := time.Now().Add(serverStartTimeout)
	for time.Now().Before(deadline) {
		select {
		case <-s.exited:
			return errors.New("exited at start")
		case <-ctx.Done():
			return ctx.Err()
		default:
		}
		if rdb.Ping(ctx).Err() == nil {
			return nil
		}
		time.Sleep(20 * time.Millisecond)
	}
	return fmt.Errorf("no answer to PING within %v", serverStartTimeout)
}

// stop kills the server, waits for it and removes its directory.
func (s *server) stop() {
	_ = s.cmd.Process.Kill()
	<-s.exited
	os.RemoveAll(s.dir)
}

// freePort returns a loopback TCP port that was free when asked.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// lockedBuffer collects a process's output; the process writes it while
// an error report may read it.
type lockedBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
