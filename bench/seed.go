package main

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// seedSource is the token-bucket script of the article "Distributed Rate
// Limiting With Redis and Lua", byte for byte: HMGET, refill from the
// caller's clock, HMSET and EXPIRE, and a reply of {allowed, wait}.
//
//go:embed seed.lua
var seedSource string

// seedLimiter is the article's Python DistributedLimiter ported to Go line
// for line: the script is registered once (EVALSHA, EVAL when the server
// lacks it) and acquire asks it in a loop, sleeping the reported wait.
type seedLimiter struct {
	r        *redis.Client
	key      string
	rate     float64
	capacity float64
	script   *redis.Script
}

// newSeedLimiter is the article's __init__ with an explicit capacity.
func newSeedLimiter(r *redis.Client, key string, ratePerS, capacity float64) *seedLimiter {
	return &seedLimiter{r: r, key: key, rate: ratePerS, capacity: capacity, script: redis.NewScript(seedSource)}
}

// acquire blocks until tokens are available, as the article's acquire
// does: it calls the script with the caller's time.time(), returns when
// allowed, and otherwise sleeps min(wait, 5.0) or 0.01 seconds and asks
// again.
func (l *seedLimiter) acquire(ctx context.Context, tokens float64) error {
	for {
		now := float64(time.Now().UnixNano()) / 1e9 // time.time()
		v, err := l.script.Run(ctx, l.r, []string{l.key}, l.capacity, l.rate, now, tokens).Slice()
		if err != nil {
			return err
		}
		allowed, wait, err := seedReply(v)
		if err != nil {
			return err
		}
		if allowed == 1 {
			return nil
		}
		d := min(wait, 5.0)
		if d == 0 { // Python's "or 0.01": a zero wait is falsy
			d = 0.01
		}
		if err := sleep(ctx, time.Duration(d*float64(time.Second))); err != nil {
			return err
		}
	}
}

// seedReply decodes the script's reply {allowed, tostring(wait)}.
func seedReply(v []any) (allowed int64, wait float64, err error) {
	if len(v) != 2 {
		return 0, 0, fmt.Errorf("seed script: reply %v, want two elements", v)
	}
	allowed, ok := v[0].(int64)
	s, ok2 := v[1].(string)
	if !ok || !ok2 {
		return 0, 0, fmt.Errorf("seed script: reply %v, want {integer, string}", v)
	}
	wait, err = strconv.ParseFloat(s, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("seed script: wait %q: %w", s, err)
	}
	return allowed, wait, nil
}
