package quota

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/redisx"
)

//go:embed workers.lua
var workersSource string

// The roll call of FallbackLocal(n).CountingWorkers(): each Limiter in use
// announces itself every beatEvery; an announcement lasts beatTTL; the
// divisor is the largest count seen within peakHold.
const (
	beatEvery = 2 * time.Second
	beatTTL   = 10 * time.Second
	peakHold  = 10 * time.Minute
)

// workers counts the Limiters that share the Redis and the prefix.
type workers struct {
	script *redisx.Script // nil unless the policy counts workers
	key    string
	id     string
	clock  func() time.Time // nil: the server's

	next    atomic.Int64 // when the next announcement is due, unix ns
	beating atomic.Bool

	mu     sync.Mutex
	peak   int
	peakAt time.Time
}

func (f *workers) init(rdb redis.Scripter, cfg config) {
	if !cfg.policy.countWorkers {
		return
	}
	f.script = redisx.NewScript(rdb, workersSource)
	// Bucket keys are the prefix and a brace, so this key is none of them.
	f.key = cfg.prefix + "workers"
	f.clock = cfg.clock
	host, _ := os.Hostname()
	var b [6]byte
	_, _ = rand.Read(b[:])
	f.id = fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// heartbeat announces the Limiter when an announcement is due, in the
// background; the caller that finds it due does not wait for it.
func (f *workers) heartbeat() {
	if f.script == nil || time.Now().UnixNano() < f.next.Load() || !f.beating.CompareAndSwap(false, true) {
		return
	}
	f.next.Store(time.Now().Add(beatEvery).UnixNano())
	go func() {
		defer f.beating.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), breaker.ProbeTimeout)
		defer cancel()
		now := ""
		if f.clock != nil {
			now = strconv.FormatInt(f.clock().UnixMilli(), 10)
		}
		cmd, _ := f.script.Run(ctx, []string{f.key}, f.id, beatTTL.Milliseconds(), now)
		if n, err := cmd.Int64(); err == nil {
			f.saw(int(n))
		}
	}()
}

// saw records a count of live workers.
func (f *workers) saw(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n >= f.peak || time.Since(f.peakAt) > peakHold {
		f.peak, f.peakAt = n, time.Now()
	}
}

// divisor is the number of workers the local fallback divides by.
func (f *workers) divisor(p Policy) int {
	if f.script == nil {
		return p.workers
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return max(p.workers, f.peak)
}
