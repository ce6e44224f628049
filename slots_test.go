package quota

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of a held concurrency slot (slots.go): released when its response
// body ends, lingering after a cancelled request, back when its holder
// dies, and its lease checked before its request is sent.

// TestBodiesReleaseSlots: with one slot, each request can only go once the
// one before has released it, whichever way its body ends.
func TestBodiesReleaseSlots(t *testing.T) {
	rdb := newServerClient(t)
	srv := httptest.NewServer(&inFlight{body: strings.Repeat("x", 64<<10)})
	defer srv.Close()
	client := &http.Client{Transport: NewTransport(rdb, fastLimit, WithConcurrency(1))}
	get := func(t *testing.T) *http.Response {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		t.Cleanup(cancel)
		req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL, nil)
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("the slot was not released: %v", err)
		}
		return resp
	}
	for _, tc := range []struct {
		name string
		end  func(*http.Response)
	}{
		{"closed early", func(r *http.Response) {
			io.CopyN(io.Discard, r.Body, 100)
			r.Body.Close()
		}},
		{"never read", func(r *http.Response) { r.Body.Close() }},
		{"read to EOF", func(r *http.Response) { io.Copy(io.Discard, r.Body) }},
		{"dropped unclosed", func(r *http.Response) {}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := get(t)
			tc.end(resp)
			resp = nil
			runtime.GC() // the dropped body's cleanup
			resp = get(t)
			resp.Body.Close()
		})
	}
	t.Run("error", func(t *testing.T) {
		failing := NewTransport(rdb, fastLimit, WithConcurrency(1), WithBase(roundTripFunc(func(*http.Request) (*http.Response, error) {
			return nil, errors.New("connection refused")
		})))
		req, _ := http.NewRequest("GET", srv.URL, nil)
		if _, err := failing.RoundTrip(req); err == nil {
			t.Fatal("want the base's error")
		}
		get(t).Body.Close()
	})
}

// TestKilledHolderSlotsReturn: a process killed with SIGKILL while it holds
// every slot renews nothing more, and its slots come back to a waiter
// within the lease.
func TestKilledHolderSlotsReturn(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	const slots, lease = 4, time.Second
	p := &inFlight{hold: make(chan struct{})}
	provider := httptest.NewServer(p)
	defer provider.Close()
	defer close(p.hold)
	name := strings.TrimPrefix(provider.URL, "http://") // the Transport's bucket
	spec := workerSpec{Addr: srv.Addr(), Key: name, Limit: fastLimit, Goroutines: slots,
		Duration: time.Minute, URL: provider.URL, Concurrency: slots, SlotLease: lease}
	w := startWorkers(t, 1, spec)
	eventually(t, 10*time.Second, "the worker holds every slot", func() bool { return p.now.Load() == slots })

	rdb := srv.Client(t)
	l := NewLimiter(rdb, WithSlotLease(lease))
	ctx, cancel := context.WithTimeout(context.Background(), 3*lease)
	defer cancel()
	got := make(chan time.Time, slots)
	for range slots {
		go func() {
			s, err := l.AcquireSlot(ctx, name, slots)
			if err != nil {
				t.Error(err)
				return
			}
			got <- time.Now()
			defer s.Release()
		}()
	}
	time.Sleep(lease) // held and renewed: nothing for the waiters
	if len(got) != 0 {
		t.Fatalf("%d slots granted while their holder lived", len(got))
	}
	if err := w.ps[0].cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	var last time.Time
	for range slots {
		select {
		case last = <-got:
		case <-ctx.Done():
			t.Fatalf("the killed process's slots did not come back within %v", 3*lease)
		}
	}
	t.Logf("all %d slots back %v after the kill (lease %v)", slots, last.Sub(killed), lease)
	if back := last.Sub(killed); back > lease+300*time.Millisecond {
		t.Errorf("slots back %v after the kill, want within the lease, %v (+300ms)", back, lease)
	}
}

