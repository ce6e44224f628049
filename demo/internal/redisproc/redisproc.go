// Package redisproc runs a throwaway redis-server on a loopback port, and
// can kill it with SIGKILL and start it again on the same port, as an outage
// would.
package redisproc

import (
	"bufio"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota/demo/internal/child"
)

// InstallHint tells how to get redis-server.
const InstallHint = "install it with: apt-get install redis-server (Debian/Ubuntu) or brew install redis (macOS); `make demo` installs it; or pass -redis ADDR"

// startTimeout bounds how long a launch may take to answer PING.
const startTimeout = 10 * time.Second

// A Server is a redis-server child process without persistence.
type Server struct {
	bin  string
	dir  string
	port int
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
}

// Start starts redis-server on a free loopback port and waits until it
// answers PING.
func Start() (*Server, error) {
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		return nil, fmt.Errorf("redis-server not found on PATH; %s", InstallHint)
	}
	dir, err := os.MkdirTemp("", "quota-demo-redis-")
	if err != nil {
		return nil, err
	}
	s := &Server{bin: bin, dir: dir}
	for range 10 {
		s.port = freePort()
		if err = s.launch(); err == nil {
			return s, nil
		}
	}
	os.RemoveAll(dir)
	return nil, err
}

// Addr returns the server's address, 127.0.0.1:PORT.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// Kill sends SIGKILL and waits for the process to exit.
func (s *Server) Kill() error {
	if s.cmd == nil {
		return nil
	}
	err := s.cmd.Process.Kill()
	<-s.done
	s.cmd = nil
	if errors.Is(err, os.ErrProcessDone) {
		err = nil
	}
	return err
}

// Restart starts the server again on the same port. It comes back empty.
func (s *Server) Restart() error {
	if err := s.Kill(); err != nil {
		return err
	}
	var err error
	for range 5 { // the port can stay busy for a moment
		if err = s.launch(); err == nil {
			return nil
		}
		time.Sleep(100 * time.Millisecond)
	}
	return err
}

// Stop kills the server and removes its directory.
func (s *Server) Stop() error {
	err := s.Kill()
	return errors.Join(err, os.RemoveAll(s.dir))
}

// launch starts the process on s.port and waits for PING.
func (s *Server) launch() error {
	logf, err := os.OpenFile(filepath.Join(s.dir, "redis.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(s.bin,
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir, "--daemonize", "no")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = child.Attr()
	if err := cmd.Start(); err != nil {
		return err
	}
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	s.cmd, s.done = cmd, done

	deadline := time.Now().Add(startTimeout)
	for ping(s.Addr()) != nil {
		select {
		case <-done:
			s.cmd = nil
			return fmt.Errorf("redis-server on %s exited at start; see %s", s.Addr(), logf.Name())
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = s.Kill()
			return fmt.Errorf("redis-server on %s did not answer PING within %v", s.Addr(), startTimeout)
		}
	}
	return nil
}

// ping sends an inline PING and expects +PONG.
func ping(addr string) error {
	conn, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(500 * time.Millisecond))
	if _, err := conn.Write([]byte("PING\r\n")); err != nil {
		return err
	}
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		return err
	}
	if strings.TrimSpace(line) != "+PONG" {
		return fmt.Errorf("PING answered %q", line)
	}
	return nil
}

// freePort returns a loopback port that is free now, below the kernel's
// usual range for outgoing connections (32768 and up on Linux) so that no
// client connection takes it while the server is down between Kill and
// Restart.
func freePort() int {
	for range 100 {
		p := 20000 + rand.IntN(12000)
		if ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p))); err == nil {
			ln.Close()
			return p
		}
	}
	return 20000 + rand.IntN(12000)
}
