// Command jaeger is an example that sends the traces of rate-limited HTTP
// requests to Jaeger.
//
// It starts a small local "provider" (an HTTP server on 127.0.0.1), makes a
// handful of concurrent geocoding requests to it through a retrying client
// that takes its tokens from a quota bucket in Redis, and exports every span
// over OTLP/HTTP. From this directory, with Redis on 127.0.0.1:6379:
//
//	"$(../../scripts/jaeger.sh)" &   # Jaeger: OTLP/HTTP on :4318, query API and UI on :16686
//	go run . -redis 127.0.0.1:6379 -otlp 127.0.0.1:4318
//
// Each request is one trace of the service quota-example: a geocode span,
// under it a quota.wait span per attempt (with the Redis call that took the
// token nested inside) and, after each wait has ended, the HTTP client span
// of that attempt. The bucket holds 2 tokens and refills 5 a second, so
// later requests wait for their tokens; the provider answers its first
// request with 429 and Retry-After: 2, so one trace shows the pause that
// 429 puts on the bucket and a retry, with a token of its own, two seconds
// later.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/signal"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/go-retryablehttp"
	"github.com/redis/go-redis/extra/redisotel/v9"
	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/contrib/instrumentation/net/http/otelhttp"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/sharedquota/quota"
)

// config is what the example is pointed at.
type config struct {
	OTLP  string // host:port of an OTLP/HTTP receiver, such as Jaeger's
	Redis string // host:port of the Redis that holds the bucket
}

// The cities the example geocodes, one request (and one trace) each.
var cities = []string{"Berlin", "Paris", "Madrid", "Rome", "Vienna", "Prague", "Lisbon", "Dublin"}

func main() {
	var cfg config
	flag.StringVar(&cfg.OTLP, "otlp", "127.0.0.1:4318", "`host:port` of Jaeger's OTLP/HTTP receiver")
	flag.StringVar(&cfg.Redis, "redis", "127.0.0.1:6379", "`host:port` of Redis")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if err := run(ctx, cfg, os.Stdout); err != nil {
		log.Fatal(err)
	}
}

// run makes one geocode request per city, all at once, and prints how each
// went with its trace ID. The spans are flushed to cfg.OTLP before it
// returns.
func run(ctx context.Context, cfg config, out io.Writer) (err error) {
	// Spans go to Jaeger over OTLP/HTTP, as the service quota-example.
	exporter, err := otlptracehttp.New(ctx,
		otlptracehttp.WithEndpoint(cfg.OTLP),
		otlptracehttp.WithInsecure())
	if err != nil {
		return err
	}
	tp := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exporter),
		sdktrace.WithResource(resource.NewWithAttributes(semconv.SchemaURL, semconv.ServiceName("quota-example"))))
	defer func() {
		// Flush the spans still queued before the program exits.
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
		defer cancel()
		err = errors.Join(err, tp.Shutdown(ctx))
	}()

	// The bucket's Redis, with a span per command. The limiter runs each
	// command in the context of its quota.wait span, so the EVALSHA that
	// takes a token shows up inside the wait it belongs to.
	rdb := redis.NewClient(&redis.Options{Addr: cfg.Redis})
	defer rdb.Close()
	err = redisotel.InstrumentTracing(rdb,
		redisotel.WithTracerProvider(tp),
		// go-redis dials in the background, outside any request's context:
		// each dial would be a trace of its own.
		redisotel.WithDialFilter(true),
		// go-redis's handshake on a new connection (HELLO, CLIENT SETINFO,
		// CLIENT MAINT_NOTIFICATIONS) is not the limiter's work, and servers
		// refuse parts of it depending on their version.
		redisotel.WithCommandFilter(handshake),
		redisotel.WithCommandsFilter(func(cmds []redis.Cmder) bool { return slices.ContainsFunc(cmds, handshake) }))
	if err != nil {
		return err
	}

	provider := newProvider()
	defer provider.Close()

	// The order of the layers, outermost first:
	//
	//   retryablehttp   retries a failed attempt (429 after its Retry-After)
	//   quota           waits for a token: a quota.wait span per attempt
	//   otelhttp        an HTTP client span per attempt
	//   net/http        sends it
	//
	// quota inside retryablehttp: every attempt, retries included, takes a
	// token of its own, as the provider counts them. otelhttp inside quota:
	// the HTTP client span starts once the wait span has ended, so it
	// measures the provider and not the wait.
	//
	// The bucket is small on purpose: 2 tokens, refilled at 5 a second, so
	// that most of the requests, sent at once, wait for theirs.
	client := retryablehttp.NewClient()
	client.Logger = nil // the traces tell what happened
	client.HTTPClient.Transport = quota.NewTransport(rdb, bucket,
		quota.WithBase(otelhttp.NewTransport(http.DefaultTransport, otelhttp.WithTracerProvider(tp))),
		quota.WithTracerProvider(tp),
		// A call of its own for every take, so that each quota.wait span
		// shows its own evalsha; by default, callers that arrive while a
		// take is in flight share the next call, which nests under the
		// first caller's span only.
		quota.WithNoBatching())
	// Retry what retryablehttp retries, except quota's permanent refusals.
	client.CheckRetry = quota.CheckRetry(retryablehttp.DefaultRetryPolicy)

	tracer := tp.Tracer("github.com/sharedquota/quota/examples/jaeger")
	results := make([]string, len(cities))
	errs := make([]error, len(cities))
	var wg sync.WaitGroup
	for i, city := range cities {
		wg.Go(func() {
			results[i], errs[i] = geocode(ctx, tracer, client, provider.URL, city)
		})
	}
	wg.Wait()
	for _, r := range results {
		fmt.Fprintln(out, r)
	}
	fmt.Fprintf(out, "spans sent to %s as the service quota-example\n", cfg.OTLP)
	return errors.Join(errs...)
}

