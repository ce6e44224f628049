package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// A quiet outage does not outlive Redis: once the probe has stopped for
// want of requests, the Limiter no longer reports the outage, and the next
// request asks Redis itself.
func TestQuietOutageEndsWithRedis(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	logs := &logRecorder{}
	rdb := redis.NewClient(limiterOptions(srv.Addr()))
	defer rdb.Close()
	setProbeIdle(t, 300*time.Millisecond)
	l := NewLimiter(rdb, WithLogger(slog.New(logs))) // FailClosed
	ctx := context.Background()
	lim := PerSecond(10)
	if err := l.Wait(ctx, "quiet", lim); err != nil {
		t.Fatal(err)
	}

	srv.Kill()
	if err := l.Wait(ctx, "quiet", lim); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Wait with Redis killed = %v, want ErrUnavailable", err)
	}
	if l.Mode() != ModeClosed {
		t.Fatalf("mode %v with Redis killed, want closed", l.Mode())
	}
	// Nobody asks for a while: the probe stops, and the Limiter stops
	// claiming an outage it no longer checks.
	waitForMode(t, l, ModeShared, 10*time.Second)
	// The record of the change follows the change: on a busy machine, a
	// moment later.
	stopped := func() int { return logs.Count(slog.LevelWarn, "the next one asks Redis") }
	eventually(t, 2*time.Second, "the record of the probe stopping", func() bool { return stopped() > 0 })
	if n := stopped(); n != 1 {
		t.Errorf("%d records of the probe stopping, want 1:\n%s", n, logs)
	}

	srv.Restart()
	time.Sleep(100 * time.Millisecond)
	if err := l.Wait(ctx, "quiet", lim); err != nil {
		t.Fatalf("Wait after Redis came back during the quiet = %v, want a grant", err)
	}

	// And a request after a quiet outage that is still on finds it.
	srv.Kill()
	if err := l.Wait(ctx, "quiet", lim); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Wait with Redis killed again = %v, want ErrUnavailable", err)
	}
	waitForMode(t, l, ModeShared, 10*time.Second)
	if err := l.Wait(ctx, "quiet", lim); !errors.Is(err, ErrUnavailable) || l.Mode() != ModeClosed {
		t.Fatalf("the first request after a quiet outage that goes on: %v in mode %v, want ErrUnavailable in closed", err, l.Mode())
	}
}

// A plain client pointed at one node of a Cluster is a mistake to report,
// not an outage for the policy to hide.
func TestClusterNodeWithPlainClient(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 0)
	node := cl.Nodes()[0]
	logs := &logRecorder{}
	rdb := node.Client(t)
	l := NewLimiter(rdb, WithPolicy(FailOpen), WithLogger(slog.New(logs)))
	ctx := context.Background()

	// A bucket whose slot another node serves.
	name := ""
	for i := 0; name == ""; i++ {
		n := fmt.Sprintf("bucket-%d", i)
		key, _ := bucketKey(l.cfg.prefix, n)
		if cl.MasterFor(key) != node {
			name = n
		}
	}
	err := l.Wait(ctx, name, PerSecond(10))
	if !errors.Is(err, ErrScript) || !strings.Contains(err.Error(), "ClusterClient") {
		t.Fatalf("Wait through a plain client on a Cluster node = %v, want ErrScript naming the ClusterClient", err)
	}
	if errors.Is(err, ErrUnavailable) || Permanent(err) != true {
		t.Errorf("%v: an outage, or not permanent", err)
	}
	if l.Mode() != ModeShared || logs.Count(slog.LevelError, "unavailable") != 0 {
		t.Errorf("mode %v, logs:\n%s\nwant shared and no outage", l.Mode(), logs)
	}

	// A ClusterClient follows the same reply itself.
	lc := NewLimiter(cl.Client(t), WithPolicy(FailOpen))
	if err := lc.Wait(ctx, name, PerSecond(10)); err != nil {
		t.Fatalf("Wait through a ClusterClient: %v", err)
	}
}

