package quota

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// Helpers shared by the package's tests.

// newMini starts a miniredis and returns it with a client and the client's
// command counter.
func newMini(t *testing.T) (*miniredis.Miniredis, *redis.Client, *cmdCounter) {
	t.Helper()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { rdb.Close() })
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	return mr, rdb, cmds
}

// cmdCounter is a go-redis hook that counts the commands a client sends,
// pipelined or not, by name ("evalsha", "eval", "script load", ...).
type cmdCounter struct {
	mu sync.Mutex
	n  map[string]int
}

func newCmdCounter() *cmdCounter { return &cmdCounter{n: map[string]int{}} }

func (c *cmdCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *cmdCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.count(cmd)
		return next(ctx, cmd)
	}
}

func (c *cmdCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			c.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (c *cmdCounter) count(cmd redis.Cmder) {
	name := cmd.Name()
	switch name {
	case "hello", "client", "auth", "select", "readonly":
		return // setting up a connection
	}
	if args := cmd.Args(); name == "script" && len(args) > 1 {
		name += " " + strings.ToLower(fmt.Sprint(args[1]))
	}
	c.mu.Lock()
	c.n[name]++
	c.mu.Unlock()
}

// get returns how many commands named name were sent.
func (c *cmdCounter) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

// total returns how many commands were sent.
func (c *cmdCounter) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, v := range c.n {
		n += v
	}
	return n
}

func (c *cmdCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.n)
}

func (c *cmdCounter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var parts []string
	for name, v := range c.n {
		parts = append(parts, fmt.Sprintf("%s=%d", name, v))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// eventually polls cond every millisecond until it holds, and fails the
// test when it does not within d. It returns how long it took.
func eventually(t testing.TB, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(time.Millisecond)
	}
	return time.Since(start)
}

// waitForMode waits up to d for l to be in mode m and returns how long it
// took.
func waitForMode(t testing.TB, l *Limiter, m Mode, d time.Duration) time.Duration {
	t.Helper()
	return eventually(t, d, "mode "+m.String(), func() bool { return l.Mode() == m })
}
