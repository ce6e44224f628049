package quota

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/logtest"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
)

// Helpers shared by the tests of several files: Redis servers and clients,
// counting the commands a client sends, waiting for a condition or a mode,
// providers, telemetry and logs. The helpers that time grants and requests
// are in helpers_timing_test.go; those that run fleets, in fleet_test.go.

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
	mu     sync.Mutex
	n      map[string]int
	ops    map[string]int // the scripts' calls by operation (their ARGV[1])
	landed map[string]int // those of ops that Redis has answered
}

func newCmdCounter() *cmdCounter {
	return &cmdCounter{n: map[string]int{}, ops: map[string]int{}, landed: map[string]int{}}
}

func (c *cmdCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *cmdCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.count(cmd)
		err := next(ctx, cmd)
		c.answered(cmd)
		return err
	}
}

func (c *cmdCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			c.count(cmd)
		}
		err := next(ctx, cmds)
		for _, cmd := range cmds {
			c.answered(cmd)
		}
		return err
	}
}

// answered counts cmd, a script's call, in landed once Redis answered it.
func (c *cmdCounter) answered(cmd redis.Cmder) {
	if op := scriptOp(cmd); op != "" && cmd.Err() == nil {
		c.mu.Lock()
		c.landed[op]++
		c.mu.Unlock()
	}
}

func (c *cmdCounter) count(cmd redis.Cmder) {
	name := cmd.Name()
	switch name {
	case "hello", "client", "auth", "select", "readonly":
		return // setting up a connection
	}
	args := cmd.Args()
	if name == "script" && len(args) > 1 {
		name += " " + strings.ToLower(fmt.Sprint(args[1]))
	}
	if (name == "evalsha" || name == "eval") && len(args) > 3 && isRecordOp(args) {
		// A read of the control record (see controlReads), or its EVAL
		// fallback after NOSCRIPT.
		name = strings.TrimSuffix("control "+name, " evalsha")
	}
	op := scriptOp(cmd)
	c.mu.Lock()
	c.n[name]++
	if op != "" {
		c.ops[op]++
	}
	c.mu.Unlock()
}

// landedOp returns how many of the scripts' calls of operation op Redis
// has answered.
func (c *cmdCounter) landedOp(op string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.landed[op]
}

// byOp returns the scripts' calls by operation.
func (c *cmdCounter) byOp() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.ops)
}

// isRecordOp tells whether the arguments of an EVALSHA or EVAL are a
// record operation (internal/store's record.lua): a read of the control record,
// or an operator's change to it.
func isRecordOp(args []any) bool {
	numkeys, err := strconv.Atoi(fmt.Sprint(args[2]))
	if err != nil || len(args) <= 3+numkeys || !strings.HasSuffix(fmt.Sprint(args[2+numkeys]), control.Suffix) {
		return false
	}
	switch fmt.Sprint(args[3+numkeys]) {
	case "read", "limit", "clear", "hold", "resume":
		return true
	}
	return false
}

// get returns how many commands named name were sent.
func (c *cmdCounter) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

// total returns how many commands were sent, the control records' reads
// aside: a Limiter reads a bucket's record when it first uses it and once
// a second after, never per decision, and TestControlReadsAreBounded
// counts them.
func (c *cmdCounter) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for name, v := range c.n {
		if name != "control" && name != "control eval" {
			n += v
		}
	}
	return n
}

func (c *cmdCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.n)
	clear(c.ops)
	clear(c.landed)
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

// stoppedClock is a clock for WithClock that moves only when told to, so
// that a bucket accrues nothing while the machine is slow.
type stoppedClock struct {
	mu  sync.Mutex
	now time.Time
}

func newStoppedClock() *stoppedClock { return &stoppedClock{now: time.Now()} }

