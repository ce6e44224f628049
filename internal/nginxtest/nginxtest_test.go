package nginxtest

import (
	"fmt"
	"io"
	"net/http"
	"runtime"
	"strings"
	"testing"
	"time"
)

// counts is what a run of requests got.
type counts struct {
	accepted, refused int
}

// get sends one GET to url and checks the answer is an admission (200
// with Body) or a refusal (503 without Retry-After).
func get(t *testing.T, c *http.Client, url string, n *counts) {
	t.Helper()
	resp, err := c.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
		if string(body) != Body {
			t.Fatalf("200 with body %q, want %q", body, Body)
		}
		n.accepted++
	case http.StatusServiceUnavailable:
		if ra := resp.Header.Values("Retry-After"); len(ra) > 0 {
			t.Fatalf("503 with Retry-After %q, want none", ra)
		}
		n.refused++
	default:
		t.Fatalf("status %d (%q), want 200 or 503", resp.StatusCode, body)
	}
}

// newClient returns a client that keeps its connection alive, so that
// the requests' pace is not the pace of new connections.
func newClient(t *testing.T) *http.Client {
	tr := &http.Transport{MaxIdleConnsPerHost: 1}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 5 * time.Second}
}

// flood sends n requests to url one after the other, as fast as they are
// answered, and returns what they got and how long they took.
func flood(t *testing.T, url string, n int) (counts, time.Duration) {
	t.Helper()
	c := newClient(t)
	var got counts
	start := time.Now()
	for range n {
		get(t, c, url, &got)
	}
	return got, time.Since(start)
}

func TestRateSpec(t *testing.T) {
	for _, tc := range []struct {
		rate float64
		want string
	}{
		{100, "100r/s"},
		{1, "1r/s"},
		{1000000, "1000000r/s"},
		{0.5, "30r/m"},
		{2.5, "150r/m"},
		{0.3, "18r/m"},
		{1.0 / 60, "1r/m"},
		{100.25, "6015r/m"},
	} {
		got, err := rateSpec(tc.rate)
		if err != nil || got != tc.want {
			t.Errorf("rateSpec(%v) = %q, %v; want %q", tc.rate, got, err, tc.want)
		}
	}
	for _, rate := range []float64{0, -1, 0.001, 1.234} {
		if got, err := rateSpec(rate); err == nil {
			t.Errorf("rateSpec(%v) = %q, want an error", rate, got)
		}
	}
}

// A flood at a server of 100 requests per second without burst is
// mostly refused, with 503 and no Retry-After, and the admitted requests
// keep to the rate.
func TestFloodIsRefused(t *testing.T) {
	s := StartLimitReq(t, 100, 0)
	got, took := flood(t, s.URL()+"/", 300)
	t.Logf("300 requests in %v: %d admitted, %d refused", took, got.accepted, got.refused)
	if got.accepted < 1 {
		t.Errorf("no request admitted")
	}
	// Admitted requests are 10 ms apart by nginx's clock, which counts
	// whole milliseconds, so at least 9 ms by ours; the first is admitted
	// at once, and one more for nginx reading its clock once per event
	// loop.
	if most := int(took/(9*time.Millisecond)) + 2; got.accepted > most {
		t.Errorf("%d requests admitted in %v, want at most %d at 100/s", got.accepted, took, most)
	}
	if got.refused < 150 {
		t.Errorf("%d of 300 requests refused, want 150 or more", got.refused)
	}
}

// Requests paced at 50 per second, half the rate, are admitted: at most
// one is refused, for a noisy machine that delays one and sends it close
// behind the next.
func TestPacedRequestsAreAdmitted(t *testing.T) {
	s := StartLimitReq(t, 100, 5)
	c := newClient(t)
	var got counts
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for range 50 {
		<-tick.C
		get(t, c, s.URL()+"/", &got)
	}
	if got.refused > 1 {
		t.Errorf("%d of 50 requests at 50/s refused at 100/s with burst 5, want at most 1", got.refused)
	}
}

