package quota

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/redis/go-redis/v9"
	"golang.org/x/time/rate"
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
// While Redis is unavailable the Limiter's Policy serves requests, and a
// background probe finds out when Redis answers again; Mode tells which is
// the case.
//
// A Limiter is safe for concurrent use. Most callers want a Transport, which
// waits for a token before each HTTP request; Wait serves everything else.
type Limiter struct {
	cfg          config
	bucketScript *script
	obs          observer
	health       health
	locals       localLimiters
	workers      fleet
	argv         argvCache
}

// NewLimiter returns a Limiter that keeps its buckets in rdb, which may be a
// *redis.Client, *redis.ClusterClient, *redis.Ring or a failover client.
// It panics if rdb is nil.
func NewLimiter(rdb redis.Scripter, opts ...Option) *Limiter {
	if rdb == nil {
		panic("quota: NewLimiter with a nil Redis client")
	}
	cfg := newConfig(opts)
	l := &Limiter{
		cfg:          cfg,
		bucketScript: newScript(rdb, bucketSource),
		obs:          newObserver(cfg),
	}
	l.argv.init(cfg.maxWait)
	l.health.init(l, rdb)
	l.workers.init(rdb, cfg)
	name := cfg.name
	if name == "" {
		name = l.health.client
	}
	observeMode(l, cfg.meterProvider, name)
	return l
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
// ErrInvalidKey. While Redis is unavailable, the Limiter's Policy decides.
func (l *Limiter) WaitN(ctx context.Context, key string, lim Limit, n float64) error {
	return l.WaitAll(ctx, key, n, lim)
}

// WaitAll is WaitN for a bucket that obeys several Limits at once, as
// providers publish them: 10 a second and 300 a minute and 10,000 a day.
// One script call checks every layer and takes n tokens from all of them
// or from none; the wait is the longest of the layers'. The first layer
// lives under the bucket's key and each further one under a key of its own
// in the same Redis Cluster slot.
func (l *Limiter) WaitAll(ctx context.Context, key string, n float64, lims ...Limit) (err error) {
	ctx, span := l.obs.start(ctx, key, n)
	span.mode = l.health.mode()
	defer func() { span.end(err) }()

	b, err := l.bucket(key, lims)
	if err != nil {
		return err
	}
	span.limit(b.lims[0])
	if err := b.checkTokens(n); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	for {
		if mode := l.health.mode(); mode != ModeShared {
			span.mode = mode
			l.health.touch(b)
			err := l.degradedWait(ctx, b, n, mode)
			if err == errAskAgain {
				continue // Redis may be back by now
			}
			return err
		}
		maxWait, deadline := l.maxWait(ctx)
		r, trips, err := l.call(ctx, b, opTake, n, maxWait.Microseconds(), nil)
		span.trips += trips
		if err != nil {
			if cerr := l.classify(ctx, err); !errors.Is(cerr, ErrUnavailable) {
				return cerr
			}
			l.health.trip(b, err)
			continue // the policy serves this request too
		}
		l.workers.heartbeat()
		if r.granted {
			if l.cfg.policy.mode() == ModeLocal {
				l.locals.granted(key, r.wait)
			}
			if err := sleep(ctx, r.wait); err != nil {
				go l.refund(context.WithoutCancel(ctx), b, n, r.tats)
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

// Mode returns how the Limiter grants tokens now: ModeShared while Redis is
// healthy, the Policy's mode while it is not. A service can report it on its
// health endpoint.
func (l *Limiter) Mode() Mode { return l.health.mode() }

// errAskAgain tells WaitAll that the policy slept MaxWait without granting.
var errAskAgain = errors.New("quota: ask again")

// degradedWait serves a request by the Policy while Redis is unavailable.
func (l *Limiter) degradedWait(ctx context.Context, b bucket, n float64, mode Mode) error {
	switch mode {
	case ModeOpen:
		l.health.served.Add(1)
		return nil
	case ModeLocal:
		return l.localWait(ctx, b, n)
	}
	l.health.refused.Add(1)
	return fmt.Errorf("%w: %w", ErrUnavailable, l.health.lastCause())
}

// localWait waits for n tokens from this process's share of every layer.
func (l *Limiter) localWait(ctx context.Context, b bucket, n float64) error {
	tokens := int(math.Ceil(n))
	now := time.Now()
	var delay time.Duration
	var rs []*rate.Reservation
	cancel := func() {
		for _, r := range rs {
			r.CancelAt(now)
		}
	}
	for i, lim := range b.lims {
		rl := l.locals.get(b.name, b.keys[i], lim, l.workers.divisor(l.cfg.policy))
		if tokens > rl.Burst() {
			cancel()
			l.health.refused.Add(1)
			return fmt.Errorf("%w: %v tokens exceed this worker's local share of the burst, %d", ErrUnavailable, n, rl.Burst())
		}
		r := rl.ReserveN(now, tokens)
		rs = append(rs, r)
		delay = max(delay, r.DelayFrom(now))
	}
	maxWait, deadline := l.maxWait(ctx)
	if delay > maxWait {
		cancel()
		if deadline {
			return fmt.Errorf("%w: %q needs %v", ErrWouldExceedDeadline, b.name, delay)
		}
		if err := sleep(ctx, maxWait); err != nil {
			return err
		}
		return errAskAgain
	}
	if err := sleep(ctx, delay); err != nil {
		for _, r := range rs {
			r.Cancel()
		}
		return err
	}
	l.health.served.Add(1)
	return nil
}

// settleLocal hands the shared bucket, when it resumes, the state of the
// local shares: it holds at most what this worker's share holds, times the
// workers, so that a bucket Redis forgot (or kept from before the outage, full
// by now) does not release a burst on top of what the local shares just
// sent; and it is charged the tokens this worker's share promised to callers
// still sleeping, so that their grants and the shared bucket's do not
// overlap.
func (l *Limiter) settleLocal() {
	workers := float64(l.workers.divisor(l.cfg.policy))
	for _, s := range l.locals.shares() {
		b := bucket{keys: []string{s.rkey}, lims: []Limit{s.lim}}
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		_ = l.lower(ctx, b, max(s.tokens, 0)*workers)
		if s.tokens < 0 {
			_ = l.adjust(ctx, b, -s.tokens)
		}
		cancel()
	}
}

// refund hands n tokens taken at tats back to the bucket after the caller
// gave up waiting for them.
func (l *Limiter) refund(ctx context.Context, b bucket, n float64, tats []int64) {
	ctx, cancel := context.WithTimeout(ctx, refundTimeout)
	defer cancel()
	if _, _, err := l.call(ctx, b, opRefund, n, 0, tats); err == nil {
		l.obs.refunds.Add(ctx, 1)
	}
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

// classify turns an error of a Redis call into the error WaitN returns: the
// caller's own context error, ErrNoPermission or ErrScript for a call the
// server rejects as wrong (a misconfiguration or a bug, which no policy
// should hide), or ErrUnavailable for everything that says the server cannot
// serve now.
func (l *Limiter) classify(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return ctxErr
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		// The connection's deadline, taken from ctx, fired a moment before
		// ctx itself ended: the caller's deadline, not an outage.
		return context.DeadlineExceeded
	}
	if errors.Is(err, ErrScript) {
		return err
	}
	if redis.HasErrorPrefix(err, "NOPERM") {
		return fmt.Errorf("%w: %w", ErrNoPermission, err)
	}
	var rerr redis.Error
	if errors.As(err, &rerr) && !isOutageReply(err) {
		return fmt.Errorf("%w: %w", ErrScript, err)
	}
	return fmt.Errorf("%w: %w", ErrUnavailable, err)
}

// isOutageReply reports whether an error reply says that the server cannot
// serve now (loading, failing over, a replica, a cluster without quorum)
// rather than that the call is wrong.
func isOutageReply(err error) bool {
	for _, p := range []string{"LOADING", "CLUSTERDOWN", "READONLY", "MASTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS", "MOVED", "ASK", "FAILOVER", "UNBLOCKED"} {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
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
