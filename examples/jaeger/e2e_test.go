package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestJaeger runs the example against a real Jaeger and a real Redis, both
// started by the test on loopback ports, and reads the traces back from
// Jaeger's query API. It runs when QUOTA_JAEGER_BIN names a Jaeger v2
// binary (scripts/jaeger.sh prints one):
//
//	QUOTA_JAEGER_BIN=$(../../scripts/jaeger.sh) go test -v
//
// With QUOTA_E2E=1 a missing binary fails the test instead of skipping it,
// and with QUOTA_REQUIRE_REDIS=1 so does a missing redis-server.
func TestJaeger(t *testing.T) {
	bin := jaegerBinary(t)
	redisAddr := startRedis(t)
	j := startJaeger(t, bin)

	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	started := time.Now()
	var out bytes.Buffer
	if err := run(ctx, config{OTLP: j.otlp, Redis: redisAddr}, &out); err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	t.Logf("the example printed:\n%s", out.String())

	traces := j.traces(t, started, len(cities))
	if len(traces) != len(cities) {
		t.Fatalf("Jaeger has %d traces of quota-example, want %d (one per request)", len(traces), len(cities))
	}

	var retried []jaegerTrace
	for _, tr := range traces {
		failed := t.Failed()
		attempts := checkTrace(t, tr)
		if !failed && t.Failed() {
			t.Logf("trace %s:\n%s", tr.TraceID, describe(tr))
		}
		if attempts == 2 {
			retried = append(retried, tr)
		}
	}
	if len(retried) != 1 {
		t.Fatalf("%d traces show a retried request, want 1 (the provider answers one 429)", len(retried))
	}
	t.Logf("the retried request, as Jaeger shows it:\n%s", describe(retried[0]))
	pause, retry := checkRetry(t, retried[0])
	checkGrants(t, traces, pause, retry)
}

// checkRetry checks the trace of the request whose first attempt the
// provider answered with 429 and Retry-After: the first attempt's wait and
// its HTTP span, which got the 429, then a quota.pause span, a child of
// the request's span with the script's pause call inside it, then the
// retry's wait and HTTP span. It returns the quota.pause span and the
// retry's quota.wait span.
func checkRetry(t *testing.T, tr jaegerTrace) (pause, retry jaegerSpan) {
	t.Helper()
	root := tr.roots()[0]
	waits := tr.named("quota.wait")
	calls := tr.filter(func(s jaegerSpan) bool {
		_, isHTTP := s.str("http.request.method")
		return isHTTP && s.kind() == "client"
	})
	pauses := tr.named("quota.pause")
	if len(waits) != 2 || len(calls) != 2 || len(pauses) != 1 {
		t.Fatalf("trace %s: %d quota.wait, %d HTTP client and %d quota.pause spans, want 2, 2 and 1",
			tr.TraceID, len(waits), len(calls), len(pauses))
	}
	refused := calls[0] // checkTrace checked the first wait and the order of the attempts
	pause, retry = pauses[0], waits[1]
	if status, _ := refused.int("http.response.status_code"); status != http.StatusTooManyRequests {
		t.Errorf("the first attempt's HTTP span has status %d, want 429", status)
	}
	if pause.parent() != root.SpanID {
		t.Errorf("quota.pause is not a child of geocode")
	}
	// The Transport pauses the bucket once the 429's headers are in, before
	// retryablehttp reads the body and the HTTP span ends.
	if pause.StartTime < refused.StartTime || pause.end() > retry.StartTime+1000 {
		t.Errorf("quota.pause runs from +%d µs to +%d µs, want it after the 429's HTTP span starts (+%d µs) and before the retry's wait (+%d µs)",
			pause.StartTime-root.StartTime, pause.end()-root.StartTime, refused.StartTime-root.StartTime, retry.StartTime-root.StartTime)
	}
	if _, ok := scriptCall(tr, pause, "pause"); !ok {
		t.Fatalf("quota.pause holds no Redis call of the script's pause")
	}
	return pause, retry
}

