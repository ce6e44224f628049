package quota

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
)

// The fleets that the tests of many files run. Worker processes: the test
// binary re-executed (TestMain runs runWorker when workerEnv is set), which
// acquire from one bucket as a workerSpec says and report their grants.
// Workers in one process: each a Transport with a Limiter and a Redis
// client of its own, driven against a provider that records when requests
// arrive, while a test breaks the real redis-server under them. The tests
// start their redis-server processes themselves: the atomicity argument is
// only evidence on the server that ships.

func TestMain(m *testing.M) {
	// The tests kill servers on purpose; go-redis would log every failed dial.
	redis.SetLogger(quietLogger{})
	if os.Getenv(workerEnv) != "" {
		os.Exit(runWorker())
	}
	code := redistest.Main(m)
	if quotactl.dir != "" {
		os.RemoveAll(quotactl.dir)
	}
	os.Exit(code)
}

type quietLogger struct{}

func (quietLogger) Printf(context.Context, string, ...any) {}

// The worker process: the test binary re-executed with workerEnv set. It
// builds its Redis client and its way of acquiring from the workerSpec in
// its environment, pings Redis, then says so on stdout with the line
// workerReady and waits for a workerStart on stdin. Only when every worker
// is ready does the parent send them the instant to start at, so a run
// never depends on how long a loaded machine takes to start a process.
// Each worker then runs its goroutines against the bucket and prints a
// workerReport as JSON.

const (
	workerEnv   = "QUOTA_TEST_WORKER"
	workerReady = "ready"

	// workerReadyTimeout bounds how long a worker may take to start, build
	// its client and reach Redis: a race-enabled binary on two busy cores
	// takes seconds.
	workerReadyTimeout = 60 * time.Second
	// workerStartMargin is how far ahead of the moment every worker is
	// ready the parent sets the start: time for each to read its line.
	workerStartMargin = 100 * time.Millisecond
	// workerEndTimeout bounds how long after its run a worker may take to
	// report.
	workerEndTimeout = 60 * time.Second
)

// workerSpec tells a worker process what to run. New kinds of acquisition
// add fields here and a case to acquirer.
type workerSpec struct {
	Addr       string   // a single server
	Cluster    []string // or the nodes of a Cluster
	Key        string
	Limit      Limit
	Goroutines int
	Duration   time.Duration
	Naive      bool
	Layers     []Limit // more Limits the bucket obeys, taken with WaitN
	Cost       float64 // tokens a grant takes, 1 when zero
	URL        string  // when set, GET it through a Transport instead
	Headers    bool    // with WithProviderHeaders
	Fallback   int     // with FallbackLocal(Fallback) when above zero
	Faults     bool    // a client with short timeouts and no retries, for Redis faults

	Concurrency int           // with WithConcurrency(Concurrency) when above zero
	SlotLease   time.Duration // with WithSlotLease(SlotLease) when above zero

	// Linger, when above zero, is WithSlotLinger(Linger); below zero,
	// WithSlotLinger(0).
	Linger time.Duration
	// NoRegister never holds in Redis the slots in use that it does not
	// hold: those granted during an outage stay unknown to it.
	NoRegister bool
	// NoLeaseCheck sends on a slot without checking its lease first.
	NoLeaseCheck bool
	// Stagger starts worker i's run i×Stagger after the first's.
	Stagger time.Duration
	// Delay starts the first worker's run Delay after every worker is
	// ready, not at once.
	Delay time.Duration
	// At, when not zero, starts the first worker's run then, or once every
	// worker is ready if that is later: fleets started side by side begin
	// at instants of their own, after all of their processes are up.
	At time.Time
	// Deadline gives every acquisition a deadline at the end of its
	// worker's run, as a job with a time budget does: the last ones end
	// cancelled, and a failure that the deadline caused is no error.
	Deadline bool
	// Think, when above zero, is how long each goroutine rests after each
	// request, so that no call of its own follows its release at once.
	Think time.Duration
	// ReleaseDelay, when above zero, replaces slots.ReleaseDelay.
	ReleaseDelay time.Duration
	// NoFlush exits without Limiter.Flush.
	NoFlush bool
	// NoJoin: the Limiter neither learns of an outage from its reads in
	// the background nor holds the shared bucket until the fleet resumes.
	NoJoin bool

	// LLM, with URL, posts to an LLM API through a Transport
	// WithMetering of that API's profile: "anthropic" or "openai", under
	// LLMLimits (Limit is the requests').
	LLM       string
	LLMLimits llmLimits
	Stream    bool // ask for answers as event streams
	MaxTokens int  // each request's max_tokens
	NoSettle  bool // the profile without its Usage: reservations never settle
	// ReserveOutput, when above zero, is what a request reserves of the
	// output meter in place of its max_tokens: a quantile of the usage.
	ReserveOutput float64
	// OwnPrefix gives each worker a prefix of its own: per-process
	// limiters, which share nothing.
	OwnPrefix bool
	// Priority is the priority of the worker's acquisitions (WaitN, or
	// the requests to URL).
	Priority int
	// MinShare, when above zero, is WithMinShare(0, MinShare).
	MinShare float64
	// Tenant, when set, names the tenant of the worker's acquisitions
	// (ContextWithTenant); Weights, when set, are the Limiter's
	// WithTenants.
	Tenant  string
	Weights map[string]float64
	// Rest, when above zero, is how long each goroutine rests between its
	// requests, as Think, but before the next one: the time a request
	// waited counts from its ask (stamp.Asked), after the rest.
	Rest time.Duration
}

