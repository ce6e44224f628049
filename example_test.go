package quota_test

import (
	"fmt"
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// The examples run against stand-ins (internal/standin), so that they
// print the same every time: for the fleet's Redis, a miniredis whose
// clock stands still; for the provider, a function that answers every
// request sent through http.DefaultTransport, without a network.
//
// The code between a "// README:" line and the next "// end README" line
// of an Example is a Go block of README.md or of a page under docs/, and
// TestREADMEGoBlocksAreExamples checks that it is. The lines outside those
// markers set up the stand-ins and print what the example shows.

// ok answers 200 OK.
func ok(w http.ResponseWriter, r *http.Request) {}

// Every worker of the fleet runs the same program: together they send the
// provider at most 300 requests a minute, however many workers run.
func Example() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()

	// README:
	// One client per process, shared by every Transport and Limiter.
	rdb := redis.NewClient(quota.RedisOptions("localhost:6379"))
	// end README
	rdb.Close()
	rdb = standin.Client(redisServer) // the stand-in instead of localhost:6379
	// README:
	defer rdb.Close()

	// At most 300 requests a minute to each host, across every worker.
	client := &http.Client{
		Transport: quota.NewTransport(rdb, quota.PerMinute(300)),
		Timeout:   30 * time.Second, // bounds the wait for a token too
	}

	resp, err := client.Get("https://geocoder.example.com/v1/search?q=Berlin")
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Body.Close()
	fmt.Println(resp.Status)
	// end README

	// Output: 200 OK
}

// A provider that meters each region separately gets a bucket per host and
// region, and one endpoint with a limit of its own.
func ExampleNewTransport_regions() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerSecond(10), // every bucket not listed
		quota.WithKey(quota.Join(quota.Host, quota.Header("X-Region"))),
		quota.WithLimits(map[string]quota.Limit{
			"api.example.com/eu": {Rate: 5, Burst: 10},
		}))
	// end README
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
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	day := quota.PerDay(10000)
	day.Burst = 1000 // a day's layer may hold more than three seconds of rate
	tr := quota.NewTransport(rdb, quota.PerSecond(10),
		quota.WithLayers(quota.PerMinute(300), day))
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
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

func ExampleJoin() {
	req := httptest.NewRequest("GET", "https://API.example.com:443/v1", nil)
	req.Header.Set("X-Region", "eu")
	for _, f := range []quota.KeyFunc{
		quota.Host,
		quota.Join(quota.Host, quota.Fixed("eu")),
		quota.Join(quota.Host, quota.Header("X-Region")),
		quota.Join(quota.Fixed("tenant-42"), quota.Host),
		quota.Fixed("geocoder"),
	} {
		name, _ := f(req) // req is a GET of https://API.example.com:443/v1
		fmt.Println(name)
	}
	// Output:
	// api.example.com
	// api.example.com/eu
	// api.example.com/eu
	// tenant-42/api.example.com
	// geocoder
}

// A Limit is a rate and a burst; the zero Burst means three seconds of rate.
func ExampleLimit() {
	fmt.Println(quota.PerMinute(300))
	fmt.Println(quota.PerSecond(10))
	fmt.Println(quota.Limit{Rate: 10, Burst: 5})
	fmt.Println(quota.Limit{Rate: 1, Burst: 1e8}.Validate())
	// Output:
	// 5/s burst 15
	// 10/s burst 30
	// 10/s burst 5
	// quota: invalid limit: a burst of 1e+08 at 1/s takes longer than 366 days to fill
}
