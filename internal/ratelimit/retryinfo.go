package ratelimit

import (
	"bytes"
	"encoding/json"
	"io"
	"math"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"time"
)

// maxErrorBody bounds what RetryAfter reads of an error answer's body to
// find its RetryInfo: a google.rpc error is a few KiB at most.
const maxErrorBody = 64 << 10

// retryInfo returns the pause that the google.rpc.RetryInfo detail of a
// Google API's JSON error body asks for, its retryDelay, a
// google.protobuf.Duration in JSON ("3s", "0.5s"):
//
//	{"error": {"code": 429, "status": "RESOURCE_EXHAUSTED", "details": [
//	  {"@type": "type.googleapis.com/google.rpc.RetryInfo", "retryDelay": "3s"}]}}
//
// It reads at most maxErrorBody bytes of the body, and puts them back
// before what is left: the body reads the same afterwards, to its end or
// its error. A longer body, or one that is not JSON, asks for nothing.
func retryInfo(resp *http.Response) (time.Duration, bool) {
	if resp.Body == nil || resp.Body == http.NoBody {
		return 0, false
	}
	if t, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type")); t != "application/json" {
		return 0, false
	}
	head, err := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody+1))
	rest := io.Reader(resp.Body)
	if err != nil {
		rest = failed{err}
	}
	resp.Body = peeked{Reader: io.MultiReader(bytes.NewReader(head), rest), Closer: resp.Body}
	if err != nil || len(head) > maxErrorBody {
		return 0, false
	}
	var e struct {
		Error struct {
			Details []struct {
				Type       string `json:"@type"`
				RetryDelay string `json:"retryDelay"`
			} `json:"details"`
		} `json:"error"`
	}
	if json.Unmarshal(head, &e) != nil {
		return 0, false
	}
	for _, d := range e.Error.Details {
		if d.Type == "type.googleapis.com/google.rpc.RetryInfo" {
			return duration(d.RetryDelay)
		}
	}
	return 0, false
}

// duration reads a google.protobuf.Duration in its JSON form, seconds
// with up to 9 decimals and an "s" ("1.5s"), and reports whether it is
// one, above zero.
func duration(v string) (time.Duration, bool) {
	num, ok := strings.CutSuffix(v, "s")
	whole, frac, _ := strings.Cut(num, ".")
	if !ok || whole == "" || !digits(whole) || !digits(frac) || len(frac) > 9 {
		return 0, false
	}
	secs, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || secs > math.MaxInt64/int64(time.Second)-1 {
		return 0, false
	}
	nanos, _ := strconv.Atoi((frac + "000000000")[:9])
	d := time.Duration(secs)*time.Second + time.Duration(nanos)
	return d, d > 0
}

// digits reports whether s holds only decimal digits.
func digits(s string) bool {
	return strings.Trim(s, "0123456789") == ""
}

// peeked is a response body whose first bytes were read and put back.
type peeked struct {
	io.Reader
	io.Closer
}

// failed is a reader that fails with err.
type failed struct{ err error }

func (f failed) Read([]byte) (int, error) { return 0, f.err }