// llmLimits are the token limits of an LLM profile.
type llmLimits struct {
	Input, Output, Tokens Limit
	Window                time.Duration // Azure: the span its buckets hold, of Tokens.Rate
	Burndown              float64       // Bedrock: the output tokens' burndown
}

// workerHeader names the worker process (its pid) on each request it sends
// to a provider.
const workerHeader = "X-Quota-Worker"

// workerStart is the parent's go-ahead, sent on a worker's stdin once every
// worker is ready.
type workerStart struct {
	Start time.Time // when the worker's goroutines begin
}

// workerReport is what a worker process did: its grants, by when their
// callers woke and when the script granted them.
type workerReport struct {
	Grants   []time.Time    // when the caller of each grant woke, in order
	Stamps   []stamp        // the same grants with when the script granted them (see dueHook)
	Commands int64          // Redis commands sent during the run
	Ops      map[string]int // the scripts' calls during the run, by operation
	Err      string
}

// client returns the Redis client the spec names.
func (spec workerSpec) client() redis.UniversalClient {
	if spec.Cluster != nil {
		return redis.NewClusterClient(&redis.ClusterOptions{Addrs: spec.Cluster, PoolSize: spec.Goroutines})
	}
	o := &redis.Options{Addr: spec.Addr}
	if spec.Faults {
		o = faultOptions(spec.Addr)
	}
	o.PoolSize = spec.Goroutines
	return redis.NewClient(o)
}

// limiterOptions returns the Limiter's options.
func (spec workerSpec) limiterOptions() []Option {
	var opts []Option
	if spec.Fallback > 0 {
		opts = append(opts, WithPolicy(FallbackLocal(spec.Fallback)), WithLogger(discardLogger()))
	}
	if spec.SlotLease > 0 {
		opts = append(opts, WithSlotLease(spec.SlotLease))
	}
	if spec.MinShare > 0 {
		opts = append(opts, WithMinShare(0, spec.MinShare))
	}
	if spec.Weights != nil {
		opts = append(opts, WithTenants(Tenants{Weights: spec.Weights}))
	}
	if spec.OwnPrefix {
		opts = append(opts, WithPrefix(fmt.Sprintf("quota:%d:", os.Getpid())))
	}
	return opts
}

