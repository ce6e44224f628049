package main

import (
	"bytes"
	"context"
	"encoding/csv"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/demo/internal/provider"
	"github.com/sharedquota/quota/demo/internal/workers"
)

// TestMain lets the test binary serve as the demo's worker processes, which
// are copies of the running binary.
func TestMain(m *testing.M) { workers.TestMain(m, workerArg, runWorker) }

// arrivalJitter is how much longer than W a window of the provider's
// arrivals may be in which the grants of a window W arrived: the provider
// stamps a request when it arrives, after its worker woke from the wait and
// sent it over loopback, and a request that was delayed less than the one
// granted before it closes the gap between them. Tens of milliseconds on a
// loaded 2-core machine with the race detector, up to 85 ms seen with the
// CPUs oversubscribed sevenfold; 100 ms is half a token at the test's 5/s,
// so a fleet that takes one token too many still fails.
const arrivalJitter = 100 * time.Millisecond

// TestDemo runs a short demo with real worker processes and checks the
// README's claims from what the provider received (the demo's CSV) and the
// workers' logs (its JSON summary):
//
//   - with local limiters the provider gets about the fleet's size times the
//     limit, and windows far beyond the bucket's bound;
//   - with the shared bucket every window of arrivals, of any length W, holds
//     at most Burst + Rate x W requests (W widened by arrivalJitter), and the
//     fleet still keeps close to the rate;
//   - with Redis killed for longer than the shared bucket's queue reaches,
//     every worker falls back to its local share, which grants requests
//     while Redis is down, logs the outage at WARN and the recovery at INFO
//     (once each, or twice under load), and ends on the shared bucket; every
//     window stays within the bound plus the local shares' bursts, and from
//     the restart on within the bound alone: the shares start empty, and the
//     fleet leaves them at one instant, settling the shared bucket.
//
// The phase that uses local limiters is checked with the same function as
// the shared ones and must fail it: the bound is tight enough to tell a
// fleet sharing one bucket from one that does not.
func TestDemo(t *testing.T) {
	workers.RequireRedis(t)
	t.Parallel()
	out := t.TempDir()
	// Three goroutines at 5/s queue at most 0.6 s ahead; Redis is down for
	// 1.8 s (from 35% to 65% of 6 s), so the queue is served well before
	// the restart and the local shares take over for more than a second.
	cfg, err := parseFlags([]string{"-workers", "3", "-goroutines", "1", "-rate", "300", "-duration", "6s",
		"-latency", "20ms", "-json", "-out", out}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, cfg, &stdout, &stderr)
	t.Logf("output:\n%s", stderr.String())
	sum := readSummary(t, code, stdout.Bytes(), 3)
	local, shared, outage := sum.Phases[0], sum.Phases[1], sum.Phases[2]
	arrivals := readArrivals(t, sum.CSV)
	rate, burst := cfg.ratePerSecond(), float64(cfg.burst)
	allowed := rate * arrivalJitter.Seconds() // tokens

	// Phase 1: every worker keeps to the limit, so the fleet sends about
	// three times it. The rates are taken from the first request to the
	// last, past the bursts: the workers of a loaded machine may start
	// late, and the phase's own clock then tells less.
	w := cfg.workers
	ex := windowExcess(arrivals[1], burst, rate)
	kept := keptRate(t, arrivals[1], float64(w)*burst) / rate
	t.Logf("phase 1: %.2fx the limit after the bursts, %d 429s; worst window %s", kept, local.Refused, ex)
	if kept < 0.75*float64(w) || local.Refused == 0 {
		t.Errorf("phase 1: %.2fx the limit with %d 429s, want at least %.2fx and some 429s", kept, local.Refused, 0.75*float64(w))
	}
	if ex.tokens < burst {
		t.Errorf("phase 1: the worst window exceeds the bound by %.1f tokens, want at least a burst (%g): local limiters overshoot", ex.tokens, burst)
	}

	// Phase 2: within the bound in every window, and not by starving.
	ex = windowExcess(arrivals[2], burst, rate)
	kept = keptRate(t, arrivals[2], burst) / rate
	t.Logf("phase 2: %d requests, %.2fx the limit after the burst, %d 429s; worst window %s", shared.Requests, kept, shared.Refused, ex)
	if ex.tokens > allowed {
		t.Errorf("phase 2: %s, more than the %.1f tokens %v of arrival jitter allows", ex, allowed, arrivalJitter)
	}
	if kept < 0.85 {
		t.Errorf("phase 2: %.2fx the limit after the burst, want at least 0.85x", kept)
	}

	// Phase 3: the outage outlasts the queue, the local shares grant, and
	// the bound holds with their bursts on top.
	if !outage.RedisKilled {
		t.Fatalf("phase 3: Redis was not killed")
	}
	if outage.WorkersShared != w {
		t.Errorf("phase 3: %d of %d workers ended on the shared bucket", outage.WorkersShared, w)
	}
	// Each worker logs the outage and the recovery: once, or twice if a
	// Redis call of a loaded machine outlasted the workers' 100 ms timeout
	// before the kill, which is an outage of its own; never a record a
	// request.
	_, logs, _ := strings.Cut(stderr.String(), "\nPhase 3:")
	logs, _, _ = strings.Cut(logs, "\n  phase ") // the table
	for i := 1; i <= w; i++ {
		prefix := fmt.Sprintf("worker %d | ", i)
		down := strings.Count(logs, prefix+`level=WARN msg="quota: Redis unavailable`)
		up := strings.Count(logs, prefix+`level=INFO msg="quota: Redis available again`)
		if down < 1 || down > 2 || up != down {
			t.Errorf("phase 3: worker %d logged %d outage records at WARN and %d recovery records at INFO, want one or two of each", i, down, up)
		}
	}
	// Each goroutine has at most one take outstanding, so the grants the
	// shared bucket scheduled before the kill reach at most workers x
	// goroutines / rate past it. What arrives later than that (and 0.1 s
	// for sending it), before the restart, the local shares granted.
	queue := float64(w*cfg.goroutines) / rate
	// Redis is back at the earliest when its restart begins, at restartAt.
	from, to := outage.KilledAtS+0.05+queue+0.1, restartAt*sum.PhaseSeconds // KilledAtS is rounded to 0.1 s
	late := 0
	for _, a := range arrivals[3] {
		if a >= from && a <= to {
			late++
		}
	}
	// The local shares, Rate in all and empty at first, from the end of the
	// queue to the restart: at least a third of what they could grant.
	want := max(1, int(math.Round(rate*(to-from)/3)))
	t.Logf("phase 3: Redis down %.1fs to %.1fs, queue at most %.2fs; the local shares granted %d (want at least %d), %d arrived between %.2fs and %.2fs",
		outage.KilledAtS, outage.RestartedAtS, queue, outage.LocalServed, want, late, from, to)
	if to-from < 0.3 {
		t.Fatalf("phase 3: the queue (%.2fs) leaves %.2fs of the outage to the local shares, too short to tell", queue, to-from)
	}
	if outage.LocalServed < want {
		t.Errorf("phase 3: the local shares granted %d requests while Redis was down, want at least %d", outage.LocalServed, want)
	}
	if late == 0 {
		t.Errorf("phase 3: no request arrived between %.2fs and %.2fs, when only the local shares could grant", from, to)
	}
	localBursts := float64(w * max(1, cfg.burst/w))
	ex = windowExcess(arrivals[3], burst+localBursts, rate)
	t.Logf("phase 3: %d requests, %d 429s; worst window with the local shares' bursts (%g) on top, %s; without them, %s",
		outage.Requests, outage.Refused, localBursts, ex, windowExcess(arrivals[3], burst, rate))
	if ex.tokens > allowed {
		t.Errorf("phase 3: %s, more than the %.1f tokens %v of arrival jitter allows", ex, allowed, arrivalJitter)
	}
	// From the restart on (RestartedAtS is rounded to 0.1 s), the shared
	// bucket's bound alone: the local shares grant until the fleet resumes
	// the shared bucket, which they hand what they hold and promised.
	ar := outage.AfterRestart
	if ar == nil {
		t.Fatal("phase 3: no busiest second after the restart in the summary")
	}
	var restarted []float64
	for _, a := range arrivals[3] {
		if a >= outage.RestartedAtS-0.05 {
			restarted = append(restarted, a)
		}
	}
	ex = windowExcess(restarted, burst, rate)
	t.Logf("phase 3: from the restart on, max in 1 s %d / %d (from %.1fs); worst window %s", ar.Max1s, ar.Bound1s, ar.AtS, ex)
	if ar.Max1s > ar.Bound1s {
		t.Errorf("phase 3: %d requests in the second from %.1fs, after the restart, more than burst + rate allow (%d)", ar.Max1s, ar.AtS, ar.Bound1s)
	}
	if ex.tokens > allowed {
		t.Errorf("phase 3: from the restart on, %s, more than the %.1f tokens %v of arrival jitter allows", ex, allowed, arrivalJitter)
	}

	for _, f := range []string{sum.PNG, sum.SVG, sum.CSV} {
		if st, err := os.Stat(f); err != nil || st.Size() == 0 {
			t.Errorf("%s: %v, want a file", f, err)
		}
	}
}