func (c *stoppedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stoppedClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// aclLimiter is the ACL rule of a Redis user that may run the package's
// scripts on its keys and nothing else. The README shows it.
const aclLimiter = "on >limiter-secret resetkeys ~quota:* resetchannels &quota:* -@all " +
	"+evalsha +eval +get +set +del +time +zadd +zremrangebyscore +pexpire +zcard +hello " +
	"+publish +subscribe +ping +zscore +zrem +zrange +rpush +lpop +lrem " +
	"+hget +hmget +hset +hdel +hgetall +hlen +persist +pttl +zcount +hincrby +hkeys +lrange +linsert"

func splitRule(rule string) []any {
	var out []any
	for _, f := range strings.Fields(rule) {
		out = append(out, f)
	}
	return out
}

// limiterServer starts a redis-server and returns it with a client that
// has a limiter's options (short timeouts, no retries).
func limiterServer(t *testing.T) (*redistest.Server, *redis.Client) {
	t.Helper()
	srv := redistest.Start(t)
	return srv, srv.Client(t, func(o *redis.Options) { *o = *limiterOptions(srv.Addr()) })
}

// countingServer is a provider that counts the requests that reach it.
func countingServer(t *testing.T) (*httptest.Server, *atomic.Int64) {
	var n atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(http.ResponseWriter, *http.Request) { n.Add(1) }))
	t.Cleanup(srv.Close)
	return srv, &n
}

// scriptOp returns the operation of a call of one of the package's
// scripts ("take", "read", ...), or "" for any other command.
func scriptOp(cmd redis.Cmder) string {
	if n := cmd.Name(); n != "evalsha" && n != "eval" {
		return ""
	}
	args := cmd.Args()
	if len(args) < 3 {
		return ""
	}
	keys, _ := strconv.Atoi(fmt.Sprint(args[2]))
	if len(args) <= 3+keys {
		return ""
	}
	return fmt.Sprint(args[3+keys])
}

// quotaBinary returns the path of the command cmd/quotactl, built on the
// first call: the tests that run it side by side link it once.
func quotaBinary(t *testing.T) string {
	t.Helper()
	quotactl.once.Do(func() {
		if quotactl.dir, quotactl.err = os.MkdirTemp("", "quotactl"); quotactl.err != nil {
			return
		}
		bin := filepath.Join(quotactl.dir, "quotactl")
		out, err := exec.Command("go", "build", "-o", bin, "./cmd/quotactl").CombinedOutput()
		if quotactl.bin, quotactl.err = bin, err; err != nil {
			quotactl.err = fmt.Errorf("go build ./cmd/quotactl: %v\n%s", err, out)
		}
	})
	if quotactl.err != nil {
		t.Fatal(quotactl.err)
	}
	return quotactl.bin
}

// quotactl is the binary quotaBinary builds once for the tests that run
// it side by side, in a directory TestMain removes.
var quotactl struct {
	once     sync.Once
	dir, bin string
	err      error
}

// quotaCmd runs the quotactl binary with REDIS_URL set to redisURL and
// returns when it exited and what it printed; it fails the test unless it
// exits 0.
func quotaCmd(t *testing.T, bin, redisURL string, args ...string) (time.Time, string) {
	t.Helper()
	code, out, errOut := quotaExec(t, bin, redisURL, args...)
	done := time.Now()
	if code != 0 {
		t.Fatalf("quotactl %s: exit %d: %s", strings.Join(args, " "), code, errOut)
	}
	return done, out
}

// quotaExec runs the quotactl binary with REDIS_URL set to redisURL and
// returns its exit status and what it printed on stdout and stderr.
func quotaExec(t *testing.T, bin, redisURL string, args ...string) (int, string, string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "REDIS_URL="+redisURL)
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("quotactl %s: %v", strings.Join(args, " "), err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// fastLimit never makes anyone wait for a token: the tests of slots
// measure the slots alone.
var fastLimit = Limit{Rate: 1e6, Burst: 1e6}

// inFlight is a provider that counts the requests in flight and remembers
// the most at once.
type inFlight struct {
	now, peak, total atomic.Int64
	latency          time.Duration
	hold             chan struct{} // when set, requests last until it is closed
	body             string

	mu       sync.Mutex
	arrivals []time.Time
}

func (p *inFlight) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	n := p.now.Add(1)
	p.total.Add(1)
	p.mu.Lock()
	p.arrivals = append(p.arrivals, time.Now())
	p.mu.Unlock()
	for {
		peak := p.peak.Load()
		if n <= peak || p.peak.CompareAndSwap(peak, n) {
			break
		}
	}
	if p.hold != nil {
		select {
		case <-p.hold:
		case <-r.Context().Done():
		}
	} else {
		time.Sleep(p.latency)
	}
	p.now.Add(-1)
	io.WriteString(w, p.body)
}