// transportOptions returns the Transport's options, its Limiter's among
// them.
func (spec workerSpec) transportOptions() []TransportOption {
	var opts []TransportOption
	for _, o := range spec.limiterOptions() {
		opts = append(opts, o)
	}
	if spec.Headers {
		opts = append(opts, WithProviderHeaders())
	}
	if spec.Concurrency > 0 {
		opts = append(opts, WithConcurrency(spec.Concurrency))
	}
	if len(spec.Layers) > 0 {
		opts = append(opts, WithLayers(spec.Layers...))
	}
	switch {
	case spec.Linger > 0:
		opts = append(opts, WithSlotLinger(spec.Linger))
	case spec.Linger < 0:
		opts = append(opts, WithSlotLinger(0))
	}
	if spec.LLM != "" {
		var m Metering
		switch spec.LLM {
		case "anthropic":
			m = LLMProfiles.Anthropic(spec.LLMLimits.Input, spec.LLMLimits.Output)
		case "openai":
			m = LLMProfiles.OpenAI(spec.LLMLimits.Tokens)
		case "gemini":
			m = LLMProfiles.Gemini(spec.LLMLimits.Input)
		case "azure":
			m, _ = LLMProfiles.Azure(spec.LLMLimits.Tokens.Rate*60, spec.LLMLimits.Window)
		case "bedrock":
			m = LLMProfiles.Bedrock(spec.LLMLimits.Tokens, spec.LLMLimits.Burndown)
		}
		if spec.NoSettle {
			m.Usage = nil
		}
		if spec.ReserveOutput > 0 {
			estimate := m.Estimate
			m.Estimate = func(req *http.Request, body []byte) (Usage, error) {
				u, err := estimate(req, body)
				if n, ok := u[outputTokens]; ok {
					u[outputTokens] = min(n, spec.ReserveOutput)
				}
				return u, err
			}
		}
		opts = append(opts, WithMetering(m))
	}
	return opts
}