// readSummary reads the JSON summary of a run that exited with code and
// ran phases phases. A run whose bound failed still has its figures
// checked.
func readSummary(t *testing.T, code int, stdout []byte, phases int) summary {
	t.Helper()
	if code != 0 {
		t.Errorf("exit code %d, want 0", code)
	}
	var sum summary
	if err := json.Unmarshal(stdout, &sum); err != nil {
		t.Fatalf("the summary is not JSON: %v\n%s", err, stdout)
	}
	if len(sum.Phases) != phases {
		t.Fatalf("summary: %d phases, want %d", len(sum.Phases), phases)
	}
	if !sum.OK {
		t.Errorf("summary: not ok: %v", sum.Failures)
	}
	return sum
}

// keptRate returns the rate, per second, of the sorted arrivals at past the
// first bursts requests: those beyond them over the time from the first to
// the last.
func keptRate(t *testing.T, at []float64, bursts float64) float64 {
	t.Helper()
	if float64(len(at)) < bursts+2 {
		t.Fatalf("%d requests, too few to tell a rate past %g", len(at), bursts)
	}
	return (float64(len(at)) - bursts) / (at[len(at)-1] - at[0])
}

// readArrivals reads the demo's CSV of every request the provider received
// and returns, for each phase, the seconds since it started of its
// arrivals, in order.
func readArrivals(t *testing.T, path string) map[int][]float64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil || len(rows) == 0 {
		t.Fatalf("%s: %v with %d rows", path, err, len(rows))
	}
	at := map[int][]float64{}
	for _, row := range rows[1:] { // the header
		phase, err1 := strconv.Atoi(row[0])
		secs, err2 := strconv.ParseFloat(row[1], 64)
		if err := errors.Join(err1, err2); err != nil {
			t.Fatalf("%s: row %v: %v", path, row, err)
		}
		at[phase] = append(at[phase], secs)
	}
	for _, a := range at {
		slices.Sort(a)
	}
	return at
}

