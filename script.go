package quota

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed script.lua
var scriptSource string

var scriptSHA = func() string {
	sum := sha1.Sum([]byte(scriptSource))
	return hex.EncodeToString(sum[:])
}()

// script runs the bucket script on one Redis client. It loads the script
// once before its first use, however many goroutines start at once, and
// falls back to EVAL when a server has lost it (SCRIPT FLUSH, a restart, a
// failover to a node that never saw it); EVAL caches it there again.
type script struct {
	rdb redis.Scripter

	mu      sync.Mutex
	loaded  bool
	loading chan struct{} // closed when the load in flight ends
}

// reply is the decoded reply of the script.
type reply struct {
	granted bool
	wait    time.Duration
	tat     int64 // microseconds; identifies a take for its refund
}

// call runs op on key and returns the reply and the number of Redis round
// trips it took.
func (s *script) call(ctx context.Context, key, op string, lim Limit, n float64, arg int64, now string) (reply, int, error) {
	trips, err := s.load(ctx)
	if err != nil {
		return reply{}, trips, err
	}
	args := []any{
		op,
		strconv.FormatFloat(lim.Rate, 'g', -1, 64),
		strconv.FormatFloat(lim.Burst, 'g', -1, 64),
		strconv.FormatFloat(n, 'g', -1, 64),
		arg,
		now,
	}
	keys := []string{key}
	cmd := s.rdb.EvalSha(ctx, scriptSHA, keys, args...)
	trips++
	if isNoScript(cmd.Err()) {
		cmd = s.rdb.Eval(ctx, scriptSource, keys, args...)
		trips++
	}
	if err := cmd.Err(); err != nil {
		return reply{}, trips, err
	}
	v, err := cmd.Int64Slice()
	if err != nil || len(v) != 3 {
		return reply{}, trips, fmt.Errorf("%w: unexpected reply %v", ErrScript, cmd.Val())
	}
	return reply{granted: v[0] == 1, wait: time.Duration(v[1]) * time.Microsecond, tat: v[2]}, trips, nil
}

// load sends the script to the server once. Concurrent callers wait for the
// one load in flight instead of sending their own; a failed load is tried
// again by the next caller.
func (s *script) load(ctx context.Context) (trips int, err error) {
	s.mu.Lock()
	if s.loaded {
		s.mu.Unlock()
		return 0, nil
	}
	if wait := s.loading; wait != nil {
		s.mu.Unlock()
		select {
		case <-wait:
			return 0, nil // on failure, EVALSHA falls back to EVAL
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	done := make(chan struct{})
	s.loading = done
	s.mu.Unlock()

	err = s.rdb.ScriptLoad(ctx, scriptSource).Err()

	s.mu.Lock()
	s.loaded = err == nil
	s.loading = nil
	s.mu.Unlock()
	close(done)
	return 1, err
}

func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}
