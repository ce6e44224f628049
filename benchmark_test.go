package quota

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// The benchmarks run on one real redis-server, so that an acquisition and a
// bare EVALSHA of the same script are compared side by side in one run:
//
//	go test -run '^$' -bench . -benchmem

// unlimited never makes a caller wait, so the benchmarks time the call alone.
var unlimited = Limit{Rate: 1e9, Burst: 1e9}

func BenchmarkAcquire(b *testing.B) {
	rdb := redistest.Start(b).Client(b)
	ctx := context.Background()

	// Wait is one uncontended acquisition through the Limiter.
	b.Run("Wait", func(b *testing.B) {
		l := NewLimiter(rdb)
		if err := l.Wait(ctx, "bench", unlimited); err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if err := l.Wait(ctx, "bench", unlimited); err != nil {
				b.Fatal(err)
			}
		}
	})

	// BareEvalSha is the floor for Wait: the same script with the same
	// arguments, called directly.
	b.Run("BareEvalSha", func(b *testing.B) {
		if err := rdb.ScriptLoad(ctx, bucketSource).Err(); err != nil {
			b.Fatal(err)
		}
		keys := []string{"quota:{bench}"}
		args := []any{"take", "1e+09", "1e+09", "1", DefaultMaxWait.Microseconds(), ""}
		for b.Loop() {
			if err := rdb.EvalSha(ctx, newScript(rdb, bucketSource).sha, keys, args...).Err(); err != nil {
				b.Fatal(err)
			}
		}
	})

	// WaitParallel64 reports acquisitions per second with 64 goroutines
	// sharing one Limiter and one bucket.
	b.Run("WaitParallel64", func(b *testing.B) {
		l := NewLimiter(rdb)
		b.SetParallelism(max(1, 64/runtime.GOMAXPROCS(0)))
		start := time.Now()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := l.Wait(ctx, "bench-parallel", unlimited); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "acq/s")
	})
}