// acquirer returns how each of the worker's goroutines acquires one grant
// through rdb (WaitN on the spec's layers by default), and the Limiter it
// uses, if any. An LLM worker's Transport sends on base.
func (spec workerSpec) acquirer(rdb redis.UniversalClient, base http.RoundTripper) (acquireFunc, *Limiter) {
	cost := spec.Cost
	if cost == 0 {
		cost = 1
	}
	switch {
	case spec.Naive:
		key, _ := bucketKey(DefaultPrefix, spec.Key)
		return func(ctx context.Context) error { return naiveWait(ctx, rdb.(*redis.Client), key, spec.Limit) }, nil
	case spec.LLM != "":
		tr := NewTransport(rdb, spec.Limit, append(spec.transportOptions(), WithBase(base))...)
		client := &http.Client{Transport: tr}
		var seq atomic.Int64
		return func(ctx context.Context) error {
			body := llmRequest(spec.LLM, int(seq.Add(1)), spec.MaxTokens, spec.Stream)
			req, err := http.NewRequestWithContext(ctx, "POST", spec.URL, bytes.NewReader(body))
			if err != nil {
				return err
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set(workerHeader, strconv.Itoa(os.Getpid()))
			resp, err := client.Do(req)
			if err != nil {
				return err
			}
			_, err = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			return err
		}, tr.Limiter()
	case spec.URL != "":
		tr := NewTransport(rdb, spec.Limit, spec.transportOptions()...)
		client := &http.Client{Transport: tr}
		return func(ctx context.Context) error {
			if spec.Priority > 0 {
				ctx = ContextWithPriority(ctx, spec.Priority)
			}
			if spec.Tenant != "" {
				ctx = ContextWithTenant(ctx, spec.Tenant)
			}
			req, err := http.NewRequestWithContext(ctx, "GET", spec.URL, nil)
			if err != nil {
				return err
			}
			req.Header.Set(workerHeader, strconv.Itoa(os.Getpid()))
			resp, err := client.Do(req)
			if err == nil {
				resp.Body.Close()
			}
			return err
		}, tr.Limiter()
	default:
		l := NewLimiter(rdb, spec.limiterOptions()...)
		return func(ctx context.Context) error {
			if spec.Priority > 0 {
				ctx = ContextWithPriority(ctx, spec.Priority)
			}
			if spec.Tenant != "" {
				ctx = ContextWithTenant(ctx, spec.Tenant)
			}
			return l.WaitN(ctx, spec.Key, cost, spec.Limit, spec.Layers...)
		}, l
	}
}

func runWorker() int {
	var spec workerSpec
	if err := json.Unmarshal([]byte(os.Getenv(workerEnv)), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "worker:", err)
		return 2
	}
	checkLeases = !spec.NoLeaseCheck
	if spec.ReleaseDelay > 0 {
		slots.ReleaseDelay = spec.ReleaseDelay
	}
	registerAtResume = !spec.NoRegister
	slots.Reregister = !spec.NoRegister
	// The client stays open until the process exits: closing it after the
	// run would fail the Limiter's bucket updates still in flight, and log
	// them.
	rdb := spec.client()
	rdb.AddHook(dueHook{})
	base := providerBase(spec.Goroutines)
	acquire, limiter := spec.acquirer(rdb, base)
	if limiter != nil && spec.NoJoin {
		turnOff(limiter, joins)
	}
	ctx, cancel := context.WithTimeout(context.Background(), workerReadyTimeout)
	err := warmUp(ctx, rdb, spec.Key, spec.Goroutines)
	if err != nil {
		cancel()
		fmt.Fprintln(os.Stderr, "worker: Redis does not answer:", err)
		return 2
	}
	if spec.LLM != "" {
		err = warmProvider(ctx, base, spec.URL, spec.Goroutines)
	}
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "worker: the provider does not answer:", err)
		return 2
	}
	cmds := newCmdCounter() // counts from here: the run's commands only
	rdb.AddHook(cmds)

	fmt.Println(workerReady)
	var start workerStart
	if err := json.NewDecoder(os.Stdin).Decode(&start); err != nil {
		fmt.Fprintln(os.Stderr, "worker: no start from the parent:", err)
		return 2
	}
	ctx = context.Background()
	if spec.Deadline {
		var cancel context.CancelFunc
		ctx, cancel = context.WithDeadline(ctx, start.Start.Add(spec.Duration))
		defer cancel()
		inner := acquire
		acquire = func(actx context.Context) error {
			// The run's deadline, a wait past it, or a Redis call it cut
			// short a moment before actx's own timer fired
			// (ErrWouldExceedDeadline matches context.DeadlineExceeded).
			err := inner(actx)
			if err != nil && (actx.Err() != nil || errors.Is(err, context.DeadlineExceeded)) {
				return errSwarmEnded
			}
			return err
		}
	}
	if spec.Rest > 0 {
		inner := acquire
		var calls atomic.Int64
		acquire = func(actx context.Context) error {
			if calls.Add(1) > int64(spec.Goroutines) {
				time.Sleep(spec.Rest) // after the goroutine's request before
			}
			dueRecordOf(actx).Asked = time.Now()
			return inner(actx)
		}
	}
	if spec.Think > 0 {
		inner := acquire
		acquire = func(actx context.Context) error {
			err := inner(actx)
			time.Sleep(spec.Think)
			return err
		}
	}
	grants, err := swarm(ctx, spec.Goroutines, start.Start, spec.Duration, acquire)
	if limiter != nil && !spec.NoFlush {
		fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		if ferr := limiter.Flush(fctx); ferr != nil && err == nil {
			err = fmt.Errorf("Flush: %w", ferr)
		}
		cancel()
	}
	rep := workerReport{Stamps: grants, Commands: int64(cmds.total()), Ops: cmds.byOp()}
	for _, g := range grants {
		rep.Grants = append(rep.Grants, g.Woke)
	}
	if err != nil {
		rep.Err = err.Error()
	}
	json.NewEncoder(os.Stdout).Encode(rep)
	return 0
}

