package quota

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// attemptCounter wraps a RoundTripper and records when each attempt
// reached it.
type attemptCounter struct {
	next  http.RoundTripper
	mu    sync.Mutex
	times []time.Time
}

func (c *attemptCounter) RoundTrip(r *http.Request) (*http.Response, error) {
	c.mu.Lock()
	c.times = append(c.times, time.Now())
	c.mu.Unlock()
	return c.next.RoundTrip(r)
}

func (c *attemptCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.times)
}

// statusSequence is a provider that answers with the given statuses in
// turn, then 200.
func statusSequence(t *testing.T, statuses ...int) *httptest.Server {
	var i atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := int(i.Add(1)) - 1
		if n < len(statuses) {
			if statuses[n] == http.StatusTooManyRequests {
				w.Header().Set("Retry-After", "1")
			}
			w.WriteHeader(statuses[n])
		}
	}))
	t.Cleanup(srv.Close)
	return srv
}

func retryingClient(tr http.RoundTripper) *retryablehttp.Client {
	c := retryablehttp.NewClient()
	c.HTTPClient = &http.Client{Transport: tr}
	c.RetryWaitMin, c.RetryWaitMax = 10*time.Millisecond, 2*time.Second
	c.RetryMax = 3
	c.Logger = nil
	c.CheckRetry = CheckRetry(retryablehttp.DefaultRetryPolicy)
	return c
}

func TestRetryEveryAttemptTakesAToken(t *testing.T) {
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	takes := newCmdCounter()
	rdb.AddHook(takes)
	prov := statusSequence(t, 500, 502)
	sent := &attemptCounter{next: http.DefaultTransport}
	client := retryingClient(NewTransport(rdb, PerSecond(100), WithBase(sent)))

	resp, err := client.Get(prov.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if sent.count() != 3 || takes.total() != 3 {
		t.Errorf("%d attempts sent, %d tokens taken; want 3 and 3", sent.count(), takes.total())
	}
}

func TestRetryAfter429WaitsForATokenToo(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	// One token, refilled every 2s: the retry, due 1s after the 429 by its
	// Retry-After, still has to wait for its token. The pause moved the
	// bucket's queue by its length, as every pause does: the token falls
	// due 2s after the first, and 1s later.
	r := retryAfter429(t, Limit{Rate: 0.5, Burst: 1})
	t.Logf("the retry's token fell due %v after the first attempt began (which took %v); it reached the provider %v after the 429",
		r.retry.Due.Sub(r.begun), r.first.Sub(r.begun), r.gap)
	// The first take emptied the bucket between the start and the first
	// attempt, and the 429 came back after it: the retry's token falls due
	// 3s after the first take at the earliest, and 3s after the 429 at the
	// latest.
	const due = 3 * time.Second
	switch rt := r.retry; {
	case !rt.Waited && rt.Sent.Before(r.begun.Add(due)):
		t.Errorf("the retry's token was granted at once %v after the first attempt began, want none for %v", rt.Sent.Sub(r.begun), due)
	case rt.Waited && (rt.Due.Before(r.begun.Add(due-time.Microsecond)) || rt.Due.After(r.first.Add(due+r.gap))):
		t.Errorf("the retry's token fell due %v after the first attempt began, want %v after the first take, within %v",
			rt.Due.Sub(r.begun), due, r.first.Sub(r.begun))
	}
	if late := r.second.Sub(r.retry.Due); late < 0 || late > maxJitter {
		t.Errorf("the retry reached the provider %v after its token fell due", late)
	}
}

// retried is what retryAfter429 saw.
type retried struct {
	begun, first, second time.Time     // when the request began, and its attempts reached the provider
	gap                  time.Duration // between the attempts
	retry                *dueRecord    // the retry's take (dueHook)
}

// retryAfter429 sends one request through retryablehttp over a Transport at
// lim to a provider that answers 429 with Retry-After: 1 and then 200, and
// reports when the attempts went out and the retry's take.
func retryAfter429(t *testing.T, lim Limit) retried {
	t.Helper()
	_, rdb, _ := newMini(t)
	rdb.AddHook(dueHook{})
	prov := statusSequence(t, http.StatusTooManyRequests)
	sent := &attemptCounter{next: http.DefaultTransport}
	client := retryingClient(NewTransport(rdb, lim, WithBase(sent)))
	ctx, rec := withDueRecord(context.Background()) // each take records over the last
	req, err := retryablehttp.NewRequestWithContext(ctx, "GET", prov.URL, nil)
	if err != nil {
		t.Fatal(err)
	}
	begun := time.Now()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if sent.count() != 2 {
		t.Fatalf("%d attempts, want 2", sent.count())
	}
	return retried{begun: begun, first: sent.times[0], second: sent.times[1], gap: sent.times[1].Sub(sent.times[0]), retry: rec}
}

func TestRetryStopsOnRefusals(t *testing.T) {
	mr := miniredis.RunT(t)
	addr := mr.Addr()
	rdb := redis.NewClient(limiterOptions(addr))
	defer rdb.Close()
	prov := statusSequence(t)
	failKey := func(*http.Request) (string, error) { return "", errors.New("no tenant") }
	for _, tc := range []struct {
		name string
		tr   func() http.RoundTripper
		want error
	}{
		{"invalid key", func() http.RoundTripper { return NewTransport(rdb, PerSecond(1), WithKey(failKey)) }, ErrInvalidKey},
		{"fail closed", func() http.RoundTripper {
			tr := NewTransport(rdb, PerSecond(1), WithLogger(discardLogger()))
			mr.Close()
			return tr
		}, ErrUnavailable},
	} {
		t.Run(tc.name, func(t *testing.T) {
			attempts := &attemptCounter{next: tc.tr()}
			client := retryingClient(attempts)
			_, err := client.Get(prov.URL)
			if !errors.Is(err, tc.want) || attempts.count() != 1 {
				t.Errorf("err = %v after %d attempts, want %v after 1", err, attempts.count(), tc.want)
			}
			// The default policy alone retries them as unknown errors.
			client.CheckRetry = retryablehttp.DefaultRetryPolicy
			client.RetryWaitMin, client.RetryWaitMax = time.Millisecond, time.Millisecond
			before := attempts.count()
			client.Get(prov.URL)
			if n := attempts.count() - before; n != client.RetryMax+1 {
				t.Errorf("without CheckRetry: %d attempts, want %d", n, client.RetryMax+1)
			}
		})
	}
}

func TestCheckRetryLeavesTheRestToNext(t *testing.T) {
	called := 0
	next := func(context.Context, *http.Response, error) (bool, error) { called++; return true, nil }
	check := CheckRetry(next)
	var _ retryablehttp.CheckRetry = check
	if retry, _ := check(context.Background(), nil, errors.New("connection reset")); !retry || called != 1 {
		t.Error("an error of the network was not left to next")
	}
	if retry, _ := check(context.Background(), &http.Response{StatusCode: 503}, nil); !retry || called != 2 {
		t.Error("a response was not left to next")
	}
	if retry, _ := check(context.Background(), nil, ErrWouldExceedDeadline); retry || called != 2 {
		t.Error("a wait past the deadline was retried")
	}
	mustPanic(t, "CheckRetry(nil)", func() { CheckRetry(nil) })
}
