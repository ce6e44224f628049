// Package request wraps the body of a response so that it releases what
// its request holds (a concurrency slot) when it is closed, read to the
// end, or garbage collected unclosed.
package request

import (
	"io"
	"net/http"
	"runtime"
)

// Hold makes resp's body call release, once it is closed or read to the
// end, or garbage collected unclosed. A response without a body calls it
// at once. release must be safe to call more than once.
func Hold(resp *http.Response, release func()) {
	if resp.Body == nil || resp.Body == http.NoBody {
		release()
		return
	}
	body := &body{ReadCloser: resp.Body, release: release}
	runtime.AddCleanup(body, func(release func()) { release() }, release)
	if w, ok := resp.Body.(io.Writer); ok {
		// A 101 Switching Protocols body is also the connection's writer.
		resp.Body = &bodyWriter{body, w}
		return
	}
	resp.Body = body
}

// body is a response body that calls release when it is closed or read
// to the end.
type body struct {
	io.ReadCloser
	release func()
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if err == io.EOF {
		b.release()
	}
	return n, err
}

func (b *body) Close() error {
	err := b.ReadCloser.Close()
	b.release()
	return err
}

type bodyWriter struct {
	*body
	io.Writer
}