// checkGrants checks when the bucket granted the tokens of every attempt,
// from the ends of their quota.wait spans: none before its turn (the burst
// at once, then one every 1/Rate), and none while the bucket was paused. A
// grant can be late, by the time its goroutine takes to wake, but never
// early: the earliest wait starts before the bucket's first take, and a
// wait span ends after its grant.
//
// The pause moves the grants already queued behind it: a request that took
// its token before the 429 and was still waiting is granted after the
// pause ends, unless its turn came in the few milliseconds before the
// pause's announcement reached it. A request that took its token after the
// 429 waits for the pause too. The retry takes its token once
// retryablehttp has slept the Retry-After: it is granted no earlier than
// retryAfter after the pause began (it kept the pause), and no later than
// the grants queued ahead of it and half a second allow (it did not wait
// the pause twice).
func checkGrants(t *testing.T, traces []jaegerTrace, pause, retry jaegerSpan) {
	t.Helper()
	var pauseTrace jaegerTrace
	var waits []jaegerSpan
	var takes []jaegerSpan // the script's take under each wait
	for _, tr := range traces {
		if tr.span(pause.SpanID) != nil {
			pauseTrace = tr
		}
		for _, w := range tr.named("quota.wait") {
			take, ok := scriptCall(tr, w, "take")
			if !ok {
				t.Errorf("trace %s: a quota.wait holds no Redis call of the script's take", tr.TraceID)
				return
			}
			waits, takes = append(waits, w), append(takes, take)
		}
	}
	paused, _ := scriptCall(pauseTrace, pause, "pause")
	if len(waits) != len(cities)+1 {
		t.Errorf("%d quota.wait spans, want %d: one a request and the retry", len(waits), len(cities)+1)
		return
	}
	start := slices.MinFunc(waits, func(a, b jaegerSpan) int { return cmp.Compare(a.StartTime, b.StartTime) }).StartTime
	at := func(us int64) time.Duration { return time.Duration(us-start) * time.Microsecond }
	interval := time.Duration(float64(time.Second) / bucket.Rate)
	pauseEnd := at(pause.StartTime) + retryAfter

	// The bucket's rate: the i-th grant no earlier than its turn.
	grants := make([]time.Duration, len(waits))
	for i, w := range waits {
		grants[i] = at(w.end())
	}
	slices.Sort(grants)
	var got []string
	for i, g := range grants {
		got = append(got, fmt.Sprintf("%.3fs", g.Seconds()))
		if turn := time.Duration(max(0, i+1-int(bucket.Burst))) * interval; g < turn-time.Millisecond {
			t.Errorf("grant %d of %d at %v, before its turn at %v", i+1, len(grants), g, turn)
		}
	}
	t.Logf("grants at %s; the pause from %.3fs to %.3fs", strings.Join(got, ", "), at(pause.StartTime).Seconds(), pauseEnd.Seconds())

	// The pause, for every request: nothing is granted from 50 ms after the
	// pause was recorded (its announcement has reached every sleeper by
	// then) until it ends; what was taken before it and had not gone out
	// yet is granted after it.
	known := at(paused.end()) + 50*time.Millisecond
	var before, moved, after int
	for i, w := range waits {
		grant := at(w.end())
		if w.SpanID == retry.SpanID {
			continue
		}
		if grant > known && grant < pauseEnd-time.Millisecond {
			t.Errorf("a token taken at %v was granted at %v, inside the pause from %v to %v",
				at(takes[i].StartTime), grant, known, pauseEnd)
		}
		switch {
		case grant <= known:
			before++
		case takes[i].end() <= paused.StartTime:
			moved++
		default:
			after++
		}
	}
	delay := time.Duration(retry.end()-pause.StartTime) * time.Microsecond
	waited, _ := retry.float("quota.wait.seconds")
	queued := time.Duration(moved+after) * interval
	t.Logf("Retry-After %v; %d first attempts granted before the pause, %d taken before it and moved behind it, %d taken after it; "+
		"the retry was granted %v after the pause began, after a wait of its own of %.3fs",
		retryAfter, before, moved, after, delay.Round(time.Millisecond), waited)
	if limit := retryAfter + queued + 500*time.Millisecond; delay < retryAfter-time.Millisecond || delay > limit {
		t.Errorf("the retry was granted %v after the pause began, want %v (the pause kept) to %v (not kept twice)", delay, retryAfter, limit)
	}
}

