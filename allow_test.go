package quota

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// limiterServer starts a redis-server and returns it with a client that
// has a limiter's options (short timeouts, no retries).
func limiterServer(t *testing.T) (*redistest.Server, *redis.Client) {
	t.Helper()
	srv := redistest.Start(t)
	return srv, srv.Client(t, func(o *redis.Options) { *o = *limiterOptions(srv.Addr()) })
}

// countingServer is a provider that counts the requests that reach it.
func countingServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { n.Add(1) }))
	t.Cleanup(srv.Close)
	return srv, &n
}

func TestTransportNoWait(t *testing.T) {
	_, rdb := limiterServer(t)
	prov, reached := countingServer(t)
	tr := NewTransport(rdb, Limit{Rate: 0.05, Burst: 5}, WithNoWait())

	var mu sync.Mutex
	var refusals []error
	var slowest time.Duration
	var wg sync.WaitGroup
	start := make(chan struct{})
	for range 30 {
		wg.Go(func() {
			body := &bodyRecorder{Reader: strings.NewReader("payload")}
			req, _ := http.NewRequest("POST", prov.URL, body)
			<-start
			begun := time.Now()
			resp, err := tr.RoundTrip(req)
			took := time.Since(begun)
			mu.Lock()
			defer mu.Unlock()
			slowest = max(slowest, took)
			if err == nil {
				resp.Body.Close()
				return
			}
			refusals = append(refusals, err)
			if !body.closed.Load() {
				t.Error("a refused request's body was not closed")
			}
		})
	}
	close(start)
	wg.Wait()

	t.Logf("%d requests reached the provider, %d refused, the slowest RoundTrip took %v", reached.Load(), len(refusals), slowest)
	if reached.Load() != 5 || len(refusals) != 25 {
		t.Errorf("%d requests reached the provider and %d were refused, want the burst, 5, and 25", reached.Load(), len(refusals))
	}
	if slowest > 2*time.Second {
		t.Errorf("a RoundTrip took %v; WithNoWait must never wait (the shortest wait was 20s)", slowest)
	}
	for _, err := range refusals {
		if !errors.Is(err, ErrWouldWait) || Permanent(err) || errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("refusal %v: want ErrWouldWait, not permanent, not a deadline", err)
		}
		if msg := err.Error(); !strings.Contains(msg, `"127.0.0.1:`) || !strings.Contains(msg, "needs") {
			t.Errorf("refusal %q: want the bucket's name and the wait", msg)
		}
	}
}

// A refusal WithNoWait is retried by retryablehttp after its backoff, by
// which time the token has accrued.
func TestNoWaitRetriedByRetryablehttp(t *testing.T) {
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