// slotsHeld returns how many slots of the bucket called name Redis counts
// as held, and how many callers wait.
func slotsHeld(t *testing.T, rdb redis.UniversalClient, name string) (held, waiting int64) {
	t.Helper()
	key, _ := bucketKey(DefaultPrefix, name)
	ctx := context.Background()
	now := fmt.Sprint(time.Now().UnixMicro())
	held, err := rdb.ZCount(ctx, key+slots.HeldSuffix, now, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	waiting, err = rdb.ZCount(ctx, key+slots.WaitingSuffix, now, "+inf").Result()
	if err != nil {
		t.Fatal(err)
	}
	return held, waiting
}

// arrivedIn counts the requests that arrived in [from, to).
func (p *inFlight) arrivedIn(from, to time.Time) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, a := range p.arrivals {
		if !a.Before(from) && a.Before(to) {
			n++
		}
	}
	return n
}

// collect reads the metrics.
func (tel *telemetry) collect(t *testing.T) metricdata.ResourceMetrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	if err := tel.reader.Collect(context.Background(), &rm); err != nil {
		t.Fatal(err)
	}
	return rm
}

var dryRunAttr = obs.AttrDryRun.Bool(true)

// llmMeters are three limits of one provider, as an LLM API meters them,
// slow enough that any shortfall is a wait of seconds.
var llmMeters = []Meter{
	{Name: "requests", Limit: Limit{Rate: 10, Burst: 10}},
	{Name: "input_tokens", Limit: Limit{Rate: 100, Burst: 1000}},
	{Name: "output_tokens", Limit: Limit{Rate: 50, Burst: 500}},
}

// telemetry is an SDK tracer and meter provider whose output a test reads.
type telemetry struct {
	spans  *tracetest.SpanRecorder
	tp     *sdktrace.TracerProvider
	reader *sdkmetric.ManualReader
	mp     *sdkmetric.MeterProvider
}

func newTelemetry(t *testing.T) *telemetry {
	spans := tracetest.NewSpanRecorder()
	reader := sdkmetric.NewManualReader()
	tel := &telemetry{
		spans:  spans,
		tp:     sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(spans)),
		reader: reader,
		mp:     sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader)),
	}
	t.Cleanup(func() {
		tel.tp.Shutdown(context.Background())
		tel.mp.Shutdown(context.Background())
	})
	return tel
}

func (tel *telemetry) options() []Option {
	return []Option{WithTracerProvider(tel.tp), WithMeterProvider(tel.mp)}
}

// transportOptions is options for a Transport, followed by more.
func (tel *telemetry) transportOptions(more ...TransportOption) []TransportOption {
	return append([]TransportOption{WithTracerProvider(tel.tp), WithMeterProvider(tel.mp)}, more...)
}

// waitSpans returns the ended quota.wait spans.
func (tel *telemetry) waitSpans() []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, s := range tel.spans.Ended() {
		if s.Name() == "quota.wait" {
			out = append(out, s)
		}
	}
	return out
}

func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// waitSpanIDOrZero returns the ID of the last ended wait span, if any.
func (tel *telemetry) waitSpanIDOrZero() trace.SpanID {
	spans := tel.waitSpans()
	if len(spans) == 0 {
		return trace.SpanID{}
	}
	return spans[len(spans)-1].SpanContext().SpanID()
}

func find(rm metricdata.ResourceMetrics, name string) *metricdata.Metrics {
	for _, sm := range rm.ScopeMetrics {
		if sm.Scope.Name != ScopeName {
			continue
		}
		for i := range sm.Metrics {
			if sm.Metrics[i].Name == name {
				return &sm.Metrics[i]
			}
		}
	}
	return nil
}