// scriptCall returns the Redis call of the script's operation op (take,
// pause...) that ran under the span parent.
func scriptCall(tr jaegerTrace, parent jaegerSpan, op string) (jaegerSpan, bool) {
	for _, s := range tr.children(parent.SpanID) {
		if scriptOp(s) == op {
			return s, true
		}
	}
	return jaegerSpan{}, false
}

// checkTrace checks one request's trace and returns how many attempts it
// made: a geocode root; per attempt a quota.wait child of the root,
// holding the Redis calls that took the token, and then an HTTP client
// span, a sibling of the wait that starts after it has ended; every attempt
// but the last answered 429.
func checkTrace(t *testing.T, tr jaegerTrace) int {
	t.Helper()
	roots := tr.roots()
	if len(roots) != 1 || roots[0].OperationName != "geocode" {
		t.Errorf("trace %s: roots %v, want one geocode span", tr.TraceID, names(roots))
		return 0
	}
	root := roots[0]
	for _, s := range tr.Spans {
		if p := s.parent(); p != "" && tr.span(p) == nil {
			t.Errorf("trace %s: the parent of %s is not in the trace", tr.TraceID, s.OperationName)
		}
	}
	waits := tr.named("quota.wait")
	calls := tr.filter(func(s jaegerSpan) bool {
		_, isHTTP := s.str("http.request.method")
		return isHTTP && s.kind() == "client"
	})
	if len(waits) == 0 || len(waits) != len(calls) {
		t.Errorf("trace %s: %d quota.wait spans and %d HTTP client spans, want one of each per attempt", tr.TraceID, len(waits), len(calls))
		return 0
	}

	for i, w := range waits {
		name := fmt.Sprintf("trace %s: attempt %d", tr.TraceID, i+1)
		if w.parent() != root.SpanID {
			t.Errorf("%s: quota.wait is not a child of geocode", name)
		}
		if w.kind() != "internal" {
			t.Errorf("%s: quota.wait has kind %q, want internal", name, w.kind())
		}
		secs, ok := w.float("quota.wait.seconds")
		if !ok {
			t.Errorf("%s: quota.wait has no float quota.wait.seconds tag: %v", name, w.Tags)
		}
		// The tag is measured by the limiter just before it ends the span;
		// a loaded machine may preempt it in between for a few time slices.
		if d := time.Duration(secs*1e6)*time.Microsecond - w.duration(); d < -25*time.Millisecond || d > 25*time.Millisecond {
			t.Errorf("%s: quota.wait.seconds %.6f, but the span lasted %v", name, secs, w.duration())
		}
		for key, want := range map[string]string{"quota.mode": "shared", "quota.outcome": "granted"} {
			if got, _ := w.str(key); got != want {
				t.Errorf("%s: %s = %q, want %q", name, key, got, want)
			}
		}
		if _, ok := w.str("quota.key"); !ok {
			t.Errorf("%s: quota.wait has no quota.key", name)
		}

		// The Redis calls of the acquisition run inside its span.
		var redisCalls int
		for _, s := range tr.Spans {
			if s.parent() == w.SpanID && (s.OperationName == "evalsha" || s.OperationName == "eval") {
				redisCalls++
			}
		}
		if trips, _ := w.int("quota.redis.round_trips"); redisCalls == 0 || int64(redisCalls) != trips {
			t.Errorf("%s: %d evalsha/eval spans under quota.wait, quota.redis.round_trips = %d", name, redisCalls, trips)
		}

		// The HTTP client span of the attempt follows the wait and does not
		// contain it. Jaeger keeps microseconds, so allow a millisecond of
		// rounding.
		c := calls[i]
		if c.parent() == w.SpanID {
			t.Errorf("%s: the HTTP client span is a child of quota.wait", name)
		}
		if c.parent() != root.SpanID {
			t.Errorf("%s: the HTTP client span is not a child of geocode", name)
		}
		if c.StartTime < w.end()-1000 {
			t.Errorf("%s: the HTTP client span starts %d µs before quota.wait ends", name, w.end()-c.StartTime)
		}
		if i > 0 && w.StartTime < calls[i-1].end()-1000 {
			t.Errorf("%s: the retry's quota.wait starts before the previous attempt's response", name)
		}
		status, _ := c.int("http.response.status_code")
		if last := i == len(waits)-1; last && status != http.StatusOK || !last && status != http.StatusTooManyRequests {
			t.Errorf("%s: status %d", name, status)
		}
	}

	return len(waits)
}