// warmUp dials n connections on the node that holds the
// bucket called name: n goroutines block side by side for a moment on a
// list beside the bucket, in its hash slot. A swarm then starts without
// dialling, and its first takes reach Redis when they are sent, not a
// connection later.
func warmUp(ctx context.Context, rdb redis.UniversalClient, name string, n int) error {
	key, err := bucketKey(DefaultPrefix, name)
	if err != nil {
		return err
	}
	errs := make(chan error, n)
	for range n {
		go func() {
			// A dial that a loaded machine makes late tries again, until
			// ctx ends.
			for {
				err := rdb.Do(ctx, "blpop", key+":warm-up", "0.05").Err() // (BLPop rounds up to a second)
				if err == nil || errors.Is(err, redis.Nil) {
					errs <- nil
					return
				}
				if ctx.Err() != nil {
					errs <- err
					return
				}
				time.Sleep(20 * time.Millisecond)
			}
		}()
	}
	for range n {
		if e := <-errs; e != nil {
			err = e
		}
	}
	return err
}

// providerBase returns the RoundTripper an LLM worker's Transport sends
// on: http.DefaultTransport's, keeping an idle connection to the provider
// for each of the worker's n goroutines, where the default keeps 2 and
// dials again for the others' requests.
func providerBase(n int) *http.Transport {
	base := http.DefaultTransport.(*http.Transport).Clone()
	base.MaxIdleConnsPerHost = n
	return base
}

// warmProvider opens connections from base to the provider at url for n
// goroutines, with n requests side by side that the provider does not
// meter (a GET, which llmfake refuses with 405), as warmUp does for
// Redis: the swarm's first requests then reach the provider without a
// dial first, and no later than those granted after them (see
// TestLLMFleet).
func warmProvider(ctx context.Context, base http.RoundTripper, url string, n int) error {
	errs := make(chan error, n)
	for range n {
		go func() {
			req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
			if err == nil {
				var resp *http.Response
				if resp, err = base.RoundTrip(req); err == nil {
					_, err = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			}
			errs <- err
		}()
	}
	var err error
	for range n {
		if e := <-errs; e != nil {
			err = e
		}
	}
	return err
}

// runWorkers runs procs worker processes of spec and returns their reports.
// It starts them all, waits until every one is ready, then starts their
// runs at the same instant.
func runWorkers(t *testing.T, procs int, spec workerSpec) []workerReport {
	t.Helper()
	return startWorkers(t, procs, spec).wait(t)
}

// runningWorkers are worker processes started by startWorkers.
type runningWorkers struct {
	start time.Time // when their runs began
	spec  workerSpec
	ps    []workerProc
}

type workerProc struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *bufio.Reader
	ready chan error
}

// startWorkers starts procs worker processes of spec, waits until every
// one is ready, starts their runs at the same instant and returns, so that
// the test can act while they run.
func startWorkers(t *testing.T, procs int, spec workerSpec) *runningWorkers {
	t.Helper()
	env, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	ps := make([]workerProc, procs)
	for i := range ps {
		cmd := exec.Command(os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), workerEnv+"="+string(env))
		cmd.Stderr = os.Stderr
		in, err := cmd.StdinPipe()
		if err != nil {
			t.Fatal(err)
		}
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }) // a worker left behind by a failure
		ps[i] = workerProc{cmd: cmd, in: in, out: bufio.NewReader(out), ready: make(chan error, 1)}
		go func(p workerProc) {
			line, err := p.out.ReadString('\n')
			if err == nil && line != workerReady+"\n" {
				err = fmt.Errorf("said %q, want %q", line, workerReady)
			}
			p.ready <- err
		}(ps[i])
	}
	timeout := time.NewTimer(workerReadyTimeout)
	defer timeout.Stop()
	for i, p := range ps {
		select {
		case err := <-p.ready:
			if err != nil {
				t.Fatalf("worker %d is not ready: %v", i, err)
			}
		case <-timeout.C:
			t.Fatalf("worker %d is not ready after %v", i, workerReadyTimeout)
		}
	}
	at := time.Now().Add(workerStartMargin + spec.Delay)
	if spec.At.After(at) {
		at = spec.At
	} else if !spec.At.IsZero() {
		t.Logf("the workers were ready %v after the instant given them", at.Sub(spec.At).Round(time.Millisecond))
	}
	for i, p := range ps {
		start, _ := json.Marshal(workerStart{Start: at.Add(time.Duration(i) * spec.Stagger)})
		if _, err := fmt.Fprintf(p.in, "%s\n", start); err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
		p.in.Close()
	}
	return &runningWorkers{start: at, spec: spec, ps: ps}
}

