package quota

import (
	"context"
	"crypto/sha1"
	"encoding/hex"
	"errors"
	"sync"

	"github.com/redis/go-redis/v9"
)

// script runs one Lua script on one Redis client. It loads the script once
// before its first use, however many goroutines start at once, and falls
// back to EVAL when a server has lost it (SCRIPT FLUSH, a restart, a
// failover to a node that never saw it); EVAL caches it there again.
type script struct {
	rdb redis.Scripter
	src string
	sha string

	mu      sync.Mutex
	loaded  bool
	loading chan struct{} // closed when the load in flight ends
}

func newScript(rdb redis.Scripter, src string) *script {
	sum := sha1.Sum([]byte(src))
	return &script{rdb: rdb, src: src, sha: hex.EncodeToString(sum[:])}
}

// run runs the script and returns its command and the number of Redis round
// trips it took.
func (s *script) run(ctx context.Context, keys []string, args ...any) (*redis.Cmd, int) {
	trips, err := s.load(ctx)
	if err != nil {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(err)
		return cmd, trips
	}
	cmd := s.rdb.EvalSha(ctx, s.sha, keys, args...)
	trips++
	if isNoScript(cmd.Err()) {
		cmd = s.rdb.Eval(ctx, s.src, keys, args...)
		trips++
	}
	return cmd, trips
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
			return 0, nil // on failure, EVALSHA falls back to EVAL or fails alike
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
	done := make(chan struct{})
	s.loading = done
	s.mu.Unlock()

	err = s.rdb.ScriptLoad(ctx, s.src).Err()

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
