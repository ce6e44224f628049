package llm_test

import (
	"context"
	"fmt"
	"net/http"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/standin"
	"github.com/sharedquota/quota/llm"
)

// Two Azure OpenAI deployments of one model, each with its own tokens a
// minute, behind one metered pool: each request reserves its tokens on
// the deployment that grants them soonest, and is settled there.
func ExampleAzure_pool() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	provider := &llmfake.Server{Kind: llmfake.Azure, Used: func(int) int { return 200 }}
	defer standin.Provider(provider.ServeHTTP)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	route := func(req *http.Request, deployment string) *http.Request {
		r := req.Clone(req.Context()) // never modify req
		r.URL.Host = deployment + ".openai.azure.com"
		return r
	}

	// README:
	east, west := llm.AzureLimits{TokensPerMinute: 30000}, llm.AzureLimits{TokensPerMinute: 10000}
	tr := quota.NewTransport(rdb, east.Requests(), // each deployment has its own Limits
		quota.WithKey(quota.Fixed("gpt-4o")),
		quota.WithMetering(llm.Azure(east)),
		quota.WithPool(route, map[string][]quota.Limit{ // requests, then tokens
			"east": {east.Requests(), east.Tokens()},
			"west": {west.Requests(), west.Tokens()},
		}))
	client := &http.Client{Transport: tr}
	// end README

	postLLM(client, "https://gpt-4o.example/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21", 500)
	st, err := tr.Limiter().Status(context.Background(), "gpt-4o}{east")
	fmt.Println(st.Limit, err)
	// Output:
	// 200 OK with 200 output tokens used
	// 3/s burst 3 <nil>
}
