package request

import (
	"io"
	"net/http"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func TestHold(t *testing.T) {
	for _, tc := range []struct {
		name string
		end  func(*http.Response)
	}{
		{"closed", func(r *http.Response) { r.Body.Close() }},
		{"read to EOF", func(r *http.Response) { io.Copy(io.Discard, r.Body) }},
		{"no body", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var released atomic.Int32
			resp := &http.Response{Body: io.NopCloser(strings.NewReader("hello"))}
			if tc.end == nil {
				resp.Body = http.NoBody
			}
			Hold(resp, func() { released.Add(1) })
			if tc.end != nil {
				if released.Load() != 0 {
					t.Fatal("released before the body ended")
				}
				tc.end(resp)
			}
			if released.Load() == 0 {
				t.Error("not released")
			}
		})
	}
	t.Run("dropped unclosed", func(t *testing.T) {
		released := make(chan struct{})
		func() {
			resp := &http.Response{Body: io.NopCloser(strings.NewReader("hello"))}
			Hold(resp, func() { close(released) })
		}()
		deadline := time.After(5 * time.Second)
		for {
			runtime.GC()
			select {
			case <-released:
				return
			case <-deadline:
				t.Fatal("a body dropped unclosed was not released in 5s")
			case <-time.After(10 * time.Millisecond):
			}
		}
	})
}