// An excess is the window of arrivals that most exceeds a bucket's bound.
type excess struct {
	tokens   float64 // count - (burst + rate x W); at most 0 within the bound
	count    int
	from, to float64 // seconds
	bound    float64 // burst + rate x W
	rate     float64
}

func (e excess) String() string {
	return fmt.Sprintf("%d requests in [%.3fs, %.3fs], bound %.1f: %+.2f tokens, %+.0f ms at the rate",
		e.count, e.from, e.to, e.bound, e.tokens, 1000*e.tokens/e.rate)
}

// windowExcess returns the window [at[i], at[j]] of sorted arrivals whose
// count most exceeds burst + rate x (at[j] - at[i]), what a token bucket
// may release in it: every window, of every length, is checked.
func windowExcess(at []float64, burst, rate float64) excess {
	best := excess{tokens: math.Inf(-1)}
	for i := range at {
		for j := i; j < len(at); j++ {
			bound := burst + rate*(at[j]-at[i])
			if e := float64(j-i+1) - bound; e > best.tokens {
				best = excess{tokens: e, count: j - i + 1, from: at[i], to: at[j], bound: bound, rate: rate}
			}
		}
	}
	return best
}

// TestDemoPause runs the pause phase alone with the demo's default fleet,
// 4 workers x 8 goroutines on 600/min (burst 10), whose grants queue about
// 3 s ahead, and -pause 2s, shorter than the queue. From what the provider
// received it checks that the pause reaches the grants already queued, in
// every worker: nothing arrives from 50 ms after the 429 until the pause
// ends (without the reach, the queue would fill that time at the rate), and
// then the queue resumes at the rate, not in a burst: every window after
// the pause holds at most one token plus the rate over it.
func TestDemoPause(t *testing.T) {
	workers.RequireRedis(t)
	t.Parallel()
	out := t.TempDir()
	cfg, err := parseFlags([]string{"-pause", "2s", "-json", "-out", out}, os.Stderr)
	if err != nil {
		t.Fatal(err)
	}
	cfg.phases = []int{4}
	rate, burst := cfg.ratePerSecond(), float64(cfg.burst)
	if queue := float64(cfg.workers*cfg.goroutines) / rate; queue <= cfg.retryAfter().Seconds() {
		t.Fatalf("the fleet queues %.1fs ahead, not more than the %v pause: it would pause without reaching the queue", queue, cfg.retryAfter())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var stdout, stderr bytes.Buffer
	code := run(ctx, cfg, &stdout, &stderr)
	t.Logf("output:\n%s", stderr.String())
	sum := readSummary(t, code, stdout.Bytes(), 1)
	p := sum.Phases[0]
	if p.Phase != 4 || p.Pause == nil || !p.Pause.Sent || p.Refused == 0 {
		t.Fatalf("phase %d: pause %+v with %d 429s, want phase 4 with a 429 sent", p.Phase, p.Pause, p.Refused)
	}
	if !strings.Contains(stderr.String(), "demo     | the provider answered 429 with Retry-After: 2") {
		t.Error("phase 4 did not log the 429")
	}
	arrivals := readArrivals(t, sum.CSV)[4]
	allowed := rate * arrivalJitter.Seconds() // tokens

	if ex := windowExcess(arrivals, burst, rate); ex.tokens > allowed {
		t.Errorf("phase 4: %s, more than the %.1f tokens %v of arrival jitter allows", ex, allowed, arrivalJitter)
	}

	// SentAtS is rounded to the millisecond.
	reached, end := p.Pause.SentAtS+pauseReach.Seconds(), p.Pause.SentAtS+p.Pause.RetryAfterS
	var during, after []float64
	for _, a := range arrivals {
		switch {
		case a >= end:
			after = append(after, a)
		case a >= reached:
			during = append(during, a)
		}
	}
	if len(during) > 0 {
		t.Errorf("phase 4: %d requests arrived from %v after the 429 until the pause ended (%.3fs to %.3fs), want none: %.3f",
			len(during), pauseReach, reached, end, during)
	}

	if len(after) < 3 {
		t.Fatalf("phase 4: %d requests after the pause, too few to tell a rate", len(after))
	}
	ex := windowExcess(after, 1, rate)
	half := 0
	for i := range after {
		j, _ := slices.BinarySearch(after, after[i]+0.5+1e-9)
		half = max(half, j-i)
	}
	kept := keptRate(t, after, 1) / rate
	resumed := after[0] - end
	t.Logf("phase 4: 429 sent at %.3fs, %d requests in its first %v, %d until the pause ended at %.3fs; resumed %.0f ms after it, %d requests, %.2fx the rate; busiest half second %d; worst window %s",
		p.Pause.SentAtS, p.Pause.Reaching, pauseReach, len(during), end, 1000*resumed, len(after), kept, half, ex)
	if ex.tokens > allowed {
		t.Errorf("phase 4: after the pause, %s (one token and the rate), more than the %.1f tokens %v of arrival jitter allows", ex, allowed, arrivalJitter)
	}
	if resumed > 0.5 || kept < 0.85 {
		t.Errorf("phase 4: the traffic resumed %.0f ms after the pause at %.2fx the rate, want within 500 ms at 0.85x or more", 1000*resumed, kept)
	}
}

// TestPlan checks the phases of a run: a fourth with -pause, and a third
// without an outage when the demo cannot kill Redis.
func TestPlan(t *testing.T) {
	ph := plan(true, 2*time.Second)
	if len(ph) != 4 || !ph[2].outage || ph[3].pause != 2*time.Second || ph[3].mode != modeShared {
		t.Errorf("plan(true, 2s) = %+v", ph)
	}
	ph = plan(false, 0)
	if len(ph) != 3 || ph[2].outage || ph[2].mode != modeFallback {
		t.Errorf("plan(false, 0) = %+v", ph)
	}
}

// TestPauseFlag checks -pause: whole seconds in Retry-After, at least 1,
// and a pause that leaves the phase time to resume.
func TestPauseFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want time.Duration // the Retry-After; -1 for an error
	}{
		{nil, 0},
		{[]string{"-pause", "2s"}, 2 * time.Second},
		{[]string{"-pause", "1500ms"}, 2 * time.Second},
		{[]string{"-pause", "10ms"}, time.Second},
		{[]string{"-pause", "-1s"}, -1},
		{[]string{"-pause", "7s"}, -1}, // more than half of the default 12s
		{[]string{"-pause", "1s", "-duration", "1s"}, -1},
	} {
		cfg, err := parseFlags(tc.args, io.Discard)
		switch {
		case tc.want < 0 && err == nil:
			t.Errorf("%v: no error", tc.args)
		case tc.want >= 0 && err != nil:
			t.Errorf("%v: %v", tc.args, err)
		case tc.want >= 0 && cfg.retryAfter() != tc.want:
			t.Errorf("%v: Retry-After %v, want %v", tc.args, cfg.retryAfter(), tc.want)
		}
	}
}

