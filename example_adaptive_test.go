package quota_test

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// A provider that allows fewer requests than the Limit says: its first
// refusal cuts the rate every process of the fleet uses.
func ExampleWithAdaptive() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	var n atomic.Int64
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {
		if n.Add(1) == 3 {
			w.WriteHeader(http.StatusServiceUnavailable) // nginx's limit_req
		}
	})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	tr := quota.NewTransport(rdb, quota.PerSecond(400), // the most it may reach
		quota.WithAdaptive(quota.Adaptive{Refusals: []int{429, 503}}))
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	for range 3 {
		resp, err := client.Get("https://api.example.com/v1/geocode")
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	// The cut runs in the background once the refusal is back.
	var st quota.Status
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		var err error
		if st, err = tr.Limiter().Status(context.Background(), "api.example.com"); err != nil || st.Layers[0].Learned != nil {
			break
		}
	}
	l := st.Layers[0]
	fmt.Printf("%g/s learned below a Limit of %g/s, cut by a %s\n", l.Rate, l.Learned.Ceiling, l.Learned.Why)
	// Output: 360/s learned below a Limit of 400/s, cut by a 503
}
