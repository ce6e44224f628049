package main

import (
	"context"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"golang.org/x/time/rate"
)

// limit is a bucket's rate in tokens per second and its burst, given to
// every peer in its own terms.
type limit struct {
	Rate  float64
	Burst int
}

// acquireFunc blocks until one token is granted or fails.
type acquireFunc func(ctx context.Context) error

// A peer is one rate limiter under test. newAcquire returns the blocking
// acquisition its users write for a fresh bucket named key; peers that keep
// no state in Redis ignore rdb. scaling puts the peer in the scaling table.
type peer struct {
	name       string
	redis      bool
	scaling    bool
	newAcquire func(rdb *redis.Client, key string, lim limit) acquireFunc
}

// The names of the peers that the figures under the table compare.
const (
	quotaName     = "quota Limiter.Wait"
	unbatchedName = "quota, WithNoBatching()"
	uncontrolName = "quota, control reads not sent"
	redisRateName = "go-redis/redis_rate v10"
	seedName      = "seed article script + loop"
)

// peers are the limiters in the table, in its order.
var peers = []peer{
	{name: quotaName, redis: true, scaling: true, newAcquire: quotaAcquire(true)},
	{name: unbatchedName, redis: true, scaling: true, newAcquire: quotaAcquire(false)},
	{name: uncontrolName, redis: true, newAcquire: uncontrolledAcquire},
	{name: redisRateName, redis: true, scaling: true, newAcquire: redisRateAcquire},
	{name: seedName, redis: true, newAcquire: seedAcquire},
	{name: "x/time/rate (in-process)", redis: false, newAcquire: localAcquire},
}

// quotaAcquire is quota's Limiter.Wait: a script call that takes the token
// and replies the exact wait, then one sleep. With batching (the default)
// the goroutines that ask while a call for the bucket is in flight share
// the next call; without, each acquisition is a call of its own.
func quotaAcquire(batching bool) func(rdb *redis.Client, key string, lim limit) acquireFunc {
	return func(rdb *redis.Client, key string, lim limit) acquireFunc {
		var opts []quota.Option
		if !batching {
			opts = append(opts, quota.WithNoBatching())
		}
		l := quota.NewLimiter(rdb, opts...)
		ql := quota.Limit{Rate: lim.Rate, Burst: float64(lim.Burst)}
		return func(ctx context.Context) error { return l.Wait(ctx, key, ql) }
	}
}

// uncontrolledAcquire is quota's Limiter.Wait on a client that answers
// the reads of the buckets' control records itself, as if no operator had
// set anything, instead of sending them to Redis: what an acquisition cost
// Redis before runtime control (SetLimit, Pause), beside what it costs now.
func uncontrolledAcquire(rdb *redis.Client, key string, lim limit) acquireFunc {
	rdb.AddHook(noControlHook{})
	return quotaAcquire(true)(rdb, key, lim)
}

// redisRateAcquire is redis_rate's blocking pattern as its users write it:
// Allow, and when not allowed sleep RetryAfter and ask again.
func redisRateAcquire(rdb *redis.Client, key string, lim limit) acquireFunc {
	l := redis_rate.NewLimiter(rdb)
	rl := redis_rate.Limit{Rate: int(lim.Rate), Burst: lim.Burst, Period: time.Second}
	return func(ctx context.Context) error {
		for {
			res, err := l.Allow(ctx, key, rl)
			if err != nil {
				return err
			}
			if res.Allowed > 0 {
				return nil
			}
			if err := sleep(ctx, res.RetryAfter); err != nil {
				return err
			}
		}
	}
}

// seedAcquire is the article's script and polling loop, see seedLimiter.
func seedAcquire(rdb *redis.Client, key string, lim limit) acquireFunc {
	l := newSeedLimiter(rdb, key, lim.Rate, float64(lim.Burst))
	return func(ctx context.Context) error { return l.acquire(ctx, 1) }
}

// localAcquire is golang.org/x/time/rate in this process alone: no Redis,
// the lower bound of what an acquisition can cost.
func localAcquire(_ *redis.Client, _ string, lim limit) acquireFunc {
	l := rate.NewLimiter(rate.Limit(lim.Rate), lim.Burst)
	return l.Wait
}

// sleep waits for d or until ctx ends, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