// describe renders a trace as an indented tree: each span's offset from the
// start of the trace, its duration and its telling tags.
func describe(tr jaegerTrace) string {
	var b strings.Builder
	start := slices.MinFunc(tr.Spans, func(a, b jaegerSpan) int { return cmp.Compare(a.StartTime, b.StartTime) }).StartTime
	var walk func(id string, depth int)
	walk = func(id string, depth int) {
		for _, s := range tr.children(id) {
			label := strings.Repeat("  ", depth) + s.OperationName
			var tags []string
			for _, key := range []string{"geocode.city", "quota.wait.seconds", "quota.redis.round_trips", "http.response.status_code"} {
				for _, tag := range s.Tags {
					if tag.Key == key {
						tags = append(tags, fmt.Sprintf("%s=%v", key, tag.Value))
					}
				}
			}
			if op := scriptOp(s); op != "" {
				tags = append(tags, "script: "+op)
			}
			line := fmt.Sprintf("  %-18s %11s %10s  %s", label,
				fmt.Sprintf("+%.1f ms", float64(s.StartTime-start)/1e3),
				fmt.Sprintf("%.1f ms", float64(s.Duration)/1e3),
				strings.Join(tags, " "))
			b.WriteString(strings.TrimRight(line, " ") + "\n")
			walk(s.SpanID, depth+1)
		}
	}
	fmt.Fprintf(&b, "  %-18s %11s %10s\n", "span", "start", "duration")
	walk("", 0)
	for _, s := range tr.Spans {
		if p := s.parent(); p != "" && tr.span(p) == nil {
			fmt.Fprintf(&b, "  (%s, a child of span %s, which is not in the trace)\n", s.OperationName, p)
			walk(s.SpanID, 1)
		}
	}
	return b.String()
}

// scriptOp returns the first argument after the keys of an EVAL or EVALSHA
// span's statement (the limiter's script names its operation there:
// take, refund...), or "".
func scriptOp(s jaegerSpan) string {
	stmt, _ := s.str("db.statement")
	f := strings.Fields(stmt)
	if len(f) < 3 || (f[0] != "eval" && f[0] != "evalsha") {
		return ""
	}
	keys, err := strconv.Atoi(f[2])
	if err != nil || keys < 0 || len(f) <= 3+keys {
		return ""
	}
	return f[3+keys]
}

// jaegerBinary returns the Jaeger binary named by QUOTA_JAEGER_BIN, and
// skips the test when there is none (fails it under QUOTA_E2E=1).
func jaegerBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("QUOTA_JAEGER_BIN")
	if bin == "" {
		const how = "set QUOTA_JAEGER_BIN to a Jaeger v2 binary: QUOTA_JAEGER_BIN=$(scripts/jaeger.sh), from the repository's root"
		if os.Getenv("QUOTA_E2E") == "1" {
			t.Fatal("QUOTA_E2E=1 but QUOTA_JAEGER_BIN is not set; " + how)
		}
		t.Skip("no Jaeger: " + how)
	}
	if fi, err := os.Stat(bin); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		t.Fatalf("QUOTA_JAEGER_BIN=%s is not an executable file (err: %v)", bin, err)
	}
	return bin
}

