package quota_test

import (
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/alicebob/miniredis/v2"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// Examples of tenants (tenants.go).

// Two customers keep a queue on one bucket: the one weighted 3 gets three
// requests for each of the other's, in every process that shares it.
func ExampleWithTenants() {
	redisServer, err := miniredis.Run() // on the real clock: tenants take turns as time passes
	if err != nil {
		panic(err)
	}
	defer redisServer.Close()
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.Limit{Rate: 20, Burst: 1},
		quota.WithTenants(quota.Tenants{
			Weights: map[string]float64{"enterprise": 3}, // the others weigh 1
		}),
		quota.WithTenant(func(req *http.Request) string {
			return req.Header.Get("X-Customer")
		}))
	// end README
	client := &http.Client{Transport: tr}

	var sent [2]atomic.Int64
	end := time.Now().Add(2 * time.Second)
	var wg sync.WaitGroup
	for i, customer := range []string{"enterprise", "free"} {
		for range 10 {
			wg.Go(func() {
				for time.Now().Before(end) {
					req, _ := http.NewRequest("GET", "https://api.example.com/v1/geocode", nil)
					req.Header.Set("X-Customer", customer)
					resp, err := client.Do(req)
					if err != nil {
						panic(err)
					}
					resp.Body.Close()
					if time.Now().Before(end) {
						sent[i].Add(1)
					}
				}
			})
		}
	}
	wg.Wait()
	share := float64(sent[0].Load()) / float64(sent[0].Load()+sent[1].Load())
	// Three quarters, less the first queue, which the first to come fill.
	fmt.Println("enterprise had about three requests for each of the other's:", share > 0.6 && share < 0.9)
	// Output:
	// enterprise had about three requests for each of the other's: true
}
