package quota

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
)

// Tests of retries (retry.go): Permanent and CheckRetry under
// retryablehttp, whose every attempt takes its own token and its own slot;
// a refusal WithNoWait or in a Redis blip is retried, and a Retry-After is
// waited once.

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
	rdb := redis.NewClient(limiterOptions(miniredis.RunT(t).Addr()))
	defer rdb.Close()
	prov := statusSequence(t)
	failKey := func(*http.Request) (string, error) { return "", errors.New("no tenant") }
	for _, tc := range []struct {
		name string
		tr   func() http.RoundTripper
		want error
	}{
		{"invalid key", func() http.RoundTripper { return NewTransport(rdb, PerSecond(1), WithKey(failKey)) }, ErrInvalidKey},
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

// A refusal while Redis is unavailable under FailClosed is no permanent
// one: a blip is what retries are for. Through one of a second, the
// retrying client backs off and its request goes once Redis is back, sent
// once; without CheckRetry's knowing it, the same holds.
func TestRetryRidesOutARedisBlip(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t, func(o *redis.Options) { *o = *limiterOptions(srv.Addr()) })
	prov := statusSequence(t)
	sent := &attemptCounter{next: http.DefaultTransport}
	attempts := &attemptCounter{next: NewTransport(rdb, PerSecond(10), WithBase(sent), WithLogger(discardLogger()))}
	client := retryingClient(attempts)
	client.RetryWaitMin, client.RetryWaitMax, client.RetryMax = 100*time.Millisecond, 500*time.Millisecond, 20
	srv.Kill()
	time.AfterFunc(time.Second, srv.Restart)
	resp, err := client.Get(prov.URL)
	if err != nil {
		t.Fatalf("through a blip of 1 s: %v after %d attempts", err, attempts.count())
	}
	resp.Body.Close()
	if attempts.count() < 2 || sent.count() != 1 {
		t.Errorf("%d attempts, %d sent: want the refusals retried and one request sent", attempts.count(), sent.count())
	}
	if Permanent(fmt.Errorf("wrapped: %w", ErrUnavailable)) {
		t.Error("ErrUnavailable is permanent")
	}
}

// A refusal WithNoWait is retried by retryablehttp after its backoff, by
// which time the token has accrued.
func TestNoWaitRetriedByRetryablehttp(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	_, rdb := limiterServer(t)
	prov, reached := countingServer(t)
	tried := &attemptCounter{next: NewTransport(rdb, Limit{Rate: 5, Burst: 1}, WithNoWait())}
	client := retryingClient(tried)
	client.RetryWaitMin, client.RetryWaitMax, client.RetryMax = 50*time.Millisecond, time.Second, 6 // 3s of backoff in all

	for i := range 2 {
		resp, err := client.Get(prov.URL)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
	}
	t.Logf("2 requests: %d attempts, %d reached the provider", tried.count(), reached.Load())
	if reached.Load() != 2 || tried.count() < 3 {
		t.Errorf("%d attempts, %d reached the provider; want the second request refused at first, then retried and sent", tried.count(), reached.Load())
	}
	retry, err := CheckRetry(retryablehttp.DefaultRetryPolicy)(context.Background(), nil, ErrWouldWait)
	if !retry || err != nil {
		t.Errorf("CheckRetry(ErrWouldWait) = %v, %v; want a retry", retry, err)
	}
}

// retryablehttp sleeps the Retry-After itself, and the bucket's pause ends
// at the same instant: the retry waits once, not twice.
func TestRetryAfterIsNotDoubledByRetryablehttp(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	r := retryAfter429(t, PerSecond(100))
	t.Logf("the retry came %v after the 429 with Retry-After: 1; its take waited %v", r.gap, r.retry.Wait)
	// The retry's take comes when retryablehttp has slept the Retry-After
	// since the response; the pause, begun as the response came, ends
	// then too, give or take the background update's start. Waiting
	// twice would make the take wait about 1s more.
	if r.gap < 950*time.Millisecond || r.retry.Wait > 500*time.Millisecond {
		t.Errorf("the retry came %v after the 429 and its take waited %v: want about 1s, and no second wait", r.gap, r.retry.Wait)
	}
	var _ retryablehttp.CheckRetry = CheckRetry(retryablehttp.DefaultRetryPolicy)
}

// TestRetryEachAttemptHoldsOneSlot: under retryablehttp, each attempt takes
// a slot and its failed response gives it back before the next: with one
// slot, three attempts go one after another.
func TestRetryEachAttemptHoldsOneSlot(t *testing.T) {
	rdb := newServerClient(t)
	var attempts, inFlightNow, peak atomic.Int64
	var name string // the Transport's bucket
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := inFlightNow.Add(1)
		defer inFlightNow.Add(-1)
		peak.Store(max(peak.Load(), n))
		held, _ := slotsHeld(t, rdb, name)
		key, _ := bucketKey(DefaultPrefix, name)
		z, _ := rdb.ZRangeWithScores(context.Background(), key+slots.HeldSuffix, 0, -1).Result()
		t.Logf("DEBUG %v now %d", z, time.Now().UnixMicro())
		if held != 1 {
			t.Errorf("attempt %d: %d slots held in Redis, want 1", attempts.Load()+1, held)
		}
		if attempts.Add(1) < 3 {
			w.WriteHeader(http.StatusInternalServerError)
			io.WriteString(w, "try again")
			return
		}
		io.WriteString(w, "ok")
	}))
	defer provider.Close()
	name = strings.TrimPrefix(provider.URL, "http://")
	client := retryingClient(NewTransport(rdb, fastLimit, WithConcurrency(1)))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, _ := retryablehttp.NewRequestWithContext(ctx, "GET", provider.URL, nil)
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if attempts.Load() != 3 || peak.Load() != 1 {
		t.Errorf("%d attempts, %d at once; want 3, one at a time", attempts.Load(), peak.Load())
	}
	eventually(t, 5*time.Second, "the last slot released", func() bool {
		h, _ := slotsHeld(t, rdb, name)
		return h == 0
	})
}
