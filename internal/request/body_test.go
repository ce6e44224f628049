package request

import (
	"errors"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"testing/iotest"
	"time"
)

func TestHold(t *testing.T) {
	for _, tc := range []struct {
		name string
		body io.Reader
		end  func(*http.Response)
		want End
	}{
		{"closed early", strings.NewReader("hello"), func(r *http.Response) { r.Body.Close() }, Closed},
		{"read to EOF", strings.NewReader("hello"), func(r *http.Response) { io.Copy(io.Discard, r.Body); r.Body.Close() }, Done},
		{"failed", iotest.ErrReader(errors.New("connection reset")), func(r *http.Response) { io.Copy(io.Discard, r.Body); r.Body.Close() }, Failed},
		{"no body", nil, nil, Done},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ends []End
			resp := &http.Response{Body: http.NoBody}
			if tc.body != nil {
				resp.Body = io.NopCloser(tc.body)
			}
			Hold(resp, func(e End) { ends = append(ends, e) })
			if tc.end != nil {
				if len(ends) != 0 {
					t.Fatal("ended before the body ended")
				}
				tc.end(resp)
			}
			if len(ends) != 1 || ends[0] != tc.want {
				t.Errorf("ended %v, want once, %v", ends, tc.want)
			}
		})
	}
	t.Run("dropped unclosed", func(t *testing.T) {
		ended := make(chan End, 1)
		func() {
			resp := &http.Response{Body: io.NopCloser(strings.NewReader("hello"))}
			Hold(resp, func(e End) { ended <- e })
		}()
		deadline := time.After(5 * time.Second)
		for {
			runtime.GC()
			select {
			case e := <-ended:
				if e != Closed {
					t.Errorf("ended %v, want Closed", e)
				}
				return
			case <-deadline:
				t.Fatal("a body dropped unclosed did not end in 5s")
			case <-time.After(10 * time.Millisecond):
			}
		}
	})
}

func TestTimes(t *testing.T) {
	var ts Times
	for i := range minTimes - 1 {
		ts.Add("a", time.Duration(i+1)*time.Millisecond)
	}
	if _, ok := ts.Quantile("a", 0.99); ok {
		t.Fatalf("a quantile of %d times, want none below %d", minTimes-1, minTimes)
	}
	for i := range 200 {
		ts.Add("a", time.Duration(i%100+1)*time.Millisecond)
	}
	// The last 128 of 1..100 ms, 100 of them at most 100 ms.
	if d, ok := ts.Quantile("a", 0.99); !ok || d < 90*time.Millisecond || d > 100*time.Millisecond {
		t.Errorf("p99 %v %v, want about 100ms", d, ok)
	}
	if d, _ := ts.Quantile("a", 0.5); d < 20*time.Millisecond || d > 80*time.Millisecond {
		t.Errorf("p50 %v, want between 20 and 80ms", d)
	}
	for i := range 2 * maxNames {
		ts.Add(strings.Repeat("x", i%50)+string(rune('a'+i%26))+time.Duration(i).String(), time.Millisecond)
	}
	if n := len(ts.m); n > maxNames {
		t.Errorf("%d names kept, want at most %d", n, maxNames)
	}
}
