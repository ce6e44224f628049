package quota

import (
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

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
			// control may take up to three runs to show it.
			for range 3 {
				if run() > slots {
					return
				}
			}
			t.Errorf("without a linger the provider saw at most %d in flight in three runs: the scenario no longer cancels requests in flight, and shows nothing", slots)
		})
	}
}

// TestSlotsThroughAnOutage: 4 processes x 20 goroutines with
// WithConcurrency(8) under FallbackLocal(4), against a provider that
// holds each request 700 ms, through Redis killed and restarted empty.
// The requests in flight when Redis goes count against each process's
// local share, and the slots held locally are registered in Redis before
// the fleet resumes the shared slots, so the provider never sees more
// than 8 in flight: not 8 shared still in flight beside 8 local, nor 8
// local beside 8 granted by a Redis that knows none of them. The negative
// control never registers them.
func TestSlotsThroughAnOutage(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		name       string
		noRegister bool
	}{
		{"registered", false},
		{"unregistered", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			srv := redistest.Start(t)
			const slots, procs, latency = 8, 4, 700 * time.Millisecond
			p := &inFlight{latency: latency}
			provider := httptest.NewServer(p)
			defer provider.Close()
			spec := workerSpec{Addr: srv.Addr(), Key: strings.TrimPrefix(provider.URL, "http://"), Limit: fastLimit, Goroutines: 20,
				Duration: 9 * time.Second, URL: provider.URL, Concurrency: slots, Fallback: procs, Faults: true, NoRegister: tc.noRegister}
			w := startWorkers(t, procs, spec)
			var peaks []int64
			phase := func(until time.Duration, do func()) {
				time.Sleep(time.Until(w.start.Add(until)))
				peaks = append(peaks, p.peak.Swap(p.now.Load()))
				if do != nil {
					do()
				}
			}
			phase(2*time.Second, srv.Kill)
			phase(4*time.Second, srv.Restart)
			phase(spec.Duration, nil)
			reports := w.wait(t)
			total := 0
			for _, r := range reports {
				total += len(r.Grants)
			}
			t.Logf("%s: the provider's peak in flight: %d before the kill, %d in the outage, %d from the restart (slots %d); %d requests in all",
				tc.name, peaks[0], peaks[1], peaks[2], slots, total)
			if tc.noRegister {
				if peaks[2] <= slots {
					t.Errorf("with the local slots never registered the provider saw at most %d in flight from the restart: the scenario shows nothing", peaks[2])
				}
				return
			}
			for i, what := range []string{"before the kill", "in the outage", "from the restart"} {
				if peaks[i] > slots {
					t.Errorf("%s: the provider saw %d requests in flight, limit %d", what, peaks[i], slots)
				}
			}
			// The fleet kept moving: at least half of 8 slots / 700 ms.
			if want := int(0.5 * slots / latency.Seconds() * spec.Duration.Seconds()); total < want {
				t.Errorf("%d requests in %v, want at least %d", total, spec.Duration, want)
			}
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
