// Package faultproxy provides a fault-injecting TCP proxy for tests.
//
// A [Proxy] listens on a loopback port and forwards every accepted
// connection to a target address, typically a redis-server started by the
// test. Faults can be switched on and off at any time and affect live
// connections as well as new ones: added latency ([Proxy.SetDelay]), a
// network partition that swallows traffic ([Proxy.Blackhole]), connection
// resets ([Proxy.ResetAll], [Proxy.Refuse]) and lost replies
// ([Proxy.DropNextReplies]).
//
// # Chunks
//
// The proxy does not parse the protocol it carries. It forwards data in
// chunks, a chunk being whatever one Read on the source connection returns
// (at most 32 KiB). For the small request/reply traffic of redis at low
// concurrency one chunk is one command or one reply, but pipelined or large
// replies may be split across chunks or share one.
package faultproxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const (
	// chunkSize is the read buffer size, hence the largest chunk.
	chunkSize = 32 << 10
	// dialTimeout bounds connecting to the target.
	dialTimeout = 5 * time.Second
	// drainPoll is how often a blackholed connection without upstream
	// checks whether the blackhole was lifted.
	drainPoll = 50 * time.Millisecond
)

// Proxy is a fault-injecting TCP proxy created by [New]. Its methods are
// safe for concurrent use. It is closed when the test that created it
// finishes.
type Proxy struct {
	target string
	ln     net.Listener

	delay     atomic.Int64 // time.Duration
	blackhole atomic.Bool
	refuse    atomic.Bool
	drop      atomic.Int64 // server->client chunks still to discard
	accepted  atomic.Int64

	mu     sync.Mutex
	closed bool
	links  map[*link]struct{}

	wg         sync.WaitGroup // connection handlers
	acceptDone chan struct{}
}

// link is one proxied connection: the accepted client side and, once
// dialed, the server side.
type link struct {
	client *net.TCPConn
	done   chan struct{} // closed when the link is closed

	mu     sync.Mutex
	server *net.TCPConn // nil until dialed
	closed bool
}

// setServer attaches the dialed server side; it reports false, leaving
// server to the caller, if the link was closed meanwhile.
func (l *link) setServer(server *net.TCPConn) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed {
		return false
	}
	l.server = server
	return true
}

// close closes both sides once. With rst the sockets are closed with
// SO_LINGER 0 so the peers see a connection reset instead of an orderly
// shutdown.
func (l *link) close(rst bool) {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.closed = true
	server := l.server
	l.mu.Unlock()
	for _, c := range []*net.TCPConn{l.client, server} {
		if c == nil {
			continue
		}
		if rst {
			_ = c.SetLinger(0)
		}
		_ = c.Close()
	}
	close(l.done)
}

// New starts a proxy on 127.0.0.1 (a kernel-chosen port) that forwards each
// accepted connection to target. Each connection is served by two
// goroutines, one per direction. When the test finishes the proxy stops
// listening, closes all live connections and waits for its goroutines.
func New(tb testing.TB, target string) *Proxy {
	tb.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatalf("faultproxy: listen: %v", err)
	}
	p := &Proxy{
		target:     target,
		ln:         ln,
		links:      map[*link]struct{}{},
		acceptDone: make(chan struct{}),
	}
	go p.acceptLoop()
	tb.Cleanup(p.close)
	return p
}

// Addr returns the address clients should connect to, "127.0.0.1:PORT".
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target returns the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// Conns returns the number of connections accepted so far, including those
// reset because of [Proxy.Refuse].
func (p *Proxy) Conns() int { return int(p.accepted.Load()) }

// Live returns the number of connections currently open through the
// proxy.
func (p *Proxy) Live() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.links)
}

// SetDelay holds every chunk, in both directions, for d after it is read
// and before it is written on. Chunks of one direction are forwarded in
// order, so back-to-back chunks each add d. Zero or a negative d removes
// the delay; a changed delay applies from the next chunk read.
func (p *Proxy) SetDelay(d time.Duration) { p.delay.Store(int64(max(d, 0))) }

// Blackhole, while on, makes the proxy keep accepting connections and
// reading from both sides but forward nothing in either direction: clients
// see the server hang. Data read meanwhile is discarded, not replayed when
// the blackhole is lifted, so a live connection is left out of step with
// the protocol and clients should use new connections afterwards. Closes
// (EOF) still propagate. If the target cannot be reached while the
// blackhole is on, new connections hang until it is lifted and are then
// closed.
func (p *Proxy) Blackhole(on bool) { p.blackhole.Store(on) }

// Refuse, while on, makes the proxy accept new connections and immediately
// reset them (SO_LINGER 0), so a client sees a connection reset: on its
// first read or write, or already when dialing, since on loopback the reset
// can arrive before the dialer has checked the new socket. Live connections
// are not affected.
func (p *Proxy) Refuse(on bool) { p.refuse.Store(on) }

