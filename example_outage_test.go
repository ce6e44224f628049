package quota_test

import (
	"fmt"
	"log"
	"log/slog"
	"net/http"
	"os"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// Examples of outages: FallbackLocal (policy.go, fallback.go) and
// RedisOptions (redisopts.go).

// While Redis is unavailable each of at most four workers grants from a
// local quarter of the limit, and says so once in its log.
func ExampleFallbackLocal() {
	redisServer := standin.Redis()
	defer standin.Provider(ok)()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	// A log without the time, the address and the cause, which change
	// from run to run.
	logger := slog.New(slog.NewTextHandler(os.Stdout, &slog.HandlerOptions{
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			switch a.Key {
			case slog.TimeKey, "redis", "cause":
				return slog.Attr{}
			}
			return a
		},
	}))

	// README:
	tr := quota.NewTransport(rdb, quota.PerMinute(300),
		quota.WithPolicy(quota.FallbackLocal(4)), // at most 4 workers share the limit
		quota.WithLogger(logger))
	// end README

	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	get := func() {
		resp, err := client.Get("https://api.example.com/v1/geocode")
		if err != nil {
			log.Fatal(err)
		}
		resp.Body.Close()
		fmt.Println(resp.Status, "in mode", tr.Limiter().Mode())
	}
	get()
	redisServer.Close() // Redis goes away
	get()
	// Output:
	// 200 OK in mode shared
	// level=WARN msg="quota: Redis unavailable, requests now use this process's local share of each limit" bucket=api.example.com policy="fallback local (4 workers)" mode=local
	// 200 OK in mode local
}

// A limiter's client finds an outage within one call and never retries a
// take.
func ExampleRedisOptions() {
	// README:
	opts := quota.RedisOptions("redis.internal:6379")
	opts.Username, opts.Password = "limiter", os.Getenv("QUOTA_REDIS_PASSWORD")
	rdb := redis.NewClient(opts)
	// end README
	defer rdb.Close()

	o := quota.RedisOptions("redis.internal:6379")
	fmt.Println("dial, read, write and pool timeouts:", o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout)
	fmt.Println("retries:", o.MaxRetries, "dial retries:", o.DialerRetries, "deadline bounds the call:", o.ContextTimeoutEnabled)
	// Output:
	// dial, read, write and pool timeouts: 100ms 100ms 100ms 100ms
	// retries: -1 dial retries: 1 deadline bounds the call: true
}

// A Cluster takes the same timeouts and no retries.
func ExampleRedisOptions_cluster() {
	// README:
	o := quota.RedisOptions("")
	rdb := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:       []string{"redis-1:6379", "redis-2:6379", "redis-3:6379"},
		DialTimeout: o.DialTimeout, ReadTimeout: o.ReadTimeout, WriteTimeout: o.WriteTimeout,
		PoolTimeout: o.PoolTimeout, MaxRetries: o.MaxRetries, DialerRetries: o.DialerRetries,
		ContextTimeoutEnabled: o.ContextTimeoutEnabled,
	})
	l := quota.NewLimiter(rdb) // or quota.NewTransport(rdb, ...)
	// end README
	defer rdb.Close()
	fmt.Println(l.Mode())
	// Output: shared
}
