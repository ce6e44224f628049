package quota

import (
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisOptions returns go-redis options for a limiter's client at addr.
// The go-redis defaults suit a cache, not a limiter: a 5-second dial
// timeout, and three retries of a failed command and of a failed dial,
// would make the first request of an outage wait seconds before the Policy
// takes over, and each retry of a take whose reply was lost takes its
// tokens again. These options find an outage within one call (at once
// when the server refuses connections, after 100 ms when it hangs), never
// retry a command, and let a request's deadline bound its Redis call:
//
//	rdb := redis.NewClient(quota.RedisOptions("localhost:6379"))
//
// Change the fields you need, such as Password or TLSConfig, before
// redis.NewClient; for a Cluster, copy the timeouts, MaxRetries and
// DialerRetries into redis.ClusterOptions.
func RedisOptions(addr string) *redis.Options {
	const timeout = 100 * time.Millisecond
	return &redis.Options{
		Addr:                  addr,
		DialTimeout:           timeout,
		ReadTimeout:           timeout,
		WriteTimeout:          timeout,
		PoolTimeout:           timeout,
		MaxRetries:            -1, // a lost reply costs its tokens once
		DialerRetries:         1,
		ContextTimeoutEnabled: true, // the request's deadline bounds the call
	}
}