// startRedis starts a redis-server without persistence on a free loopback
// port for the test's lifetime and returns its address. It skips the test
// when redis-server is not installed (fails it under QUOTA_REQUIRE_REDIS=1).
func startRedis(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		const how = "install it: apt-get install redis-server"
		if os.Getenv("QUOTA_REQUIRE_REDIS") == "1" {
			t.Fatal("QUOTA_REQUIRE_REDIS=1 but redis-server is not on PATH; " + how)
		}
		t.Skip("no redis-server on PATH; " + how)
	}
	addr := freeAddr(t)
	_, port, _ := net.SplitHostPort(addr)
	p := start(t, "redis-server", exec.Command(bin,
		"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"))

	rdb := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer rdb.Close()
	p.waitReady(t, 10*time.Second, func() error {
		return rdb.Ping(t.Context()).Err()
	})
	return addr
}

// queryClient asks Jaeger's query API.
var queryClient = &http.Client{Timeout: 5 * time.Second}

// jaeger is a Jaeger the test started.
type jaeger struct {
	otlp  string // OTLP/HTTP receiver, host:port
	query string // query API, http://host:port
}

// startJaeger starts bin with jaeger-e2e.yaml (OTLP/HTTP in, memory
// storage, query API out), every endpoint on a free loopback port, and
// waits until it accepts spans and queries.
func startJaeger(t *testing.T, bin string) jaeger {
	t.Helper()
	conf, err := filepath.Abs("jaeger-e2e.yaml")
	if err != nil {
		t.Fatal(err)
	}
	otlp, query, grpc := freeAddr(t), freeAddr(t), freeAddr(t)
	cmd := exec.Command(bin, "--config", conf)
	cmd.Env = append(os.Environ(),
		"QUOTA_JAEGER_OTLP_HTTP="+otlp,
		"QUOTA_JAEGER_QUERY_HTTP="+query,
		"QUOTA_JAEGER_QUERY_GRPC="+grpc)
	p := start(t, "jaeger", cmd)

	j := jaeger{otlp: otlp, query: "http://" + query}
	p.waitReady(t, 30*time.Second, func() error {
		resp, err := queryClient.Get(j.query + "/api/services")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("query API: %s", resp.Status)
		}
		// The receiver starts after the query extension.
		c, err := net.DialTimeout("tcp", otlp, time.Second)
		if err != nil {
			return err
		}
		return c.Close()
	})
	return j
}

// traces polls Jaeger for the traces of quota-example that started after
// since, until there are at least want of them and two polls in a row find
// the same spans (the spans of one trace may arrive in several batches).
func (j jaeger) traces(t *testing.T, since time.Time, want int) []jaegerTrace {
	t.Helper()
	url := fmt.Sprintf("%s/api/traces?service=quota-example&limit=100&start=%d", j.query, since.Add(-time.Second).UnixMicro())
	deadline := time.Now().Add(20 * time.Second)
	last := -1
	for {
		var body struct {
			Data   []jaegerTrace `json:"data"`
			Errors []any         `json:"errors"`
		}
		resp, err := queryClient.Get(url)
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&body)
			resp.Body.Close()
		}
		if err == nil && len(body.Errors) > 0 {
			err = fmt.Errorf("query API: %v", body.Errors)
		}
		spans := 0
		for _, tr := range body.Data {
			spans += len(tr.Spans)
		}
		if err == nil && len(body.Data) >= want && spans == last {
			return body.Data
		}
		last = spans
		if time.Now().After(deadline) {
			t.Fatalf("Jaeger has %d traces (%d spans) of quota-example after 20 s, want %d (last error: %v)", len(body.Data), spans, want, err)
		}
		time.Sleep(300 * time.Millisecond)
	}
}

// The JSON of Jaeger's query API (/api/traces): times in microseconds.
type (
	jaegerTrace struct {
		TraceID string       `json:"traceID"`
		Spans   []jaegerSpan `json:"spans"`
	}
	jaegerSpan struct {
		SpanID        string `json:"spanID"`
		OperationName string `json:"operationName"`
		References    []struct {
			RefType string `json:"refType"`
			SpanID  string `json:"spanID"`
		} `json:"references"`
		StartTime int64 `json:"startTime"`
		Duration  int64 `json:"duration"`
		Tags      []struct {
			Key   string `json:"key"`
			Type  string `json:"type"`
			Value any    `json:"value"`
		} `json:"tags"`
	}
)

