// Package redisx is the library's Redis layer: it runs Lua scripts,
// classifies what Redis answers, listens on a channel, and formats the
// numbers scripts read. The packages that own a Redis protocol build on it,
// and it builds on go-redis alone.
package redisx

import (
	"context"
	"crypto/sha1"
	_ "embed"
	"encoding/hex"
	"errors"
	"sync"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// A Script runs one Lua script on one Redis client with EVALSHA, falling back
// to EVAL when a server does not have it (the first use, SCRIPT FLUSH, a
// restart, a failover to a node that never saw it); EVAL caches it there.
//
// The first call sends the script with EVAL while concurrent callers wait
// for it, so however many goroutines start at once the script is sent once,
// and priming costs no command beyond the call itself. (SCRIPT LOAD would
// cost one more, and on a Cluster it goes to every node, replicas included,
// failing when any of them is down.)
type Script struct {
	rdb redis.Scripter
	src string
	sha string

	primed  atomic.Bool // the server has answered a call
	mu      sync.Mutex
	priming chan struct{} // closed when the first call ends
}

//go:embed prelude.lua
var prelude string

// NewScript returns the Script of source src on rdb, after the prelude
// (prelude.lua), whose functions every script of the library may call.
func NewScript(rdb redis.Scripter, src string) *Script {
	src = prelude + src
	sum := sha1.Sum([]byte(src))
	return &Script{rdb: rdb, src: src, sha: hex.EncodeToString(sum[:])}
}

// Client returns the client the script runs on.
func (s *Script) Client() redis.Scripter { return s.rdb }

// Source returns the script's source, its prelude included.
func (s *Script) Source() string { return s.src }

// Run runs the script and returns its command and the number of Redis
// round trips it took.
func (s *Script) Run(ctx context.Context, keys []string, args ...any) (*redis.Cmd, int) {
	if s.prime(ctx) {
		cmd := s.rdb.Eval(ctx, s.src, keys, args...)
		s.primeDone(cmd.Err())
		return cmd, 1
	}
	if err := ctx.Err(); err != nil {
		cmd := redis.NewCmd(ctx)
		cmd.SetErr(err)
		return cmd, 0
	}
	cmd := s.rdb.EvalSha(ctx, s.sha, keys, args...)
	if !isNoScript(cmd.Err()) {
		return cmd, 1
	}
	return s.rdb.Eval(ctx, s.src, keys, args...), 2
}

// prime reports whether the caller is to send the script with EVAL as the
// first call. A caller that finds the first call in flight waits for it.
func (s *Script) prime(ctx context.Context) bool {
	if s.primed.Load() {
		return false
	}
	s.mu.Lock()
	if s.primed.Load() {
		s.mu.Unlock()
		return false
	}
	if wait := s.priming; wait != nil {
		s.mu.Unlock()
		select {
		case <-wait:
		case <-ctx.Done():
		}
		return false
	}
	s.priming = make(chan struct{})
	s.mu.Unlock()
	return true
}

// primeDone ends the first call. When the server answered, the script is
// cached there; when it did not, the next caller primes again.
func (s *Script) primeDone(err error) {
	var reply redis.Error
	s.mu.Lock()
	if err == nil || errors.As(err, &reply) {
		s.primed.Store(true)
	}
	close(s.priming)
	s.priming = nil
	s.mu.Unlock()
}

func isNoScript(err error) bool {
	return err != nil && (errors.Is(err, redis.ErrNoScript) || redis.HasErrorPrefix(err, "NOSCRIPT"))
}

// SHA returns the SHA1 digest of the script's source, as EVALSHA takes it.
func (s *Script) SHA() string { return s.sha }
