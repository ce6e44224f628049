package quota_test

import (
	"context"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
)

// The examples run against stand-ins, so that they print the same every
// time: for the fleet's Redis (at "localhost:6379", say), a miniredis whose
// clock stands still; for the provider, a server on this machine or a
// RoundTripper that answers every request.

// standInRedis starts a stand-in for the fleet's Redis.
func standInRedis() *miniredis.Miniredis {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	return mr
}

// provider stands in for a provider's API: it answers every request with
// 200 OK, without a network.
type provider struct{}

func (provider) RoundTrip(r *http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: http.StatusOK, Status: "200 OK", Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header: http.Header{}, Body: http.NoBody, Request: r}, nil
}

// Every worker of the fleet builds the same client: together they send the
// provider at most 300 requests a minute, however many workers run.
func Example() {
	redisServer := standInRedis()
	defer redisServer.Close()
	geocoder := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s: 52.52N 13.40E\n", r.URL.Query().Get("q"))
	}))
	defer geocoder.Close()

	rdb := redis.NewClient(&redis.Options{Addr: redisServer.Addr()})
	client := &http.Client{Transport: quota.NewTransport(rdb, quota.PerMinute(300))}

	resp, err := client.Get(geocoder.URL + "/v1/search?q=Berlin")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	fmt.Print(resp.Status, ", ", string(body))
	// Output: 200 OK, Berlin: 52.52N 13.40E
}

// A provider that meters each region separately gets a bucket per host and
// region, and one endpoint with a limit of its own.
func ExampleNewTransport_regions() {
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := redis.NewClient(&redis.Options{Addr: redisServer.Addr()})

	tr := quota.NewTransport(rdb, quota.PerSecond(10), // every other host
		quota.WithKey(quota.Join(quota.Host, quota.Header("X-Region"))),
		quota.WithLimits(map[string]quota.Limit{
			"api.example.com/eu": {Rate: 5, Burst: 10},
		}),
		quota.WithBase(provider{}), // http.DefaultTransport unless set
	)
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}

	for _, region := range []string{"eu", "us"} {
		req, _ := http.NewRequest("GET", "https://api.example.com/v1/geocode", nil)
		req.Header.Set("X-Region", region)
		resp, err := client.Do(req)
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	// The buckets in Redis, with how long until each is full again, and
	// beside each its control record (Limiter.SetLimit, Limiter.Pause),
	// kept while the bucket is in use.
	for _, key := range redisServer.Keys() {
		fmt.Println(key, redisServer.TTL(key))
	}
	// Output:
	// quota:{api.example.com/eu} 200ms
	// quota:{api.example.com/eu}:ctl 10s
	// quota:{api.example.com/us} 100ms
	// quota:{api.example.com/us}:ctl 10s
}

// A provider that allows 10 requests a second, 300 a minute and 10,000 a
// day: every request takes a token from all three layers in one Redis call.
func ExampleWithLayers() {
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := redis.NewClient(&redis.Options{Addr: redisServer.Addr()})

	day := quota.PerDay(10000)
	day.Burst = 1000 // a long window's layer may burst more than three seconds' worth
	client := &http.Client{Transport: quota.NewTransport(rdb, quota.PerSecond(10),
		quota.WithLayers(quota.PerMinute(300), day),
		quota.WithBase(provider{}))}

	resp, err := client.Get("https://api.example.com/v1/geocode")
	if err != nil {
		log.Fatal(err)
	}
	resp.Body.Close()
	// One key a layer, all in the bucket's hash slot, each named after its
	// Limit but the first; and the bucket's control record.
	for _, key := range redisServer.Keys() {
		fmt.Println(key)
	}
	// Output:
	// quota:{api.example.com}
	// quota:{api.example.com}:0.11574074074074074/1000
	// quota:{api.example.com}:5/15
	// quota:{api.example.com}:ctl
}

// A Limiter gates work that is not an HTTP request: here, mail through a
// relay that takes six a minute, three at once.
func ExampleLimiter_Wait() {
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := redis.NewClient(&redis.Options{Addr: redisServer.Addr()})
	l := quota.NewLimiter(rdb)
	relay := quota.PerMinute(6)
	relay.Burst = 3

	for mail := 1; mail <= 4; mail++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := l.Wait(ctx, "smtp-relay", relay)
		cancel()
		if err != nil {
			// The wait would pass the deadline, or Redis is unavailable.
			fmt.Printf("mail %d: %v\n", mail, err)
			continue
		}
		fmt.Printf("mail %d: sent\n", mail) // send the mail
	}
	// Output:
	// mail 1: sent
	// mail 2: sent
	// mail 3: sent
	// mail 4: quota: wait would exceed the context deadline: "smtp-relay" needs 10s
}

func ExampleJoin() {
	req := httptest.NewRequest("GET", "https://API.example.com:443/v1", nil)
	for _, f := range []quota.KeyFunc{
		quota.Host,
		quota.Join(quota.Host, quota.Fixed("eu")),
		quota.Join(quota.Fixed("tenant-42"), quota.Host),
	} {
		name, _ := f(req)
		fmt.Println(name)
	}
	// Output:
	// api.example.com
	// api.example.com/eu
	// tenant-42/api.example.com
}
