package quota_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// Examples of the Transport and its options (transport.go, options.go,
// metering.go, keyfunc.go, retry.go): WithSettle, WithConcurrency,
// CheckRetry, WithNoWait, WithDryRun, WithLimiter and AllowNames.

// A request to a batch endpoint is charged what it may cost, and settled
// with what the provider says it cost once the response is in.
func ExampleWithSettle() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("X-Usage", "3")
	})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(600), // 10/s, burst 30
		quota.WithCost(func(req *http.Request) float64 {
			return 10 // the most one batch request costs
		}),
		quota.WithSettle(func(resp *http.Response) (float64, bool) {
			used, err := strconv.ParseFloat(resp.Header.Get("X-Usage"), 64)
			return used, err == nil // false: the response does not say
		}))
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	resp, err := client.Get("https://api.example.com/v1/batch")
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	// The settle runs in the background once the response is back.
	ctx := context.Background()
	var st quota.Status
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		if st, err = tr.Limiter().Status(ctx, "api.example.com"); err != nil || st.Tokens != 20 {
			break
		}
	}
	fmt.Printf("%g of %g tokens left once settled\n", st.Tokens, st.Limit.Burst)
	// Output: 27 of 30 tokens left once settled
}

// However many requests run at once, no more than four of a bucket are in
// flight across the fleet.
func ExampleWithConcurrency() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	var mu sync.Mutex
	inFlight, most := 0, 0
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		inFlight++
		most = max(most, inFlight)
		mu.Unlock()
		time.Sleep(20 * time.Millisecond) // the provider at work
		mu.Lock()
		inFlight--
		mu.Unlock()
	})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerSecond(15), quota.WithConcurrency(4))
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	var wg sync.WaitGroup
	for range 12 {
		wg.Go(func() {
			resp, err := client.Get("https://api.example.com/v1/report")
			if err != nil {
				log.Fatal(err)
			}
			resp.Body.Close() // hands the slot back
		})
	}
	wg.Wait()
	fmt.Println("12 requests, never more than 4 in flight:", most <= 4)
	// Output: 12 requests, never more than 4 in flight: true
}

// A retrying client outside the Transport: every attempt takes a token of
// its own, and the package's permanent refusals are not retried.
func ExampleCheckRetry() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	attempts := 0
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {
		attempts++
		if attempts == 1 {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	client := retryablehttp.NewClient()
	client.HTTPClient.Transport = quota.NewTransport(rdb, quota.PerMinute(300))
	client.CheckRetry = quota.CheckRetry(retryablehttp.DefaultRetryPolicy)
	// end README
	client.Logger = nil
	client.RetryWaitMin, client.RetryWaitMax = time.Millisecond, time.Millisecond

	resp, err := client.Get("https://api.example.com/v1/geocode")
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	st, err := client.HTTPClient.Transport.(*quota.Transport).Limiter().Status(context.Background(), "api.example.com")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s after %d attempts, %g tokens taken\n", resp.Status, attempts, st.Limit.Burst-st.Tokens)

	// A request that cannot take its token while Redis is gone under
	// FailClosed is retried with backoff, as an outage may be short, and
	// is never sent without one.
	redisServer.Close()
	_, err = client.Get("https://api.example.com/v1/geocode")
	fmt.Println(errors.Is(err, quota.ErrUnavailable), quota.Permanent(err), attempts)
	// Output:
	// 200 OK after 2 attempts, 2 tokens taken
	// true false 2
}

// A caller that would rather not wait gets an error at once, and nothing
// is sent.
func ExampleWithNoWait() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.Limit{Rate: 1, Burst: 1}, quota.WithNoWait())
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	for range 2 {
		resp, err := client.Get("https://api.example.com/v1/geocode")
		if err != nil {
			fmt.Println(errors.Is(err, quota.ErrWouldWait), err)
			continue
		}
		resp.Body.Close()
		fmt.Println(resp.Status)
	}
	// Output:
	// 200 OK
	// true Get "https://api.example.com/v1/geocode": quota: tokens not available now: "api.example.com" needs 1s
}

// Under a dry run every request goes at once, and the bucket and the
// telemetry record what enforcement would have done.
func ExampleWithDryRun() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.Limit{Rate: 1, Burst: 1}, quota.WithDryRun())
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	for range 3 {
		resp, err := client.Get("https://api.example.com/v1/geocode")
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	st, err := tr.Limiter().Status(context.Background(), "api.example.com")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("3 requests sent at once; enforced, the last would have waited %v\n", st.Queue)
	// Output: 3 requests sent at once; enforced, the last would have waited 2s
}

// Transports of one process can share a Limiter: one subscription to
// Redis, one view of each bucket, one breaker.
func ExampleWithLimiter() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	l := quota.NewLimiter(rdb)
	search := quota.NewTransport(nil, quota.PerSecond(10), quota.WithLimiter(l),
		quota.WithKey(quota.Fixed("search")))
	upload := quota.NewTransport(nil, quota.PerSecond(2), quota.WithLimiter(l),
		quota.WithKey(quota.Fixed("upload")), quota.WithConcurrency(4))
	// end README

	for _, tr := range []*quota.Transport{search, upload} {
		client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
		resp, err := client.Get("https://api.example.com/v1/files")
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	fmt.Println(search.Limiter() == upload.Limiter())
	// The upload's slot goes back to Redis within a millisecond; Flush
	// sends it at once, so that only the buckets' keys remain.
	if err := l.Flush(context.Background()); err != nil {
		log.Fatal(err)
	}
	for _, key := range redisServer.Keys() {
		fmt.Println(key)
	}
	// Output:
	// true
	// quota:{search}
	// quota:{search}:ctl
	// quota:{upload}
	// quota:{upload}:ctl
}

// Where requests may go to arbitrary URLs, only the buckets listed are
// used; every other request fails before it is sent.
func ExampleAllowNames() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerSecond(10),
		quota.WithKey(quota.AllowNames(quota.Host, "api.example.com", "geo.example.com")))
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	for _, url := range []string{"https://api.example.com/v1", "https://evil.example.net/v1"} {
		resp, err := client.Get(url)
		if err != nil {
			fmt.Println(errors.Is(err, quota.ErrInvalidKey), err)
			continue
		}
		resp.Body.Close()
		fmt.Println(resp.Status)
	}
	// Output:
	// 200 OK
	// true Get "https://evil.example.net/v1": quota: invalid key: "evil.example.net" is not an allowed bucket
}