// TestSummarizePause checks which arrivals count as in the pause's first
// 50 ms, during the rest of it and after it, and the busiest second after.
func TestSummarizePause(t *testing.T) {
	start := time.Unix(0, 0)
	r := phaseResult{phase: phase{pause: time.Second}, start: start, pauseSent: 4 * time.Second}
	for _, ms := range []int{3900, 4000, 4030, 4049, 4050, 4999, 5020, 5100, 6000, 6100} {
		r.arrivals = append(r.arrivals, provider.Arrival{At: start.Add(time.Duration(ms) * time.Millisecond)})
	}
	got := *summarizePause(r, 20)
	want := pauseSummary{RetryAfterS: 1, Sent: true, SentAtS: 4, Reaching: 2, During: 2, LastMS: 999, After: 4, ResumedMS: 20,
		Busiest: busiest{Max1s: 3, AtS: 5.02, Bound1s: 20}}
	if got != want {
		t.Errorf("summarizePause = %+v, want %+v", got, want)
	}
	if got := *summarizePause(phaseResult{phase: phase{pause: time.Second}}, 20); got != (pauseSummary{RetryAfterS: 1}) {
		t.Errorf("summarizePause without a 429 = %+v", got)
	}
}

// TestWritePause checks the lines under the table for a pause that reached
// the fleet, one that did not, one after which nothing arrived and a 429
// never sent.
func TestWritePause(t *testing.T) {
	s := summary{PerMinute: 600}
	b := busiest{Max1s: 11, AtS: 7.04, Bound1s: 20}
	for _, tc := range []struct {
		pause pauseSummary
		want  string
	}{
		{pauseSummary{RetryAfterS: 2, Sent: true, SentAtS: 4.8, Reaching: 2, After: 30, ResumedMS: 8, Busiest: b},
			"Phase 4: 429 with Retry-After: 2 sent at 4.8s, a pause until 6.8s; 2 requests arrived in the\n" +
				"  first 50 ms, due before the pause reached them, and 0 from then until the pause ended.\n" +
				"  The traffic resumed 8 ms after the pause ended: 30 requests, max in 1 s 11 / 20 (from 7.0s).\n"},
		{pauseSummary{RetryAfterS: 2, Sent: true, SentAtS: 4.8, During: 20, LastMS: 1900, After: 30, ResumedMS: 5, Busiest: b},
			"0 requests arrived in the\n  first 50 ms and 20 from then until the pause ended,\n" +
				"  the last 1900 ms after the 429: the pause did not reach every grant already queued.\n" +
				"  After the pause, 30 requests, the first 5 ms after its end; max in 1 s 11 / 20 (from 7.0s).\n"},
		{pauseSummary{RetryAfterS: 2, Sent: true, SentAtS: 4.8, Reaching: 1}, "1 request arrived in the\n  first 50 ms, due before the pause reached them, and 0 from then until the pause ended.\n  No request arrived after the pause.\n"},
		{pauseSummary{RetryAfterS: 2}, "no request reached the provider"},
	} {
		var w strings.Builder
		s.writePause(&w, phaseSummary{Phase: 4, Pause: &tc.pause})
		if !strings.Contains(w.String(), tc.want) {
			t.Errorf("%+v:\n%s\nwant it to contain\n%s", tc.pause, w.String(), tc.want)
		}
	}
}