// wait waits for the workers' reports.
func (w *runningWorkers) wait(t *testing.T) []workerReport {
	t.Helper()
	ps, procs := w.ps, len(w.ps)

	// A worker that does not report in time is killed, which ends its
	// output and fails the decoding below.
	kill := time.AfterFunc(time.Until(w.start)+time.Duration(procs)*w.spec.Stagger+w.spec.Duration+workerEndTimeout, func() {
		for _, p := range ps {
			_ = p.cmd.Process.Kill()
		}
	})
	defer kill.Stop()
	reports := make([]workerReport, procs)
	for i, p := range ps {
		if err := json.NewDecoder(p.out).Decode(&reports[i]); err != nil {
			t.Fatalf("worker %d: no report: %v", i, err)
		}
		if err := p.cmd.Wait(); err != nil {
			t.Fatalf("worker %d: %v", i, err)
		}
		if reports[i].Err != "" {
			t.Fatalf("worker %d: %s", i, reports[i].Err)
		}
	}
	return reports
}

// mergeStamps returns the grants of every report, in the order their
// callers woke.
func mergeStamps(reports []workerReport) []stamp {
	var all []stamp
	for _, r := range reports {
		all = append(all, r.Stamps...)
	}
	slices.SortFunc(all, func(a, b stamp) int { return a.Woke.Compare(b.Woke) })
	return all
}

// provider is an HTTP server that records arrival times.
type provider struct {
	*httptest.Server
	mu       sync.Mutex
	arrivals []time.Time
}

func newProvider(t *testing.T) *provider {
	p := &provider{}
	p.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		p.mu.Lock()
		p.arrivals = append(p.arrivals, time.Now())
		p.mu.Unlock()
	}))
	t.Cleanup(p.Close)
	return p
}

// between returns the arrivals in [from, to), sorted.
func (p *provider) between(from, to time.Time) []time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	var out []time.Time
	for _, a := range p.arrivals {
		if !a.Before(from) && a.Before(to) {
			out = append(out, a)
		}
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out
}

// faultOptions are a limiter's Redis client options for the tests that
// break Redis under a running fleet: those of the README, with timeouts
// long enough that two busy cores do not pass for an outage.
func faultOptions(addr string) *redis.Options {
	o := limiterOptions(addr)
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
	return o
}

// worker is one member of the fleet.
type worker struct {
	tr   *Transport
	logs *logRecorder
}

func newWorkers(t *testing.T, n int, addr string, lim Limit, p Policy, opts func(*redis.Options)) []worker {
	return newWorkersOn(t, n, lim, p, func() redis.Scripter {
		o := faultOptions(addr)
		if opts != nil {
			opts(o)
		}
		rdb := redis.NewClient(o)
		t.Cleanup(func() { rdb.Close() })
		return rdb
	})
}

// newWorkersOn returns n workers, each with a Redis client of its own from
// client.
func newWorkersOn(t *testing.T, n int, lim Limit, p Policy, client func() redis.Scripter) []worker {
	var ws []worker
	for range n {
		logs := &logRecorder{}
		ws = append(ws, worker{NewTransport(client(), lim, WithPolicy(p), WithLogger(slog.New(logs))), logs})
	}
	return ws
}

// result is what one request through a worker came to.
type result struct {
	start time.Time
	took  time.Duration
	err   error
}