// The updates a response makes to the bucket never hold the response
// back, and their failures are counted, logged and fed to the breaker.
func TestSlowRedisDoesNotDelayTheResponse(t *testing.T) {
	srv := redistest.Start(t)
	proxy := faultproxy.New(t, srv.Addr())
	rdb := redis.NewClient(limiterOptions(proxy.Addr()))
	defer rdb.Close()
	reader := sdkmetric.NewManualReader()
	logs := &logRecorder{}
	tr := NewTransport(rdb, PerSecond(100), WithPolicy(FailOpen), WithLogger(slog.New(logs)),
		WithMeterProvider(sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))))

	var slow sync.Once
	prov := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/429" {
			// Redis turns slow while the provider answers: the pause that
			// follows takes longer than an update may.
			slow.Do(func() { proxy.SetDelay(2 * updateTimeout) })
			w.Header().Set("Retry-After", "1")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	}))
	defer prov.Close()
	client := &http.Client{Transport: tr}
	resp, err := client.Get(prov.URL + "/ok")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()

	start := time.Now()
	resp, err = client.Get(prov.URL + "/429")
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	t.Logf("a 429 came back in %v while its pause waited on a Redis %v slow", took, 2*updateTimeout)
	if took > updateTimeout/2 {
		t.Errorf("the 429 came back after %v: its pause held it back", took)
	}

	_ = tr.limiter.updates.running.Wait(context.Background())
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	failed := sumOf(rm, "quota.update.failures", []attribute.KeyValue{attrUpdate.String("pause"), attrErrorType.String("unavailable")})
	if failed != 1 {
		t.Errorf("quota.update.failures{pause, unavailable} = %d, want 1", failed)
	}
	if n := logs.Count(slog.LevelWarn, "a bucket update failed"); n != 1 {
		t.Errorf("%d records of the failed update, want 1:\n%s", n, logs)
	}
	if n := logs.Count(slog.LevelError, "Redis unavailable"); n != 1 {
		t.Errorf("the failed update did not trip the breaker:\n%s", logs)
	}
}

// Every structure a Limiter keeps per bucket name is bounded: a flood of
// distinct names leaves the heap where a thousand left it, under every
// policy, with Redis answering and with Redis down.
func TestFloodOfNamesKeepsTheHeap(t *testing.T) {
	redistest.Long(t)
	for _, tc := range []struct {
		policy Policy
		down   bool
	}{
		{FailClosed, false}, {FallbackLocal(4), false}, {FallbackLocal(4).CountingWorkers(), false},
		{FailOpen, true}, {FailClosed, true}, {FallbackLocal(4), true},
	} {
		name := fmt.Sprintf("%v, Redis down %v", tc.policy, tc.down)
		t.Run(name, func(t *testing.T) {
			l := NewLimiter(fakeRedis(t, tc.down), WithPolicy(tc.policy), WithLogger(discardLogger()))
			lim := Limit{Rate: 1e6, Burst: 10}
			flood := func(from, to int) {
				var wg sync.WaitGroup
				for g := range 16 {
					wg.Go(func() {
						for i := from + g; i < to; i += 16 {
							err := l.Wait(context.Background(), fmt.Sprintf("host-%07d.example.com", i), lim)
							if err != nil && !errors.Is(err, ErrUnavailable) {
								t.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
			}
			flood(0, 1000)
			before := heap()
			flood(1000, 25_000)
			after := heap()
			locals, queues := l.locals.Len()
			t.Logf("%d queues and %d local limiters remembered", queues, locals)
			grew := (float64(after) - float64(before)) / (1 << 20)
			t.Logf("heap %.1f MB after 1,000 names, %.1f MB after 25,000", float64(before)/(1<<20), float64(after)/(1<<20))
			// 3 MB is 130 bytes a name, if each name kept some.
			if grew > 3 {
				t.Errorf("25,000 names grew the heap by %.1f MB, want at most 3", grew)
			}
		})
	}
}

func heap() uint64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapAlloc
}

// fakeRedis returns a client that never reaches a server: every script
// call is granted after a microsecond's wait, or fails as a refused
// connection when down. It serves tests of what the process keeps, never
// of the script.
func fakeRedis(t *testing.T, down bool) *redis.Client {
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", MaxRetries: -1})
	t.Cleanup(func() { rdb.Close() })
	rdb.AddHook(fakeScripts{down: down})
	return rdb
}

type fakeScripts struct{ down bool }

func (fakeScripts) DialHook(next redis.DialHook) redis.DialHook { return next }

func (f fakeScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c, ok := cmd.(*redis.Cmd)
		if !ok {
			return next(ctx, cmd)
		}
		if f.down {
			err := errors.New("dial tcp 127.0.0.1:1: connect: connection refused")
			c.SetErr(err)
			return err
		}
		// A take granted after a microsecond's wait (at position 0: no
		// timeline to follow), or a record that holds nothing.
		c.SetVal([]any{int64(1), int64(1), int64(1), int64(0), int64(0), int64(0)})
		if args := c.Args(); len(args) > 3 {
			if numkeys, err := strconv.Atoi(fmt.Sprint(args[2])); err == nil && len(args) > 3+numkeys && fmt.Sprint(args[3+numkeys]) == "read" {
				c.SetVal(make([]any, 12))
				for i := range 12 {
					c.Val().([]any)[i] = ""
				}
			}
		}
		return nil
	}
}

func (fakeScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
