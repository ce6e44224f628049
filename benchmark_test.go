package quota

import (
	"context"
	"log/slog"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// The benchmarks run on one real redis-server, so that an acquisition and a
// bare EVALSHA of the same script are compared side by side in one run:
//
//	go test -run '^$' -bench . -benchmem

// unlimited never makes a caller wait, so the benchmarks time the call
// alone; at a million a second each token is a microsecond, so every call
// writes the bucket back, as in real use.
var unlimited = Limit{Rate: 1e6, Burst: 1e9}

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
	// keys and arguments as Wait's take, called directly.
	b.Run("BareEvalSha", func(b *testing.B) {
		l := NewLimiter(rdb)
		bk, err := l.bucket("bench", []Limit{unlimited})
		if err != nil {
			b.Fatal(err)
		}
		sha, err := rdb.ScriptLoad(ctx, l.store.TakeScript().Source()).Result()
		if err != nil {
			b.Fatal(err)
		}
		keys, args := l.store.TakeCall(bk.Bucket, store.Tokens(1), DefaultMaxWait)
		for b.Loop() {
			if err := rdb.EvalSha(ctx, sha, keys, args...).Err(); err != nil {
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

// BenchmarkWaitDegraded is the cost of an acquisition while Redis is
// unavailable and the breaker is open: the policy's alone, no Redis timeout.
func BenchmarkWaitDegraded(b *testing.B) {
	srv := redistest.Start(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), MaxRetries: -1, DialerRetries: 1})
	defer rdb.Close()
	srv.Kill()
	ctx := context.Background()
	for _, p := range []Policy{FallbackLocal(4), FailOpen, FailClosed} {
		b.Run(p.mode().String(), func(b *testing.B) {
			l := NewLimiter(rdb, WithPolicy(p), WithLogger(slog.New(slog.DiscardHandler)))
			_ = l.Wait(ctx, "bench", unlimited) // trips the breaker
			if l.Mode() != p.mode() {
				b.Fatalf("mode %v, want %v", l.Mode(), p.mode())
			}
			for b.Loop() {
				_ = l.Wait(ctx, "bench", unlimited)
			}
		})
	}
}

// BenchmarkRoundTrip compares, side by side, a request sent through a
// Transport without WithConcurrency, the same request after a bare
// Limiter.Wait (what the Transport costs beyond its acquisition), and a
// Transport WithConcurrency, which also takes and releases a slot. The
// base RoundTripper answers at once, so only the Limiter is timed.
func BenchmarkRoundTrip(b *testing.B) {
	rdb := redistest.Start(b).Client(b)
	ctx := context.Background()
	base := roundTripFunc(okResponse)
	req, _ := http.NewRequestWithContext(ctx, "GET", "http://api.example.com/", nil)
	b.Run("WaitThenSend", func(b *testing.B) {
		l := NewLimiter(rdb)
		for b.Loop() {
			if err := l.Wait(ctx, "api.example.com", unlimited); err != nil {
				b.Fatal(err)
			}
			resp, _ := base.RoundTrip(req)
			resp.Body.Close()
		}
	})
	b.Run("Transport", func(b *testing.B) {
		tr := NewTransport(rdb, unlimited, WithBase(base))
		for b.Loop() {
			resp, err := tr.RoundTrip(req)
			if err != nil {
				b.Fatal(err)
			}
			resp.Body.Close()
		}
	})
	b.Run("TransportWithConcurrency", func(b *testing.B) {
		tr := NewTransport(rdb, unlimited, WithBase(base), WithConcurrency(64))
		for b.Loop() {
			resp, err := tr.RoundTrip(req)
			if err != nil {
				b.Fatal(err)
			}
			resp.Body.Close()
		}
	})
}
