// Package request names a request's host (quota.Host), reads a
// request's body whole, for a metered Transport's estimate, wraps the
// body of a response so that it tells how the response ended (read to the
// end, closed early, failed, or garbage collected unclosed), for the
// concurrency slot its request holds, and keeps the response times the
// linger of a slot follows.
package request

import (
	"io"
	"net/http"
	"runtime"
	"sync"
)

// An End is how a response body ended.
type End int

const (
	Done   End = iota // read to the end, the provider's work over
	Closed            // closed before its end, or garbage collected unclosed
	Failed            // a read failed: the connection broke, or the context ended
)

// Hold makes resp's body call end once, when it is read to the end,
// closed, fails or is garbage collected unclosed. A response without a
// body calls end(Done) at once.
func Hold(resp *http.Response, end func(End)) { Watch(resp, nil, end) }

// Watch is Hold that also writes to seen, when not nil, the bytes of the
// body as its reader reads them, before end is called.
func Watch(resp *http.Response, seen io.Writer, end func(End)) {
	if resp.Body == nil || resp.Body == http.NoBody {
		end(Done)
		return
	}
	e := &ender{end: end} // apart from the body, so that the cleanup can run
	b := &body{ReadCloser: resp.Body, ender: e, seen: seen}
	runtime.AddCleanup(b, func(e *ender) { e.call(Closed) }, e)
	if w, ok := resp.Body.(io.Writer); ok {
		// A 101 Switching Protocols body is also the connection's writer.
		resp.Body = &bodyWriter{b, w}
		return
	}
	resp.Body = b
}

// An ender calls end once.
type ender struct {
	once sync.Once
	end  func(End)
}

func (e *ender) call(how End) { e.once.Do(func() { e.end(how) }) }

// body is a response body that tells how it ended.
type body struct {
	io.ReadCloser
	*ender
	seen io.Writer // nil, or what is told the bytes read
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if n > 0 && b.seen != nil {
		_, _ = b.seen.Write(p[:n])
	}
	switch {
	case err == io.EOF:
		b.call(Done)
	case err != nil:
		b.call(Failed)
	}
	return n, err
}

func (b *body) Close() error {
	err := b.ReadCloser.Close()
	b.call(Closed)
	return err
}

type bodyWriter struct {
	*body
	io.Writer
}
