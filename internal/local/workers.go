package local

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

	"github.com/sharedquota/quota/internal/breaker"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redisx"
)

//go:embed workers.lua
var workersSource string

// The roll call of FallbackLocal(n).CountingWorkers(): each Limiter in use
// announces itself every beatEvery; an announcement lasts BeatTTL; the
// divisor is the largest count seen within peakHold.
const (
	beatEvery = 2 * time.Second
	BeatTTL   = 10 * time.Second
	peakHold  = 10 * time.Minute
)

// Workers counts the Limiters that share the Redis and the prefix, for
// FallbackLocal(n).CountingWorkers(). The zero Workers counts nothing and
// divides by the floor.
type Workers struct {
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

// Count starts the roll call on rdb, under prefix, on the clock now (nil:
// the server's).
func (f *Workers) Count(rdb redis.Scripter, prefix string, now func() time.Time) {
	f.script = redisx.NewScript(rdb, workersSource)
	f.key = prefix + workersKey
	f.clock = now
	host, _ := os.Hostname()
	var b [6]byte
	_, _ = rand.Read(b[:])
	f.id = fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b[:]))
}

// Heartbeat announces the Limiter when an announcement is due, in the
// background; the caller that finds it due does not wait for it.
func (f *Workers) Heartbeat() {
	if f.script == nil || time.Now().UnixNano() < f.next.Load() || !f.beating.CompareAndSwap(false, true) {
		return
	}
	f.next.Store(time.Now().Add(beatEvery).UnixNano())
	go func() {
		defer f.beating.Store(false)
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		cmd, _ := f.script.Run(ctx, []string{f.key}, f.id, BeatTTL.Milliseconds(), redisx.Now(f.clock))
		if n, err := cmd.Int64(); err == nil {
			f.Saw(int(n))
		}
	}()
}

// Saw records a count of live workers.
func (f *Workers) Saw(n int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if n >= f.peak || time.Since(f.peakAt) > peakHold {
		f.peak, f.peakAt = n, time.Now()
	}
}

// Divisor is the number of workers the local fallback divides by: floor,
// or more when the roll call saw more.
func (f *Workers) Divisor(floor int) int {
	if f.script == nil {
		return floor
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	return max(floor, f.peak)
}

// workersKey, after the prefix, is the roll call's key. Bucket keys are
// the prefix and a brace, so it is none of them.
const workersKey = "workers"

// Alive returns how many Limiters that share rdb and prefix were alive at
// now (µs, on the server's clock) by the roll call; 0 when no Limiter
// counts workers, or rdb cannot count them.
func Alive(ctx context.Context, rdb redis.Scripter, prefix string, now int64) (int, error) {
	z, ok := rdb.(interface {
		ZCount(ctx context.Context, key, min, max string) *redis.IntCmd
	})
	if !ok {
		return 0, nil
	}
	n, err := z.ZCount(ctx, prefix+workersKey, strconv.FormatInt(now/1000, 10), "+inf").Result()
	return int(n), err
}

// callTimeout bounds the package's calls to Redis, which run in the
// background.
const callTimeout = 2 * time.Second

//go:embed resume.lua
var resumeSource string

// A Resume agrees with the fleet on the instant every Limiter leaves its
// local shares after an outage: the first to find Redis again records it,
// and the others read it (resume.lua).
type Resume struct {
	script *redisx.Script
	key    string
}

// NewResume returns the Resume of the Limiters that share rdb and prefix.
func NewResume(rdb redis.Scripter, prefix string) *Resume {
	// Bucket keys are the prefix and a brace, so this key is none of them.
	return &Resume{script: redisx.NewScript(rdb, resumeSource), key: prefix + "resume"}
}

// resumeLinger is how long after the fleet resumed a Limiter that finds
// Redis still resumes at once: a probe that a hung connection holds may
// take ProbeTimeout, and the next comes MaxBackoff later. One that found
// no instant would record its own, and send the fleet, resumed, back to
// its local shares until then.
const resumeLinger = breaker.ProbeTimeout + breaker.MaxBackoff

// In returns how long until the fleet resumes the shared bucket: delay
// after the first Limiter found Redis again, at most delay, and that
// instant on the clock of the scripts, µs; zero once the instant is past,
// for a while after it (resumeLinger). now is the caller's clock in µs,
// or empty for the server's.
func (r *Resume) In(ctx context.Context, delay time.Duration, now string) (time.Duration, int64, error) {
	cmd, _ := r.script.Run(ctx, []string{r.key}, delay.Microseconds(), now, resumeLinger.Microseconds())
	v, err := cmd.Int64Slice()
	if err != nil {
		return 0, 0, err
	}
	if len(v) != 2 {
		return 0, 0, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	return min(max(time.Duration(v[0])*time.Microsecond, 0), delay), v[1], nil
}