// drive sends requests through every worker from goroutines each, until
// stop is closed, and returns what each request came to.
func drive(ws []worker, goroutines int, url string, stop <-chan struct{}) []result {
	var (
		mu  sync.Mutex
		res []result
		wg  sync.WaitGroup
	)
	for _, w := range ws {
		client := &http.Client{Transport: w.tr}
		for range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					select {
					case <-stop:
						return
					default:
					}
					start := time.Now()
					resp, err := client.Post(url, "text/plain", strings.NewReader("x"))
					if err == nil {
						resp.Body.Close()
					} else {
						time.Sleep(time.Millisecond) // a refusing worker does not spin
					}
					mu.Lock()
					res = append(res, result{start, time.Since(start), err})
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	return res
}

// logTime returns when the first record containing msg was written.
func logTime(t *testing.T, logs *logRecorder, msg string) time.Time {
	t.Helper()
	r, ok := logs.First(msg)
	if !ok {
		t.Fatalf("no record %q:\n%s", msg, logs)
	}
	return r.Time
}

func checkTransitions(t *testing.T, ws []worker, level slog.Level) {
	t.Helper()
	for i, w := range ws {
		down, up := w.logs.Count(level, "Redis unavailable"), w.logs.Count(slog.LevelInfo, "available again")
		if down != 1 || up != 1 {
			t.Errorf("worker %d: %d outage and %d recovery records, want one each:\n%s", i, down, up, w.logs)
		}
	}
}

// llmRequest returns the JSON body of the seq-th request of a worker to
// an LLM API, "anthropic", "openai", "gemini", "azure" or "bedrock" (Converse): one
// user message of 300 to 1200 bytes, max_tokens, and a stream when stream
// is set (with its usage, for OpenAI and Azure; Bedrock streams at a
// path of its own).
func llmRequest(api string, seq, maxTokens int, stream bool) []byte {
	text := strings.Repeat("quota shares one limit across a fleet. ", 40)[:300+seq*137%900]
	if api == "gemini" { // the stream is the URL's (streamGenerateContent)
		b, _ := json.Marshal(map[string]any{
			"contents":         []map[string]any{{"role": "user", "parts": []map[string]any{{"text": text}}}},
			"generationConfig": map[string]any{"maxOutputTokens": maxTokens},
		})
		return b
	}
	if api == "bedrock" { // Converse; a stream is ConverseStream's path
		b, _ := json.Marshal(map[string]any{
			"messages":        []map[string]any{{"role": "user", "content": []map[string]any{{"text": text}}}},
			"inferenceConfig": map[string]any{"maxTokens": maxTokens},
		})
		return b
	}
	req := map[string]any{
		"model":      "model-1",
		"max_tokens": maxTokens,
		"messages":   []map[string]any{{"role": "user", "content": text}},
	}
	if stream {
		req["stream"] = true
		if api == "openai" || api == "azure" {
			req["stream_options"] = map[string]any{"include_usage": true}
		}
	}
	b, _ := json.Marshal(req)
	return b
}

// LLMProfiles are package llm's Meterings, with which the tests here
// meter LLM APIs as their providers count. Package llm imports this one,
// so this package's own tests cannot import it: the external test package
// sets LLMProfiles (llm_profiles_test.go) as the test binary starts,
// before any test runs and before a worker process starts its work.
var LLMProfiles struct {
	Anthropic func(input, output Limit) Metering // llm.Anthropic
	OpenAI    func(tokens Limit) Metering        // llm.OpenAI
	Gemini    func(input Limit) Metering         // llm.Gemini
	// Azure is llm.Azure of a deployment's tokens a minute, with the
	// requests' Limit that goes with them.
	Azure   func(tokensPerMinute float64, window time.Duration) (Metering, Limit)
	Bedrock func(tokens Limit, burndown float64) Metering // llm.Bedrock, one burndown for every model
}

// outputTokens names the Anthropic profile's output meter
// (llm.MeterOutputTokens).
const outputTokens = "output_tokens"