// Negative control: the same flood as TestFloodIsRefused, at a server
// whose burst alone admits it, has nothing refused.
func TestHighLimitRefusesNothing(t *testing.T) {
	s := StartLimitReq(t, 1000, 1000)
	got, took := flood(t, s.URL()+"/", 300)
	if got.refused != 0 {
		t.Errorf("%d of 300 requests refused in %v at 1000/s with burst 1000, want none", got.refused, took)
	}
}

// A rate below one request per second is written per minute, and every
// path of the server shares the zone.
func TestRatePerMinute(t *testing.T) {
	s := StartLimitReq(t, 0.5, 0)
	c := newClient(t)
	var got counts
	get(t, c, s.URL()+"/", &got)
	if got.accepted != 1 {
		t.Fatalf("first request refused")
	}
	for _, path := range []string{"/", "/other", "/index.html"} {
		get(t, c, s.URL()+path, &got)
	}
	if got.refused != 3 {
		t.Errorf("%d of the 3 requests after the first refused at 30r/m, want 3", got.refused)
	}
}

// Servers started side by side listen on ports of their own.
func TestServersAreSeparate(t *testing.T) {
	a := StartLimitReq(t, 0.5, 0)
	b := StartLimitReq(t, 0.5, 0)
	if a.URL() == b.URL() {
		t.Fatalf("both servers at %s", a.URL())
	}
	if !strings.HasPrefix(a.URL(), "http://127.0.0.1:") {
		t.Errorf("URL %q, want http://127.0.0.1:PORT", a.URL())
	}
	c := newClient(t)
	for _, s := range []*Server{a, b} {
		var got counts
		get(t, c, s.URL()+"/", &got)
		if got.accepted != 1 {
			t.Errorf("first request to %s refused", s.URL())
		}
	}
}

// fakeTB records what lookNginx reports and, like a testing.T, ends the
// goroutine that called Fatalf or Skipf: run it with look.
type fakeTB struct {
	testing.TB
	fatal, skip string
}

// look runs lookNginx(f) in a goroutine of its own and waits for it.
func look(f *fakeTB) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		lookNginx(f)
	}()
	<-done
}

func (f *fakeTB) Helper()      {}
func (f *fakeTB) Name() string { return "fake" }
func (f *fakeTB) Fatalf(format string, a ...any) {
	f.fatal = fmt.Sprintf(format, a...)
	runtime.Goexit()
}
func (f *fakeTB) Skipf(format string, a ...any) { f.skip = fmt.Sprintf(format, a...); runtime.Goexit() }

// Without nginx a test is skipped and counted for Main's banner, or fails
// when QUOTA_REQUIRE_REDIS=1; either way the message says how to install
// it.
func TestMissingNginx(t *testing.T) {
	t.Setenv("PATH", t.TempDir())
	saved := sbinDirs
	sbinDirs = []string{t.TempDir()}
	defer func() { sbinDirs = saved }()

	t.Setenv(RequireEnv, "")
	before := skipped.Load()
	f := &fakeTB{}
	look(f)
	if f.fatal != "" || !strings.Contains(f.skip, "install it with") || skipped.Load() != before+1 {
		t.Errorf("without %s=1: Fatalf %q, Skipf %q, %d skips counted, want a skip with an install hint, counted",
			RequireEnv, f.fatal, f.skip, skipped.Load()-before)
	}
	skipped.Store(before) // not a skip of this package's tests

	t.Setenv(RequireEnv, "1")
	f = &fakeTB{}
	look(f)
	if f.skip != "" || !strings.Contains(f.fatal, "install it with") || skipped.Load() != before {
		t.Errorf("with %s=1: Fatalf %q, Skipf %q, want a failure with an install hint, not counted",
			RequireEnv, f.fatal, f.skip)
	}
}
