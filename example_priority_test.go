package quota_test

import (
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// Examples of priorities (priority.go).

// Interactive requests jump the queue that a batch keeps on the bucket:
// every process that shares it serves the higher priority first.
func ExampleWithPriority() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.Limit{Rate: 20, Burst: 1},
		quota.WithPriority(func(req *http.Request) int {
			if req.Header.Get("X-Batch") != "" {
				return 0 // the backfill, first come first served
			}
			return 5 // a user waits for this one
		}))
	// end README
	client := &http.Client{Transport: tr}

	get := func(batch bool) time.Duration {
		req, _ := http.NewRequest("GET", "https://api.example.com/v1/geocode", nil)
		if batch {
			req.Header.Set("X-Batch", "1")
		}
		start := time.Now()
		resp, err := client.Do(req)
		if err != nil {
			panic(err)
		}
		resp.Body.Close()
		return time.Since(start)
	}
	var wg sync.WaitGroup
	for range 20 { // a second's queue of the batch
		wg.Go(func() { get(true) })
	}
	time.Sleep(50 * time.Millisecond)
	waited := get(false)
	wg.Wait()
	fmt.Println("the interactive request waited under half a second:", waited < 500*time.Millisecond)
	// Output:
	// the interactive request waited under half a second: true
}
