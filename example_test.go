package quota_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
)

// Every worker of the fleet builds the same client: together they send the
// provider at most 300 requests a minute, however many workers run.
func Example() {
	rdb := redis.NewClient(&redis.Options{
		Addr:        "localhost:6379",
		DialTimeout: 200 * time.Millisecond,
		ReadTimeout: 200 * time.Millisecond,
	})
	client := &http.Client{Transport: quota.NewTransport(rdb, quota.PerMinute(300))}

	resp, err := client.Get("https://geocoder.example.com/v1/search?q=Berlin")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
}

// A provider that meters each region separately gets a bucket per host and
// region, and one endpoint with a limit of its own.
func ExampleNewTransport_regions() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	tr := quota.NewTransport(rdb, quota.PerSecond(10),
		quota.WithKey(quota.HostRegion(quota.Header("X-Region"))),
		quota.WithLimits(map[string]quota.Limit{
			"api.example.com/eu": {Rate: 5, Burst: 10},
		}),
	)
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	_ = client
}

// A provider that allows 10 requests a second, 300 a minute and 10,000 a
// day: every request takes a token from all three layers in one Redis call.
func ExampleWithLayers() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	day := quota.PerDay(10000)
	day.Burst = 1000 // a long window's layer may burst more than three seconds' worth
	client := &http.Client{Transport: quota.NewTransport(rdb, quota.PerSecond(10),
		quota.WithLayers(quota.PerMinute(300), day))}
	_ = client
}

// A Limiter gates work that is not an HTTP request.
func ExampleLimiter_Wait() {
	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
	l := quota.NewLimiter(rdb)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := l.Wait(ctx, "smtp-relay", quota.PerMinute(60)); err != nil {
		log.Print(err) // the wait would pass the deadline, or Redis is unavailable
		return
	}
	// send the mail
}

func ExampleHostRegion() {
	req := httptest.NewRequest("GET", "https://API.example.com:443/v1", nil)
	for _, f := range []quota.KeyFunc{
		quota.Host,
		quota.HostRegion(quota.Fixed("eu")),
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