func TestMaxInWindow(t *testing.T) {
	t0 := time.Unix(0, 0)
	at := func(ms ...int) []provider.Arrival {
		var a []provider.Arrival
		for _, m := range ms {
			a = append(a, provider.Arrival{At: t0.Add(time.Duration(m) * time.Millisecond)})
		}
		return a
	}
	for _, tc := range []struct {
		arrivals []provider.Arrival
		want     int
		fromMS   int // the first arrival of the first busiest window
	}{
		{nil, 0, 0},
		{at(0), 1, 0},
		{at(0, 1000), 2, 0}, // closed at both ends
		{at(0, 1001), 1, 0},
		{at(0, 500, 900, 1400, 1500), 4, 500},
		{at(0, 100, 1200, 1300), 2, 0},
	} {
		got, from := maxInWindow(tc.arrivals, time.Second)
		if got != tc.want || (got > 0 && from != t0.Add(time.Duration(tc.fromMS)*time.Millisecond)) {
			t.Errorf("maxInWindow(%v) = %d from %v, want %d from %d ms", tc.arrivals, got, from, tc.want, tc.fromMS)
		}
	}
}

func TestPercentile(t *testing.T) {
	xs := []float64{5, 1, 4, 2, 3}
	for p, want := range map[float64]float64{0: 1, 50: 3, 99: 5, 100: 5} {
		if got := percentile(xs, p); got != want {
			t.Errorf("percentile(%v, %v) = %v, want %v", xs, p, got, want)
		}
	}
	if got := percentile(nil, 50); got != 0 {
		t.Errorf("percentile(nil) = %v, want 0", got)
	}
}
