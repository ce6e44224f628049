package quota

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// maxNameLen bounds the bucket name inside a Redis key. Longer names, which
// only untrusted input produces, are shortened to a prefix and a digest.
const maxNameLen = 200

// refundTimeout bounds the Redis call that hands tokens back after a
// cancelled wait; the caller does not wait for it.
const refundTimeout = time.Second

// A Limiter takes tokens from buckets kept in Redis and shared by every
// Limiter that uses the same Redis and prefix, across goroutines, processes
// and hosts. Each bucket is a key; its Limit travels with each call, so all
// callers of one bucket must pass the same Limit.
//
// A Limiter is safe for concurrent use. Most callers want a Transport, which
// waits for a token before each HTTP request; Wait serves everything else.
type Limiter struct {
	script script
	cfg    config
	obs    observer
}

// NewLimiter returns a Limiter that keeps its buckets in rdb, which may be a
// *redis.Client, *redis.ClusterClient, *redis.Ring or a failover client.
// It panics if rdb is nil.
func NewLimiter(rdb redis.Scripter, opts ...Option) *Limiter {
	if rdb == nil {
		panic("quota: NewLimiter with a nil Redis client")
	}
	cfg := newConfig(opts)
	return &Limiter{
		script: script{rdb: rdb},
		cfg:    cfg,
		obs:    newObserver(cfg),
	}
}

// Wait is shorthand for WaitN(ctx, key, lim, 1).
func (l *Limiter) Wait(ctx context.Context, key string, lim Limit) error {
	return l.WaitN(ctx, key, lim, 1)
}

// WaitN blocks until n tokens of the bucket named key, refilled at lim, are
// the caller's. It asks Redis once: the script takes the tokens at once,
// possibly into debt, and replies how long until they accrue; WaitN sleeps
// that long and returns. Callers of one bucket are served in the order their
// calls reached Redis, across the whole fleet.
//
// When the wait would end after ctx's deadline, WaitN takes nothing and
// returns at once an error matching ErrWouldExceedDeadline and
// context.DeadlineExceeded. When it would be longer than the MaxWait option
// (5s by default), WaitN takes nothing, sleeps MaxWait and asks again. When
// ctx ends during the sleep, the tokens are handed back to the bucket and
// WaitN returns ctx's error.
//
// An invalid lim, n or key fails at once, without a Redis call, with an
// error matching ErrInvalidLimit, ErrInvalidTokens, ErrExceedsBurst or
// ErrInvalidKey. When Redis cannot be used, the Limiter's Policy decides.
func (l *Limiter) WaitN(ctx context.Context, key string, lim Limit, n float64) (err error) {
	rkey, err := l.redisKey(key)
	if err != nil {
		return err
	}
	if lim, err = lim.resolve(); err != nil {
		return err
	}
	if err := lim.checkTokens(n); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	ctx, span := l.obs.start(ctx, key, lim, n)
	trips := 0
	defer func() { span.end(trips, err) }()

	for {
		maxWait, deadline := l.maxWait(ctx)
		r, t, err := l.script.call(ctx, rkey, "take", lim, n, maxWait.Microseconds(), l.now())
		trips += t
		if err != nil {
			return l.redisFailed(ctx, err)
		}
		if r.granted {
			span.waited(r.wait)
			if err := sleep(ctx, r.wait); err != nil {
				go l.refund(context.WithoutCancel(ctx), rkey, lim, n, r.tat)
				return err
			}
			return nil
		}
		if deadline {
			return fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, key, r.wait)
		}
		if err := sleep(ctx, maxWait); err != nil {
			return err
		}
	}
}

// refund hands n tokens taken at tat back to the bucket after the caller
// gave up waiting for them.
func (l *Limiter) refund(ctx context.Context, rkey string, lim Limit, n float64, tat int64) {
	ctx, cancel := context.WithTimeout(ctx, refundTimeout)
	defer cancel()
	_, _, _ = l.script.call(ctx, rkey, "refund", lim, n, tat, l.now())
}

// maxWait returns how long the caller accepts to wait, and whether that is
// set by ctx's deadline rather than by the MaxWait option.
func (l *Limiter) maxWait(ctx context.Context) (time.Duration, bool) {
	if d, ok := ctx.Deadline(); ok {
		if left := time.Until(d); left < l.cfg.maxWait {
			return max(left, 0), true
		}
	}
	return l.cfg.maxWait, false
}

// now returns the ARGV the script reads as the time: empty for the server's
// clock, the caller's clock in microseconds with WithClock.
func (l *Limiter) now() string {
	if l.cfg.clock == nil {
		return ""
	}
	return strconv.FormatInt(l.cfg.clock().UnixMicro(), 10)
}

// redisFailed turns an error of the Redis call into the error WaitN returns.
func (l *Limiter) redisFailed(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return ctxErr
	}
	if errors.Is(err, ErrScript) || isScriptError(err) {
		return fmt.Errorf("%w: %w", ErrScript, err)
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// isScriptError reports whether err is an error reply that says the call
// itself is wrong, as opposed to one that says the server cannot serve now.
func isScriptError(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	for _, p := range []string{"LOADING", "CLUSTERDOWN", "READONLY", "MASTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS", "MOVED", "ASK"} {
		if redis.HasErrorPrefix(err, p) {
			return false
		}
	}
	return true
}

// redisKey returns the Redis key of the bucket named name: the prefix, then
// the name in a hash tag so that every key of one bucket shares a Cluster
// slot.
func (l *Limiter) redisKey(name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: empty bucket name", ErrInvalidKey)
	}
	if len(name) > maxNameLen {
		sum := sha256.Sum256([]byte(name))
		digest := hex.EncodeToString(sum[:8])
		name = name[:maxNameLen-len(digest)-1] + "~" + digest
	}
	return l.cfg.prefix + "{" + name + "}", nil
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
