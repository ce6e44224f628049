package quota

import (
	"context"
	"log/slog"
	"math"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/updates"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Tests of the updates a response makes to its bucket in the background
// (updates.go): they never hold the response back, their failures feed the
// breaker, and they compute with the Limit in force.

// The updates a response makes to the bucket never hold the response
// back, and their failures are counted, logged and fed to the breaker.
func TestSlowRedisDoesNotDelayTheResponse(t *testing.T) {
	srv := redistest.Start(t)
	proxy := faultproxy.New(t, srv.Addr())
	o := limiterOptions(proxy.Addr())
	o.ReadTimeout, o.WriteTimeout = 100*time.Millisecond, 100*time.Millisecond // within an update's Timeout
	rdb := redis.NewClient(o)
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
			slow.Do(func() { proxy.SetDelay(2 * updates.Timeout) })
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
	t.Logf("a 429 came back in %v while its pause waited on a Redis %v slow", took, 2*updates.Timeout)
	if took > updates.Timeout/2 {
		t.Errorf("the 429 came back after %v: its pause held it back", took)
	}

	_ = tr.limiter.updates.Wait(context.Background())
	var rm metricdata.ResourceMetrics
	if err := reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	failed := sumOf(rm, "quota.update.failures", []attribute.KeyValue{obs.AttrUpdate.String("pause"), obs.AttrErrorType.String("unavailable")})
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

// TestUpdatesUseTheLimitInForce: a settle and the provider's remaining
// count compute with the operator's override, not with the Limit the
// callers pass.
func TestUpdatesUseTheLimitInForce(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name             string
		passed, override Limit
		opts             []TransportOption
		header           string
		want             float64 // tokens left
	}{
		// A settle of 9 for a request that took 1, under 1/s burst 10.
		{"settle", Limit{Rate: 100, Burst: 100}, Limit{Rate: 1, Burst: 10},
			[]TransportOption{WithSettle(func(*http.Response) (float64, bool) { return 9, true })}, "", 1},
		// The provider says 5 remain, under 10/s burst 100.
		{"lower", Limit{Rate: 10, Burst: 30}, Limit{Rate: 10, Burst: 100},
			[]TransportOption{WithProviderHeaders()}, "5", 5},
	} {
		t.Run(tc.name, func(t *testing.T) {
			provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if tc.header != "" {
					w.Header().Set("X-RateLimit-Remaining", tc.header)
				}
			}))
			defer provider.Close()
			name := provider.Listener.Addr().String()
			// A prefix of the case's own: its provider may listen on the
			// port the last case's closed, which names the bucket.
			opts := append([]TransportOption{WithPrefix("quota:" + tc.name + ":")}, tc.opts...)
			tr := NewTransport(srv.Client(t), tc.passed, opts...)
			if err := tr.Limiter().SetLimit(ctx, name, tc.override); err != nil {
				t.Fatal(err)
			}
			resp, err := (&http.Client{Transport: tr}).Get(provider.URL)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			_ = tr.Limiter().updates.Wait(context.Background())
			st, err := tr.Limiter().Status(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("passed %v, override %v: %.2f tokens left, want about %v", tc.passed, tc.override, st.Tokens, tc.want)
			if math.Abs(st.Tokens-tc.want) > 0.5 {
				t.Errorf("%.2f tokens left, want about %v", st.Tokens, tc.want)
			}
		})
	}
}