// TestCancelledRequestsKeepTheirSlots: 4 processes x 30 goroutines with
// WithConcurrency(8), started 300 ms apart, each request with a deadline at
// the end of its process's run, against a provider that holds each request
// 100 ms and does not watch for disconnects. As each process ends, its
// requests in flight are cancelled while the provider still works on them:
// their slots linger, so the provider never sees more than 8. With a linger
// of zero (the negative control) each process's cancelled slots go to the
// others at once, and the provider sees more.
func TestCancelledRequestsKeepTheirSlots(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		name   string
		linger time.Duration // as workerSpec.Linger: 0 for the default
		over   bool          // the provider is to see more than the slots
	}{
		{"default linger", 0, false},
		{"no linger", -1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			const slots, latency = 8, 100 * time.Millisecond
			run := func() int64 {
				srv := redistest.Start(t)
				p := &inFlight{latency: latency}
				provider := httptest.NewServer(p)
				defer provider.Close()
				spec := workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(provider.URL, "http://"), Limit: fastLimit, Goroutines: 30,
					Duration: 3 * time.Second, URL: provider.URL, Concurrency: slots, Stagger: 300 * time.Millisecond, Deadline: true,
					Linger: tc.linger}
				startWorkers(t, 4, spec).wait(t)
				t.Logf("%s: the provider saw at most %d in flight (slots %d), %d requests in all", tc.name, p.peak.Load(), slots, p.total.Load())
				return p.peak.Load()
			}
			if !tc.over {
				if peak := run(); peak > slots {
					t.Errorf("the provider saw %d requests in flight, limit %d: cancelled requests gave their slots away while it worked on them", peak, slots)
				}
				return
			}
			// Whether a process's last requests are still in flight when
			// its deadline comes depends on the machine's timing: the
			// control may take a few runs to show it, more on a loaded
			// machine.
			for range 5 {
				if run() > slots {
					return
				}
			}
			t.Errorf("without a linger the provider saw at most %d in flight in five runs: the scenario no longer cancels requests in flight, and shows nothing", slots)
		})
	}
}

// TestStalledHolderChecksItsLease: three processes of 4 goroutines send
// through WithConcurrency(4), with a lease of 2 s, to a provider that holds
// each request 300 ms; a fourth, also of 4 goroutines, obeys a layer of 4/s
// besides, so that its requests hold their slots while they wait for their
// tokens. That process is stopped (SIGSTOP) for 5 s, more than twice the
// lease: its slots' leases end, and the others are granted them again.
// When it goes on, its holders' tokens are due at once; each checks its
// slot's lease before it sends, finds it gone and queues again, so that
// the provider never sees more than 4. Without the check (the negative
// control) they send on slots that others hold.
func TestStalledHolderChecksItsLease(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		name    string
		noCheck bool
	}{
		{"checked", false},
		{"unchecked", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			const slots, latency, lease = 4, 300 * time.Millisecond, 2 * time.Second
			p := &inFlight{latency: latency}
			provider := httptest.NewServer(p)
			defer provider.Close()
			spec := workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(provider.URL, "http://"), Limit: fastLimit, Goroutines: 4,
				Duration: 10 * time.Second, URL: provider.URL, Concurrency: slots, SlotLease: lease, NoLeaseCheck: tc.noCheck}
			others := startWorkers(t, 3, spec)
			spec.Layers = []Limit{{Rate: 4, Burst: 1}}
			spec.Duration -= time.Since(others.start)
			big := startWorkers(t, 1, spec)
			stalled := big.ps[0].cmd.Process
			time.Sleep(time.Until(others.start.Add(2 * time.Second)))
			before := p.peak.Swap(p.now.Load())
			if err := stalled.Signal(syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			time.Sleep(5 * lease / 2)
			during := p.peak.Swap(p.now.Load())
			if err := stalled.Signal(syscall.SIGCONT); err != nil {
				t.Fatal(err)
			}
			others.wait(t)
			big.wait(t)
			after := p.peak.Load()
			t.Logf("%s: the provider's peak in flight: %d before the stop, %d during it, %d after (slots %d); %d requests in all",
				tc.name, before, during, after, slots, p.total.Load())
			peak := max(before, during, after)
			switch {
			case !tc.noCheck && peak > slots:
				t.Errorf("the provider saw %d requests in flight, limit %d", peak, slots)
			case tc.noCheck && after <= slots:
				t.Errorf("without the lease check the provider saw at most %d in flight after the stop: the scenario shows nothing", after)
			}
		})
	}
}
