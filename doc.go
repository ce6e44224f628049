// Package quota keeps a fleet of HTTP clients inside one provider's rate
// limit.
//
// A limiter inside each process sees only its own traffic: four workers each
// allowed 300 requests a minute send the provider 1,200. quota keeps one
// token bucket per provider in Redis and updates it with one atomic Lua
// script, so the provider sees the agreed rate however many workers run.
//
// Most users want a Transport, set as an http.Client's Transport:
//
//	rdb := redis.NewClient(quota.RedisOptions("localhost:6379"))
//	defer rdb.Close()
//
//	client := &http.Client{
//		Transport: quota.NewTransport(rdb, quota.PerMinute(300)),
//		Timeout:   30 * time.Second, // bounds the wait for a token too
//	}
//
// Each request then waits for a token from the bucket of its host (see
// KeyFunc); the client's Timeout is the request's deadline, which keeps its
// place in the bucket's queue. RedisOptions gives the limiter's client
// short timeouts and no retries, so that an outage is found within one
// call. A Limiter serves work that is not HTTP.
//
// Every acquisition costs at most one Redis round trip, however many callers
// contend: the script takes the tokens at once, letting the bucket run into
// debt, and replies how long until they accrue. The caller sleeps that long
// once and proceeds, so callers are served first come, first served across
// the fleet, and nobody polls. A caller whose context has a deadline keeps
// its place however long the queue; one without is bounded by MaxWait.
//
// While Redis is unavailable a Policy decides: FailClosed (the default),
// FallbackLocal or FailOpen. A breaker keeps requests from paying a Redis
// timeout each, every change of mode is logged, and Limiter.Mode reports the
// current one. Under FallbackLocal the fleet returns to the shared bucket at
// one instant, so the change adds no burst.
//
// What the provider answers flows back into the bucket: a 429 with
// Retry-After pauses it for the whole fleet, callers already sleeping on
// their grants included, and on request its rate-limit
// headers lower it (WithProviderHeaders) and its stated costs settle it
// (WithCost, WithSettle). A bucket may obey several limits at once
// (WithLayers, the layers of Limiter.WaitN).
//
// An LLM API meters each request on several limits at once, and tells
// what it used only in its answer: WithMetering reserves a request's
// amount of each Meter in one call and settles the reservation from the
// answer's usage (Limiter.Reserve does the same for work that is not
// HTTP). Package github.com/sharedquota/quota/llm holds the Meterings of
// Anthropic's and OpenAI's APIs.
//
// An operator can change a bucket's Limit and pause it at run time, for
// the whole fleet, and read it whole with the rate it grants
// (Limiter.SetLimit, Pause and Status, package status, the quotactl
// command). A bucket has one pause, whoever set it, which every take sees
// in the script. Each Limiter listens for changes on one subscription, and
// its callers asleep on a bucket read its record every half second, so a
// lost announcement costs them at most that. Transports can share a
// Limiter (WithLimiter).
//
// Spans and metrics go to OpenTelemetry through its API (see ScopeName).
package quota