// geocode looks city up at the provider under a span of its own, the
// parent of the request's quota.wait and HTTP client spans. It returns a
// line describing the outcome, with the trace ID to look for in Jaeger.
func geocode(ctx context.Context, tracer trace.Tracer, client *retryablehttp.Client, base, city string) (string, error) {
	ctx, span := tracer.Start(ctx, "geocode", trace.WithAttributes(attribute.String("geocode.city", city)))
	defer span.End()
	start := time.Now()
	line := func(outcome string) string {
		return fmt.Sprintf("%-7s %-24s %5.2fs  trace %s", city, outcome, time.Since(start).Seconds(), span.SpanContext().TraceID())
	}

	req, err := retryablehttp.NewRequestWithContext(ctx, http.MethodGet, base+"/v1/search?q="+url.QueryEscape(city), nil)
	if err != nil {
		return line(err.Error()), err
	}
	resp, err := client.Do(req)
	if err != nil {
		span.SetStatus(codes.Error, err.Error())
		return line(err.Error()), fmt.Errorf("geocode %s: %w", city, err)
	}
	defer resp.Body.Close()
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		return line(err.Error()), err
	}
	return line(resp.Status), nil
}

// handshake reports whether cmd is one of the commands go-redis sends on a
// new connection (AUTH too, which must never be traced).
func handshake(cmd redis.Cmder) bool {
	switch cmd.Name() {
	case "auth", "hello", "client":
		return true
	}
	return false
}

// bucket is the limit the requests share: 2 tokens, refilled at 5 a
// second, small so that most of the requests, sent at once, wait.
var bucket = quota.Limit{Rate: 5, Burst: 2}

// retryAfter is the pause the provider asks for with its one 429. Two
// seconds is longer than the bucket's queue (the eighth request waits 1.2
// s) and than retryablehttp's shortest backoff (1 s), so the retry's delay
// is the pause and nothing else.
const retryAfter = 2 * time.Second

// newProvider starts the local stand-in for a geocoding API on 127.0.0.1.
// Each answer takes about 20 ms. Its own rate limiter rejects the first
// request once, with 429 and Retry-After (retryAfter), as a provider's
// limiter may briefly disagree with the client's.
func newProvider() *httptest.Server {
	var requests atomic.Int64
	return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if requests.Add(1) == 1 {
			w.Header().Set("Retry-After", strconv.Itoa(int(retryAfter.Seconds())))
			http.Error(w, "rate limit exceeded", http.StatusTooManyRequests)
			return
		}
		time.Sleep(20 * time.Millisecond)
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, "{\"query\":%q,\"lat\":0,\"lon\":0}\n", r.URL.Query().Get("q"))
	}))
}
