package faultproxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// startEcho starts a TCP server on loopback that echoes every connection
// and returns its address. It stops when the test finishes.
func startEcho(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		conns []net.Conn
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, _ = io.Copy(c, c)
				_ = c.Close()
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	return ln.Addr().String()
}

// dial connects to addr and closes the connection when the test finishes.
func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// roundTrip writes msg and reads len(msg) bytes back within timeout.
func roundTrip(c net.Conn, msg string, timeout time.Duration) (string, error) {
	if err := c.SetDeadline(time.Now().Add(timeout)); err != nil {
		return "", err
	}
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

// mustEcho checks that msg comes back unchanged.
func mustEcho(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	got, err := roundTrip(c, msg, 2*time.Second)
	if err != nil || got != msg {
		t.Fatalf("echo %q = %q, %v", msg, got, err)
	}
}

func isTimeout(err error) bool {
	var nerr net.Error
	return errors.As(err, &nerr) && nerr.Timeout()
}

// mustTimeOut checks that a read times out after 200 ms.
func mustTimeOut(t *testing.T, c net.Conn, msg string) {
	t.Helper()
	_, err := roundTrip(c, msg, 200*time.Millisecond)
	if !isTimeout(err) {
		t.Fatalf("echo %q: err = %v, want a timeout", msg, err)
	}
}

// mustFail checks that a round trip fails quickly with an error other than
// a timeout.
func mustFail(t *testing.T, c net.Conn, msg string) error {
	t.Helper()
	_, err := roundTrip(c, msg, 2*time.Second)
	if err == nil || isTimeout(err) {
		t.Fatalf("echo %q: err = %v, want a connection error", msg, err)
	}
	return err
}

func TestForward(t *testing.T) {
	t.Parallel()
	p := New(t, startEcho(t))
	if p.Conns() != 0 {
		t.Fatalf("Conns() = %d before any connection", p.Conns())
	}
	a, b := dial(t, p.Addr()), dial(t, p.Addr())
	mustEcho(t, a, "hello")
	mustEcho(t, b, "world")
	mustEcho(t, a, "again")
	if p.Conns() != 2 {
		t.Fatalf("Conns() = %d, want 2", p.Conns())
	}
	if p.Live() != 2 {
		t.Fatalf("Live() = %d, want 2", p.Live())
	}

	// A client close propagates and the link goes away.
	_ = a.Close()
	deadline := time.Now().Add(2 * time.Second)
	for p.Live() != 1 {
		if time.Now().After(deadline) {
			t.Fatalf("Live() = %d after closing one client, want 1", p.Live())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestDelay(t *testing.T) {
	t.Parallel()
	p := New(t, startEcho(t))
	c := dial(t, p.Addr())
	mustEcho(t, c, "warm")

	const d = 100 * time.Millisecond
	p.SetDelay(d)
	start := time.Now()
	mustEcho(t, c, "slow")
	// The request and the reply are each delayed.
	if el := time.Since(start); el < 2*d || el > 2*d+time.Second {
		t.Fatalf("round trip with delay %v took %v, want about %v", d, el, 2*d)
	}

	p.SetDelay(0)
	start = time.Now()
	mustEcho(t, c, "fast")
	if el := time.Since(start); el > d {
		t.Fatalf("round trip without delay took %v", el)
	}
}

func TestBlackhole(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	p := New(t, startEcho(t))
	live := dial(t, p.Addr())
	mustEcho(t, live, "before")

	p.Blackhole(true)
	mustTimeOut(t, live, "live")
	c := dial(t, p.Addr()) // new connections are accepted but hang too
	mustTimeOut(t, c, "new")

	p.Blackhole(false)
	mustEcho(t, dial(t, p.Addr()), "after")
}

func TestBlackholeUnreachableTarget(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	target := ln.Addr().String()
	_ = ln.Close() // nothing listens there any more

	p := New(t, target)
	// Without the blackhole the proxy closes the client connection.
	_ = mustFail(t, dial(t, p.Addr()), "x")

	p.Blackhole(true)
	c := dial(t, p.Addr())
	mustTimeOut(t, c, "y")
	p.Blackhole(false)
	_ = mustFail(t, c, "z")
}

func TestResetAll(t *testing.T) {
	t.Parallel()
	p := New(t, startEcho(t))
	a, b := dial(t, p.Addr()), dial(t, p.Addr())
	mustEcho(t, a, "a")
	mustEcho(t, b, "b")

	p.ResetAll()
	for _, c := range []net.Conn{a, b} {
		_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
		_, err := c.Read(make([]byte, 1))
		if err == nil || isTimeout(err) {
			t.Fatalf("read after ResetAll: err = %v, want a reset", err)
		}
		t.Logf("read after ResetAll: %v", err)
	}
	mustEcho(t, dial(t, p.Addr()), "new")
}

func TestDropNextReplies(t *testing.T) {
	t.Parallel()
	p := New(t, startEcho(t))
	c := dial(t, p.Addr())
	mustEcho(t, c, "warm")

	p.DropNextReplies(1)
	mustTimeOut(t, c, "lost")
	mustEcho(t, c, "next")

	p.DropNextReplies(2)
	p.DropNextReplies(0) // cancels
	mustEcho(t, c, "kept")
}

func TestRefuse(t *testing.T) {
	t.Parallel()
	p := New(t, startEcho(t))
	live := dial(t, p.Addr())
	mustEcho(t, live, "before")

	p.Refuse(true)
	// On loopback the reset can arrive before the dialer has checked the
	// socket, so either the dial or the first round trip fails.
	for range 5 {
		c, err := net.DialTimeout("tcp", p.Addr(), time.Second)
		if err == nil {
			t.Cleanup(func() { _ = c.Close() })
			err = mustFail(t, c, "refused")
		}
		t.Logf("refused connection: %v", err)
	}
	mustEcho(t, live, "live") // existing connections keep working

	p.Refuse(false)
	mustEcho(t, dial(t, p.Addr()), "after")
	if p.Conns() != 7 {
		t.Fatalf("Conns() = %d, want 7 (refused ones count)", p.Conns())
	}
}

func TestTogglesUnderTraffic(t *testing.T) {
	t.Parallel()
	p := New(t, startEcho(t))
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, err := net.DialTimeout("tcp", p.Addr(), time.Second)
				if err != nil {
					continue
				}
				_, _ = roundTrip(c, "ping", 50*time.Millisecond)
				_ = c.Close()
			}
		}()
	}
	for i := range 50 {
		p.SetDelay(time.Duration(i%3) * time.Millisecond)
		p.Blackhole(i%5 == 0)
		p.Refuse(i%7 == 0)
		p.DropNextReplies(i % 2)
		if i%10 == 0 {
			p.ResetAll()
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(stop)
	wg.Wait()

	p.SetDelay(0)
	p.Blackhole(false)
	p.Refuse(false)
	p.DropNextReplies(0)
	mustEcho(t, dial(t, p.Addr()), "still works")
}
