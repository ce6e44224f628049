package quota_test

import (
	"fmt"
	"log"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// A workload spread over three deployments of one model, each with a
// quota of its own: requests go to the provisioned ones while they have
// room, and to pay-as-you-go only beyond.
func ExampleWithPool() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	var mu sync.Mutex
	served := map[string]int{}
	defer standin.Provider(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		served[strings.TrimSuffix(r.URL.Host, ".openai.azure.com")]++
		mu.Unlock()
	})()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	keys := map[string]string{"eastus": "k1", "westus": "k2", "paygo": "k3"}
	tokensOf := func(*http.Request) float64 { return 4_000 }

	// README:
	route := func(req *http.Request, deployment string) *http.Request {
		r := req.Clone(req.Context()) // never modify req
		r.URL.Host = deployment + ".openai.azure.com"
		r.Header.Set("api-key", keys[deployment])
		return r
	}
	tr := quota.NewTransport(rdb, quota.PerMinute(1), // unused: each deployment has its own Limit
		quota.WithKey(quota.Fixed("gpt-4o")),
		quota.WithCost(tokensOf), // the request's tokens, as an LLM provider counts them
		quota.WithPool(route, map[string][]quota.Limit{
			"eastus": {quota.PerMinute(600_000)},
			"westus": {quota.PerMinute(300_000)},
			"paygo":  {quota.PerMinute(100_000)},
		}, "paygo")) // paygo: a last resort
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	for range 6 { // within eastus's and westus's bursts
		resp, err := client.Post("https://gpt-4o.example/v1/chat/completions", "application/json", strings.NewReader("{}"))
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
	}
	fmt.Println("eastus and westus:", served["eastus"]+served["westus"], "paygo:", served["paygo"])
	// Output: eastus and westus: 6 paygo: 0
}
