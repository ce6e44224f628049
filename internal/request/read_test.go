package request

import (
	"io"
	"net/http"
	"strings"
	"testing"
)

func TestRead(t *testing.T) {
	// With GetBody, the request itself goes, its body unread.
	req, _ := http.NewRequest("POST", "http://x", strings.NewReader("hello"))
	body, sent, err := Read(req, 5)
	if err != nil || string(body) != "hello" || sent != req {
		t.Fatalf("with GetBody: %q, same request %v, %v", body, sent == req, err)
	}
	if rest, _ := io.ReadAll(req.Body); string(rest) != "hello" {
		t.Errorf("the body to send holds %q", rest)
	}
	// Without, a clone carries the body read.
	req, _ = http.NewRequest("POST", "http://x", io.NopCloser(strings.NewReader("hello")))
	req.GetBody = nil
	body, sent, err = Read(req, 5)
	if err != nil || string(body) != "hello" || sent == req || sent.ContentLength != 5 {
		t.Fatalf("without GetBody: %q, a clone %v, length %d, %v", body, sent != req, sent.ContentLength, err)
	}
	for range 2 {
		rc, _ := sent.GetBody()
		if again, _ := io.ReadAll(rc); string(again) != "hello" {
			t.Errorf("the clone's GetBody gives %q", again)
		}
	}
	for _, getBody := range []bool{true, false} {
		req, _ = http.NewRequest("POST", "http://x", strings.NewReader("hello"))
		if !getBody {
			req.GetBody = nil
		}
		if _, _, err := Read(req, 4); err != ErrTooLarge {
			t.Errorf("a body over the bound, GetBody %v: %v, want ErrTooLarge", getBody, err)
		}
	}
	req, _ = http.NewRequest("GET", "http://x", nil)
	if body, sent, err := Read(req, 5); body != nil || sent != req || err != nil {
		t.Errorf("no body: %q, %v", body, err)
	}
}