// DropNextReplies makes the proxy read the next n chunks travelling from
// the server to any client and discard them instead of forwarding them: a
// command still runs on the server but its reply is lost and the client
// times out. It replaces any count still pending; n <= 0 cancels it.
// Chunks swallowed by [Proxy.Blackhole] do not count.
func (p *Proxy) DropNextReplies(n int) { p.drop.Store(int64(max(n, 0))) }

// ResetAll closes every live connection with a TCP reset (SO_LINGER 0
// before Close), on both the client and the server side. The listener stays
// open and new connections are proxied as usual.
func (p *Proxy) ResetAll() {
	for _, l := range p.snapshot() {
		l.close(true)
	}
}

// snapshot returns the live links.
func (p *Proxy) snapshot() []*link {
	p.mu.Lock()
	defer p.mu.Unlock()
	ls := make([]*link, 0, len(p.links))
	for l := range p.links {
		ls = append(ls, l)
	}
	return ls
}

// close stops the listener, closes every link and waits for all
// goroutines.
func (p *Proxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	_ = p.ln.Close()
	<-p.acceptDone
	for _, l := range p.snapshot() {
		l.close(false)
	}
	p.wg.Wait()
}

func (p *Proxy) acceptLoop() {
	defer close(p.acceptDone)
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Transient errors such as running out of file descriptors.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.accepted.Add(1)
		tc := c.(*net.TCPConn)
		if p.refuse.Load() {
			_ = tc.SetLinger(0)
			_ = tc.Close()
			continue
		}
		l := &link{client: tc, done: make(chan struct{})}
		if !p.track(l) {
			l.close(true)
			continue
		}
		p.wg.Add(1)
		go p.serve(l)
	}
}

// track registers l as live; it reports false once the proxy is closed.
func (p *Proxy) track(l *link) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.links[l] = struct{}{}
	return true
}

func (p *Proxy) untrack(l *link) {
	p.mu.Lock()
	defer p.mu.Unlock()
	delete(p.links, l)
}

// serve dials the target for l and copies in both directions until both
// are finished or the link is closed.
func (p *Proxy) serve(l *link) {
	defer p.wg.Done()
	defer p.untrack(l)
	defer l.close(false)

	c, err := net.DialTimeout("tcp", p.target, dialTimeout)
	if err != nil {
		p.drainWhileBlackholed(l)
		return
	}
	server := c.(*net.TCPConn)
	if !l.setServer(server) {
		_ = server.Close()
		return
	}

	upDone := make(chan struct{})
	go func() {
		defer close(upDone)
		p.pipe(l, l.client, server, false)
	}()
	p.pipe(l, server, l.client, true)
	<-upDone
}

// drainWhileBlackholed keeps a connection whose target could not be
// reached open and silent while the blackhole is on.
func (p *Proxy) drainWhileBlackholed(l *link) {
	buf := make([]byte, chunkSize)
	for p.blackhole.Load() {
		_ = l.client.SetReadDeadline(time.Now().Add(drainPoll))
		_, err := l.client.Read(buf)
		var nerr net.Error
		if err != nil && !(errors.As(err, &nerr) && nerr.Timeout()) {
			return
		}
	}
}

// pipe copies chunks from src to dst, applying the current faults to each.
// toClient tells whether src is the server side. On EOF it half-closes dst;
// on any other error it closes the whole link.
func (p *Proxy) pipe(l *link, src, dst *net.TCPConn, toClient bool) {
	buf := make([]byte, chunkSize)
	for {
		n, err := src.Read(buf)
		if n > 0 && !p.forward(l, dst, buf[:n], toClient) {
			l.close(false)
			return
		}
		if err != nil {
			if errors.Is(err, io.EOF) {
				_ = dst.CloseWrite()
			} else {
				l.close(false)
			}
			return
		}
	}
}

// forward writes one chunk to dst unless a fault swallows it. It reports
// false if the link is closed or the write fails.
func (p *Proxy) forward(l *link, dst *net.TCPConn, chunk []byte, toClient bool) bool {
	if d := time.Duration(p.delay.Load()); d > 0 {
		t := time.NewTimer(d)
		select {
		case <-t.C:
		case <-l.done:
			t.Stop()
			return false
		}
	}
	if p.blackhole.Load() {
		return true
	}
	if toClient && p.takeDrop() {
		return true
	}
	_, err := dst.Write(chunk)
	return err == nil
}

// takeDrop consumes one pending dropped reply, if any.
func (p *Proxy) takeDrop() bool {
	for {
		n := p.drop.Load()
		if n <= 0 {
			return false
		}
		if p.drop.CompareAndSwap(n, n-1) {
			return true
		}
	}
}
