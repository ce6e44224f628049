package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// fastLimit never makes anyone wait for a token: the tests of slots
// measure the slots alone.
var fastLimit = Limit{Rate: 1e6, Burst: 1e6}

// inFlight is a provider that counts the requests in flight and remembers
// the most at once.
type inFlight struct {
	now, peak, total atomic.Int64
	latency          time.Duration
	hold             chan struct{} // when set, requests last until it is closed
	body             string
}

func (p *inFlight) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := p.now.Add(1)
	p.total.Add(1)
	for {
		peak := p.peak.Load()
		if n <= peak || p.peak.CompareAndSwap(peak, n) {
			break
		}
	}
	if p.hold != nil {
		select {
		case <-p.hold:
		case <-r.Context().Done():
		}
	} else {
		time.Sleep(p.latency)
	}
	p.now.Add(-1)
	io.WriteString(w, p.body)
}

// slotsHeld returns how many slots of the bucket called name Redis counts
// as held, and how many callers wait.
func slotsHeld(t *testing.T, rdb redis.UniversalClient, name string) (held, waiting int64) {
	t.Helper()
	key, _ := bucketKey(DefaultPrefix, name)
	ctx := context.Background()
	now := fmt.Sprint(time.Now().UnixMicro())
	held, err := rdb.ZCount(ctx, key+slotsHeldSuffix, now, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	waiting, err = rdb.ZCount(ctx, key+slotsWaitingSuffix, now, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	return held, waiting
}

func TestAcquireSlotServesInOrder(t *testing.T) {
	rdb := newServerClient(t)
	other := redis.NewClient(&redis.Options{Addr: rdb.Options().Addr})
	t.Cleanup(func() { other.Close() })
	// Two Limiters stand for two processes: the queue is the fleet's.
	ls := []*Limiter{NewLimiter(rdb), NewLimiter(other)}
	ctx := context.Background()
	first, err := ls[0].AcquireSlot(ctx, "ordered", 1)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 12
	var mu sync.Mutex
	var order []int
	var wg sync.WaitGroup
	for i := range waiters {
		wg.Go(func() {
			s, err := ls[i%2].AcquireSlot(ctx, "ordered", 1)
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			order = append(order, i)
			mu.Unlock()
			s.Release()
		})
		// The next waiter comes once this one is queued.
		eventually(t, 5*time.Second, "the waiter queued", func() bool {
			_, w := slotsHeld(t, rdb, "ordered")
			return w == int64(i+1)
		})
	}
	first.Release()
	wg.Wait()
	for i, got := range order {
		if got != i {
			t.Fatalf("served in the order %v, want the order of arrival", order)
		}
	}
	if len(order) != waiters {
		t.Fatalf("%d of %d waiters served", len(order), waiters)
	}
}

func TestAcquireSlotHonoursTheDeadline(t *testing.T) {
	rdb := newServerClient(t)
	l := NewLimiter(rdb)
	held, err := l.AcquireSlot(context.Background(), "deadline", 1)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Release()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = l.AcquireSlot(ctx, "deadline", 1)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("AcquireSlot past its deadline: %v, want DeadlineExceeded", err)
	}
	if waited := time.Since(start); waited < 150*time.Millisecond {
		t.Errorf("gave up after %v, before the deadline", waited)
	}
	eventually(t, 5*time.Second, "the waiter left the queue", func() bool {
		h, w := slotsHeld(t, rdb, "deadline")
		return h == 1 && w == 0
	})
}

func TestAcquireSlotInvalid(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	for _, n := range []int{0, -1} {
		if _, err := l.AcquireSlot(context.Background(), "x", n); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("AcquireSlot(n=%d): %v, want ErrInvalidLimit", n, err)
		}
	}
	if _, err := l.AcquireSlot(context.Background(), "", 1); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("AcquireSlot of an empty name: %v, want ErrInvalidKey", err)
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid input sent %d Redis commands", n)
	}
}

// TestWaitersDoNotPoll: callers waiting for a slot send nothing while
// they wait, however many; a release wakes the next.
func TestWaitersDoNotPoll(t *testing.T) {
	rdb := newServerClient(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	l := NewLimiter(rdb)
	ctx := context.Background()
	held, err := l.AcquireSlot(ctx, "idle", 1)
	if err != nil {
		t.Fatal(err)
	}
	const waiters = 30
	got := make(chan *Slot, waiters)
	for range waiters {
		go func() {
			s, err := l.AcquireSlot(ctx, "idle", 1)
			if err != nil {
				t.Error(err)
			}
			got <- s
		}()
	}
	eventually(t, 5*time.Second, "every caller queued", func() bool {
		_, w := slotsHeld(t, rdb, "idle")
		return w == waiters
	})
	cmds.reset()
	time.Sleep(2 * time.Second)
	if n := cmds.total(); n > 2 {
		t.Errorf("%d waiters sent %d commands in 2s of waiting (%v), want at most 2 renewals", waiters, n, cmds)
	}
	held.Release()
	for range waiters {
		select {
		case s := <-got:
			s.Release()
		case <-time.After(10 * time.Second):
			t.Fatal("a release did not wake the next waiter")
		}
	}
}

func TestTransportConcurrencyInProcess(t *testing.T) {
	rdb := newServerClient(t)
	p := &inFlight{latency: 20 * time.Millisecond}
	srv := httptest.NewServer(p)
	defer srv.Close()
	client := &http.Client{Transport: NewTransport(rdb, fastLimit, WithConcurrency(3))}
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			for range 5 {
				resp, err := client.Get(srv.URL)
				if err != nil {
					t.Error(err)
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
	if peak := p.peak.Load(); peak != 3 {
		t.Errorf("at most %d requests in flight, want 3", peak)
	}
	eventually(t, 5*time.Second, "every slot released", func() bool {
		h, w := slotsHeld(t, rdb, "127.0.0.1")
		return h == 0 && w == 0
	})
}

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