// span returns the span with the ID id, or nil.
func (tr jaegerTrace) span(id string) *jaegerSpan {
	for i := range tr.Spans {
		if tr.Spans[i].SpanID == id {
			return &tr.Spans[i]
		}
	}
	return nil
}

// filter returns the spans for which keep is true in the order they
// started.
func (tr jaegerTrace) filter(keep func(jaegerSpan) bool) []jaegerSpan {
	var out []jaegerSpan
	for _, s := range tr.Spans {
		if keep(s) {
			out = append(out, s)
		}
	}
	slices.SortStableFunc(out, func(a, b jaegerSpan) int { return cmp.Compare(a.StartTime, b.StartTime) })
	return out
}

// children returns the spans whose parent is id ("" for the roots) in the
// order they started.
func (tr jaegerTrace) children(id string) []jaegerSpan {
	return tr.filter(func(s jaegerSpan) bool { return s.parent() == id })
}

func (tr jaegerTrace) roots() []jaegerSpan { return tr.children("") }

// named returns the spans called name in the order they started.
func (tr jaegerTrace) named(name string) []jaegerSpan {
	return tr.filter(func(s jaegerSpan) bool { return s.OperationName == name })
}

// parent returns the ID of the span s is a CHILD_OF, or "".
func (s jaegerSpan) parent() string {
	for _, r := range s.References {
		if r.RefType == "CHILD_OF" {
			return r.SpanID
		}
	}
	return ""
}

func (s jaegerSpan) end() int64              { return s.StartTime + s.Duration }
func (s jaegerSpan) duration() time.Duration { return time.Duration(s.Duration) * time.Microsecond }
func (s jaegerSpan) kind() string            { k, _ := s.str("span.kind"); return k }

func (s jaegerSpan) str(key string) (string, bool) {
	for _, tag := range s.Tags {
		if tag.Key == key && tag.Type == "string" {
			v, ok := tag.Value.(string)
			return v, ok
		}
	}
	return "", false
}

func (s jaegerSpan) float(key string) (float64, bool) {
	for _, tag := range s.Tags {
		if tag.Key == key && tag.Type == "float64" {
			v, ok := tag.Value.(float64)
			return v, ok
		}
	}
	return 0, false
}

func (s jaegerSpan) int(key string) (int64, bool) {
	for _, tag := range s.Tags {
		if tag.Key == key && tag.Type == "int64" {
			v, ok := tag.Value.(float64) // JSON numbers
			return int64(v), ok
		}
	}
	return 0, false
}

func names(spans []jaegerSpan) []string {
	out := make([]string, len(spans))
	for i, s := range spans {
		out[i] = s.OperationName
	}
	return out
}

// freeAddr returns a loopback address with a port that was free a moment
// ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return "127.0.0.1:" + strconv.Itoa(l.Addr().(*net.TCPAddr).Port)
}

// process is a server the test started; it is killed when the test ends.
type process struct {
	name   string
	output *lockedBuffer
	exited chan struct{}
	err    error // set before exited is closed
}

// start starts cmd, its output captured, and kills it when the test ends.
func start(t *testing.T, name string, cmd *exec.Cmd) *process {
	t.Helper()
	p := &process{name: name, output: new(lockedBuffer), exited: make(chan struct{})}
	cmd.Stdout, cmd.Stderr = p.output, p.output
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = cmd.Wait()
		close(p.exited)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-p.exited
		if t.Failed() {
			t.Logf("%s's output:\n%s", name, p.output)
		}
	})
	return p
}

// waitReady calls ready until it succeeds, failing the test when the
// process exits or timeout passes first.
func (p *process) waitReady(t *testing.T, timeout time.Duration, ready func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := ready()
		if err == nil {
			return
		}
		select {
		case <-p.exited:
			t.Fatalf("%s exited: %v\n%s", p.name, errors.Join(p.err, err), p.output)
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s is not ready after %v: %v\n%s", p.name, timeout, err, p.output)
		}
	}
}

// lockedBuffer is a bytes.Buffer safe for a process to write while the test
// reads it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
