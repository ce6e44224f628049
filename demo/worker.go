package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/demo/internal/provider"
	"golang.org/x/time/rate"
)

// runWorker is the main function of a worker process: it reads its spec
// from the environment, sends requests from several goroutines between the
// spec's start and end, and writes a workerReport to stdout. The quota
// package's logs go to stderr, where the demo relays them.
func runWorker() error {
	var spec workerSpec
	if err := json.Unmarshal([]byte(os.Getenv(workerEnv)), &spec); err != nil {
		return fmt.Errorf("worker: bad %s: %w", workerEnv, err)
	}
	redis.SetLogger(quiet{}) // the quota package reports an outage once; go-redis would on every failed dial
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{
		ReplaceAttr: func(groups []string, a slog.Attr) slog.Attr {
			if a.Key == slog.TimeKey && len(groups) == 0 {
				return slog.Attr{} // the demo stamps relayed lines itself
			}
			return a
		},
	}))

	rec := &recorder{}
	conns := &http.Transport{MaxIdleConnsPerHost: spec.Goroutines}
	base := &stamp{next: conns}
	var rt http.RoundTripper
	var limiter *quota.Limiter
	switch spec.Mode {
	case modeLocal:
		rt = &localLimit{lim: rate.NewLimiter(rate.Limit(spec.Rate), spec.Burst), next: base}
	case modeShared, modeFallback:
		opts := []quota.TransportOption{quota.WithBase(base), quota.WithLogger(logger), quota.WithPrefix(spec.Prefix)}
		if spec.Mode == modeFallback {
			opts = append(opts, quota.WithPolicy(quota.FallbackLocal(spec.Workers)))
		}
		rdb := redis.NewClient(quota.RedisOptions(spec.Redis))
		defer rdb.Close()
		tr := quota.NewTransport(rdb, quota.Limit{Rate: spec.Rate, Burst: float64(spec.Burst)}, opts...)
		rt, limiter = tr, tr.Limiter()
	default:
		return fmt.Errorf("worker: unknown mode %q", spec.Mode)
	}
	client := &http.Client{Transport: &measure{next: rt, rec: rec}}

	warmUp(conns, spec)
	// The phase ends by cancellation, not by a deadline: with a deadline
	// the limiters would refuse at once every wait that cannot end before
	// it, and the workers would spin on refusals in the phase's last
	// seconds.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stop := time.AfterFunc(time.Until(spec.End), cancel)
	defer stop.Stop()
	time.Sleep(time.Until(spec.Start))
	var wg sync.WaitGroup
	for range spec.Goroutines {
		wg.Go(func() { send(ctx, client, spec, rec) })
	}
	wg.Wait()
	if limiter != nil {
		// What the Limiter still has to tell Redis goes before the exit.
		fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_ = limiter.Flush(fctx)
		cancel()
	}

	report := rec.report(spec.ID)
	report.Mode = "local limiter"
	if limiter != nil {
		report.Mode = limiter.Mode().String()
	}
	return json.NewEncoder(os.Stdout).Encode(report)
}

// warmUp opens one connection to the provider per goroutine before the
// phase starts, as a worker that has been running for a while has them, so
// that the first requests of the phase do not also pay for connecting. The
// provider neither counts nor limits these requests.
func warmUp(conns *http.Transport, spec workerSpec) {
	ctx, cancel := context.WithDeadline(context.Background(), spec.Start)
	defer cancel()
	var wg sync.WaitGroup
	for range spec.Goroutines {
		wg.Go(func() {
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, spec.URL+"?"+provider.WarmUp, nil)
			if err != nil {
				return
			}
			if resp, err := conns.RoundTrip(req); err == nil { // no limiter: warming up takes no token
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		})
	}
	wg.Wait()
}

// quiet discards go-redis's own log lines.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// send sends requests one after the other until ctx ends.
func send(ctx context.Context, client *http.Client, spec workerSpec, rec *recorder) {
	for ctx.Err() == nil {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, spec.URL, nil)
		if err != nil {
			rec.fail()
			return
		}
		req.Header.Set(provider.WorkerHeader, strconv.Itoa(spec.ID))
		resp, err := client.Do(req)
		if err != nil {
			if ctx.Err() == nil {
				rec.fail()
				time.Sleep(10 * time.Millisecond) // a refusing limiter does not make a worker spin
			}
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body) // 200 or 429: the provider counts them
		resp.Body.Close()
	}
}

// localLimit is the limiter each process has on its own: a
// golang.org/x/time/rate limiter in front of the base RoundTripper.
type localLimit struct {
	lim  *rate.Limiter
	next http.RoundTripper
}

// RoundTrip waits for the local limiter, then sends req.
func (l *localLimit) RoundTrip(req *http.Request) (*http.Response, error) {
	if err := l.lim.Wait(req.Context()); err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	return l.next.RoundTrip(req)
}

// timing is the start of a request and the moment its limiter let it go.
type timing struct {
	start, sent time.Time
}

type timingKey struct{}

// measure times how long each request waits for its limiter: it starts the
// clock and hands the request on with a timing in its context, which stamp
// completes once the limiter has let the request through.
type measure struct {
	next http.RoundTripper
	rec  *recorder
}

// RoundTrip sends req through the limiter and records its wait.
func (m *measure) RoundTrip(req *http.Request) (*http.Response, error) {
	t := &timing{start: time.Now()}
	resp, err := m.next.RoundTrip(req.WithContext(context.WithValue(req.Context(), timingKey{}, t)))
	if !t.sent.IsZero() {
		m.rec.waited(t.sent.Sub(t.start))
	}
	return resp, err
}

// stamp notes when a request reaches the base RoundTripper, after the
// limiter.
type stamp struct {
	next http.RoundTripper
}

// RoundTrip stamps req's timing and sends it.
func (s *stamp) RoundTrip(req *http.Request) (*http.Response, error) {
	if t, ok := req.Context().Value(timingKey{}).(*timing); ok {
		t.sent = time.Now()
	}
	return s.next.RoundTrip(req)
}

// recorder collects a worker's waits and failures across its goroutines.
type recorder struct {
	mu  sync.Mutex
	rep workerReport
}

func (r *recorder) waited(d time.Duration) {
	r.mu.Lock()
	r.rep.WaitsMS = append(r.rep.WaitsMS, float64(d.Microseconds())/1000)
	r.mu.Unlock()
}

func (r *recorder) fail() {
	r.mu.Lock()
	r.rep.Failed++
	r.mu.Unlock()
}

func (r *recorder) report(id int) workerReport {
	r.mu.Lock()
	defer r.mu.Unlock()
	rep := r.rep
	rep.ID = id
	if rep.WaitsMS == nil {
		rep.WaitsMS = []float64{}
	}
	return rep
}
