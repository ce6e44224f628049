package request

import (
	"bytes"
	"errors"
	"io"
	"net/http"
)

// ErrTooLarge reports a request body longer than Read may read.
var ErrTooLarge = errors.New("request body too large")

// Read returns req's body, read whole, at most max bytes, and the request
// to send: req itself when its GetBody gives the body again, a clone that
// carries the body read otherwise. A longer body fails with ErrTooLarge.
func Read(req *http.Request, max int64) ([]byte, *http.Request, error) {
	if req.Body == nil || req.Body == http.NoBody {
		return nil, req, nil
	}
	if req.GetBody != nil {
		rc, err := req.GetBody()
		if err != nil {
			return nil, nil, err
		}
		defer rc.Close()
		body, err := readAll(rc, max)
		return body, req, err
	}
	body, err := readAll(req.Body, max)
	req.Body.Close()
	if err != nil {
		return nil, nil, err
	}
	sent := req.Clone(req.Context())
	sent.Body = io.NopCloser(bytes.NewReader(body))
	sent.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	sent.ContentLength = int64(len(body))
	return body, sent, nil
}

func readAll(r io.Reader, max int64) ([]byte, error) {
	body, err := io.ReadAll(io.LimitReader(r, max+1))
	if err != nil {
		return nil, err
	}
	if int64(len(body)) > max {
		return nil, ErrTooLarge
	}
	return body, nil
}