// sumOf adds up the data points of the counter name whose attributes
// include want.
func sumOf(rm metricdata.ResourceMetrics, name string, want []attribute.KeyValue) int64 {
	m := find(rm, name)
	if m == nil {
		return 0
	}
	var total int64
	for _, dp := range m.Data.(metricdata.Sum[int64]).DataPoints {
		ok := true
		for _, kv := range want {
			if v, found := dp.Attributes.Value(kv.Key); !found || v != kv.Value {
				ok = false
			}
		}
		if ok {
			total += dp.Value
		}
	}
	return total
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// logRecorder keeps the records logged.
type logRecorder = logtest.Recorder

// limiterOptions are the go-redis options of a limiter's client in the
// tests: no retries, so that an outage is detected at its first failed
// call. Their timeouts are a second, not RedisOptions' 100 ms: a test
// process beside the suite's floods of goroutines stalls for a few
// hundred milliseconds at times, and 200 callers dialling at once timed
// out at 100 ms. The tests of timeouts set their own.
func limiterOptions(addr string) *redis.Options {
	return &redis.Options{
		Addr:                  addr,
		DialTimeout:           time.Second,
		ReadTimeout:           time.Second,
		WriteTimeout:          time.Second,
		PoolTimeout:           time.Second,
		MaxRetries:            -1,
		DialerRetries:         1,
		ContextTimeoutEnabled: true,
	}
}

// degradedMini returns a Limiter on a miniredis with policy p and its log.
func degradedMini(t *testing.T, p Policy) (*miniredis.Miniredis, *Limiter, *logRecorder) {
	t.Helper()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(limiterOptions(mr.Addr()))
	t.Cleanup(func() { rdb.Close() })
	logs := &logRecorder{}
	return mr, NewLimiter(rdb, WithPolicy(p), WithLogger(slog.New(logs))), logs
}

// answering is a provider whose handler the test sets.
func answering(t *testing.T, h http.HandlerFunc) *httptest.Server {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// getVia sends a GET through tr and, when tr is a Transport, waits for the
// updates its response made to the bucket.
func getVia(t *testing.T, tr http.RoundTripper, ctx context.Context, url string, header http.Header) error {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
	for k, v := range header {
		req.Header[k] = v
	}
	resp, err := tr.RoundTrip(req)
	if err == nil {
		resp.Body.Close()
	}
	if qt, ok := tr.(*Transport); ok {
		_ = qt.limiter.updates.Wait(context.Background())
	}
	return err
}

// newMini returns a client of a fresh miniredis and a counter of the
// commands sent through it.
// bodyRecorder is a request body that records whether it was closed.
type bodyRecorder struct {
	io.Reader
	closed atomic.Bool
}

func (b *bodyRecorder) Close() error { b.closed.Store(true); return nil }

// roundTripFunc adapts a function to http.RoundTripper.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

func okResponse(req *http.Request) (*http.Response, error) {
	return &http.Response{StatusCode: 200, Body: http.NoBody, Request: req}, nil
}

// hashTag returns the part of key that Redis Cluster hashes to choose its
// slot when it has a hash tag: between the first "{" and the first "}"
// after it, "" when there is none or it is empty.
func hashTag(key string) string {
	_, rest, ok := strings.Cut(key, "{")
	if !ok {
		return ""
	}
	tag, _, ok := strings.Cut(rest, "}")
	if !ok {
		return ""
	}
	return tag
}

func mustPanic(t *testing.T, name string, f func()) {
	t.Helper()
	defer func() {
		if recover() == nil {
			t.Errorf("%s did not panic", name)
		}
	}()
	f()
}

// oneLayer is the bucket of a single Limit under the Redis key rkey.
func oneLayer(rkey string, lim Limit) store.Bucket {
	return store.Bucket{Name: rkey, Keys: []string{rkey}, Lims: []store.Limit{store.Limit(lim)}, Call: []string{rkey, rkey + control.Suffix}}
}

// switchedOff holds the mechanisms the tests' negative controls turned off,
// by Limiter (see turnedOff).
var switchedOff sync.Map // switched: true

type switched struct {
	l *Limiter
	m mechanism
}

func init() {
	turnedOff = func(l *Limiter, m mechanism) bool {
		_, ok := switchedOff.Load(switched{l, m})
		return ok
	}
}

// turnOff turns mechanism m off in l, for a negative control.
func turnOff(l *Limiter, m mechanism) { switchedOff.Store(switched{l, m}, true) }
