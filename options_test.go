package quota

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
)

// Tests of the options (options.go): configuration checked when it is
// given, WithLimiter, WithClock honoured by every script, and dry run
// (WithDryRun), which delays nothing and records what would have waited.

// panicOf returns what f panics with, or "" when it returns.
func panicOf(f func()) (msg string) {
	defer func() {
		if r := recover(); r != nil {
			msg = fmt.Sprint(r)
		}
	}()
	f()
	return ""
}

// Configuration a program fixes when it builds a Transport is checked
// when it is given, whatever it is: an invalid Limit, of NewTransport,
// WithLimits, WithLayers or a Meter of WithMetering, or a KeyFunc that
// would refuse or crash every request, panics there, as an invalid worker
// count, slot count or wait does, with a message that names the option
// and the value. They built Transports that failed every request.
func TestInvalidConfigurationPanicsAtConstruction(t *testing.T) {
	_, rdb, _ := newMini(t)
	estimate := func(*http.Request, []byte) (Usage, error) { return nil, nil }
	for _, c := range []struct {
		name string
		make func()
		want string
	}{
		{"NewTransport(Limit{})", func() { NewTransport(rdb, Limit{}) },
			"quota: NewTransport: invalid Limit{Rate: 0, Burst: 0}: rate 0 must be a finite number above zero"},
		{"NewTransport(burst 0.5)", func() { NewTransport(rdb, Limit{Rate: 0.5, Burst: 0.5}) },
			"quota: NewTransport: invalid Limit{Rate: 0.5, Burst: 0.5}: burst 0.5 holds less than one token"},
		{"NewTransport(a year and more)", func() { NewTransport(rdb, Limit{Rate: 1.0 / 86400, Burst: 400}) },
			"quota: NewTransport: invalid Limit{Rate: 1.1574074074074073e-05, Burst: 400}: a burst of 400"},
		{"WithLimits(negative rate)", func() { WithLimits(map[string]Limit{"a": PerSecond(1), "b": {Rate: -1}}) },
			`quota: WithLimits: bucket "b": invalid Limit{Rate: -1, Burst: 0}: rate -1 must be`},
		{"WithLimits(empty name)", func() { WithLimits(map[string]Limit{"": PerSecond(1)}) },
			"quota: WithLimits: a Limit for the empty name"},
		{"WithLayers(NaN)", func() { WithLayers(PerMinute(300), Limit{Rate: math.NaN()}) },
			"quota: WithLayers: layer 2 of 2: invalid Limit{Rate: NaN, Burst: 0}: rate NaN must be"},
		{"WithLayers(infinite burst)", func() { WithLayers(Limit{Rate: 1, Burst: math.Inf(1)}) },
			"quota: WithLayers: layer 1 of 1: invalid Limit{Rate: 1, Burst: +Inf}: burst +Inf must be"},
		{"WithMetering(burst 0.5)", func() {
			WithMetering(Metering{Estimate: estimate, Meters: []Meter{{Name: "tokens", Limit: Limit{Rate: 1, Burst: 0.5}}}})
		}, `quota: WithMetering: meter "tokens": invalid Limit{Rate: 1, Burst: 0.5}: burst 0.5 holds less`},
		{"WithMetering(zero Limit)", func() {
			WithMetering(Metering{Estimate: estimate, Meters: []Meter{{Name: "tokens"}}})
		}, `quota: WithMetering: meter "tokens": invalid Limit{Rate: 0, Burst: 0}: rate 0`},
		{"Header(\"\")", func() { Header("") }, "quota: Header with an empty name"},
		{"Join(Host, nil)", func() { Join(Host, nil) }, "quota: Join: KeyFunc 2 of 2 is nil"},
		{"AllowNames(nil, ...)", func() { AllowNames(nil, "a") }, "quota: AllowNames with a nil KeyFunc"},
		{"AllowNames(Host)", func() { AllowNames(Host) }, "quota: AllowNames of no names, which would refuse every request"},
		{"AllowNames(Host, \"\")", func() { AllowNames(Host, "a", "") }, "quota: AllowNames with the empty name"},
		// The options that panicked already.
		{"FallbackLocal(0)", func() { FallbackLocal(0) }, "quota: FallbackLocal(0): want at least one worker"},
		{"WithConcurrency(0)", func() { WithConcurrency(0) }, "quota: WithConcurrency(0): want at least one slot"},
		{"WithMaxWait(-1)", func() { WithMaxWait(-1) }, "quota: WithMaxWait(-1ns): the wait must be positive"},
	} {
		if got := panicOf(c.make); !strings.HasPrefix(got, c.want) {
			t.Errorf("%s: panic %q, want %q", c.name, got, c.want)
		}
	}
	// Valid ones build.
	if got := panicOf(func() {
		day := PerDay(10000)
		day.Burst = 1000
		NewTransport(rdb, PerSecond(10), WithLayers(PerMinute(300), day),
			WithLimits(map[string]Limit{"api.example.com/eu": {Rate: 5, Burst: 10}}))
	}); got != "" {
		t.Errorf("valid Limits: panic %q", got)
	}
}

// A Limit passed to a call is the call's input: an invalid one fails the
// call with ErrInvalidLimit, and panics nowhere.
func TestInvalidLimitOfACallIsAnError(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	for _, lim := range []Limit{{}, {Rate: -1}, {Rate: math.NaN()}, {Rate: 0.5, Burst: 0.5}} {
		if err := l.Wait(ctx, "k", lim); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("Wait(%+v) = %v, want ErrInvalidLimit", lim, err)
		}
		if _, err := l.Reserve(ctx, "k", []Meter{{Name: MeterRequests, Limit: lim}}, Usage{MeterRequests: 1}); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("Reserve(%+v) = %v, want ErrInvalidLimit", lim, err)
		}
		if err := l.SetLimit(ctx, "k", lim); !errors.Is(err, ErrInvalidLimit) {
			t.Errorf("SetLimit(%+v) = %v, want ErrInvalidLimit", lim, err)
		}
	}
}

// recorded is what a quota.wait span says of one acquisition.
type recorded struct {
	outcome, errType, mode string
	wait                   float64 // quota.wait.seconds
	dryRun                 bool
}

func (tel *telemetry) recorded() []recorded {
	var out []recorded
	for _, s := range tel.waitSpans() {
		a := attrs(s)
		out = append(out, recorded{
			outcome: a["quota.outcome"].AsString(),
			errType: a["error.type"].AsString(),
			mode:    a["quota.mode"].AsString(),
			wait:    a["quota.wait.seconds"].AsFloat64(),
			dryRun:  a["quota.dry_run"].AsBool(),
		})
	}
	return out
}

// dryRunWaits returns the count and sum of quota.wait.duration over the
// data points marked quota.dry_run=true.
func dryRunWaits(rm metricdata.ResourceMetrics) (count uint64, sum float64) {
	m := find(rm, "quota.wait.duration")
	if m == nil {
		return 0, 0
	}
	for _, dp := range m.Data.(metricdata.Histogram[float64]).DataPoints {
		if v, ok := dp.Attributes.Value(obs.AttrDryRun); ok && v.AsBool() {
			count += dp.Count
			sum += dp.Sum
		}
	}
	return count, sum
}

// A bucket of 5/s and a burst of 5, hammered by 50 requests: enforced,
// the last would go out some 9 s later; in dry run all go out at once,
// and the telemetry tells how long each would have waited.
func TestDryRunDelaysNothing(t *testing.T) {
	tel := newTelemetry(t)
	_, rdb := limiterServer(t)
	prov, reached := countingServer(t)
	client := &http.Client{Transport: NewTransport(rdb, Limit{Rate: 5, Burst: 5}, tel.transportOptions(WithDryRun())...)}

	start := time.Now()
	for i := range 50 {
		resp, err := client.Get(prov.URL)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
	}
	elapsed := time.Since(start)

	if reached.Load() != 50 || elapsed > 4500*time.Millisecond {
		t.Errorf("%d of 50 requests reached the provider in %v; want all, well before the 9s enforcement would take", reached.Load(), elapsed)
	}

	recs := tel.recorded()
	atOnce, waited, longest := 0, 0, 0.0
	for _, r := range recs {
		if !r.dryRun {
			t.Errorf("a span without quota.dry_run=true: %+v", r)
		}
		switch {
		case r.outcome == "granted" && r.wait == 0:
			atOnce++
		case r.outcome == "granted" || r.outcome == "refused":
			waited++
			longest = max(longest, r.wait)
		default:
			t.Errorf("span %+v", r)
		}
	}
	t.Logf("50 requests in %v, %d reached the provider; %d spans: %d granted at once, %d would have waited or been refused, the longest would-be wait %.2fs",
		elapsed, reached.Load(), len(recs), atOnce, waited, longest)
	// The burst, and what the bucket refilled meanwhile.
	if most := 5 + int(5*elapsed.Seconds()) + 1; len(recs) != 50 || atOnce < 5 || atOnce > most {
		t.Errorf("%d spans, %d granted at once; want 50 spans and 5 to %d at once", len(recs), atOnce, most)
	}
	if longest < 3 {
		t.Errorf("the longest would-be wait was %.2fs, want several seconds: the queue the grants would have formed", longest)
	}

	rm := tel.collect(t)
	if n := sumOf(rm, "quota.acquisitions", []attribute.KeyValue{dryRunAttr}); n != 50 {
		t.Errorf("quota.acquisitions{quota.dry_run=true} = %d, want 50", n)
	}
	count, sum := dryRunWaits(rm)
	t.Logf("quota.wait.duration{quota.dry_run=true}: %d, %.1fs in all", count, sum)
	if count != 50 || sum < 40 {
		t.Errorf("quota.wait.duration{quota.dry_run=true}: %d waits, %.1fs in all; want 50 and the would-be waits, well above the %v the requests took", count, sum, elapsed)
	}
}

// A provider's Retry-After pauses the bucket in dry run too, and the pause
// delays nothing.
func TestDryRunPausedBucket(t *testing.T) {
	tel := newTelemetry(t)
	_, rdb := limiterServer(t)
	var reached atomic.Int64
	prov := answering(t, func(w http.ResponseWriter, r *http.Request) {
		if reached.Add(1) == 1 {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusTooManyRequests)
		}
	})
	tr := NewTransport(rdb, PerSecond(10), tel.transportOptions(WithDryRun())...)
	if err := getVia(t, tr, context.Background(), prov.URL, nil); err != nil {
		t.Fatal(err)
	}
	paused := time.Now()
	for range 5 {
		if err := getVia(t, tr, context.Background(), prov.URL, nil); err != nil {
			t.Fatal(err)
		}
	}
	elapsed := time.Since(paused)
	recs := tel.recorded()
	t.Logf("5 requests in %v after a 429 with Retry-After: 2; spans %+v", elapsed, recs)
	if reached.Load() != 6 || elapsed > time.Second {
		t.Errorf("%d of 6 requests reached the provider, the 5 after the 429 in %v; want all at once", reached.Load(), elapsed)
	}
	if len(recs) != 6 {
		t.Fatalf("%d spans, want 6", len(recs))
	}
	for _, r := range recs[1:] {
		if r.outcome != "granted" || !r.dryRun || r.wait < 1 {
			t.Errorf("span after the pause %+v: want granted in dry run after a would-be wait of about 2s", r)
		}
	}
}

func TestDryRunFailClosed(t *testing.T) {
	tel := newTelemetry(t)
	srv, rdb := limiterServer(t)
	prov, reached := countingServer(t)
	tr := NewTransport(rdb, PerSecond(10), tel.transportOptions(WithDryRun(), WithLogger(discardLogger()))...)
	srv.Kill()

	client := &http.Client{Transport: tr}
	for i := range 20 {
		resp, err := client.Get(prov.URL)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		resp.Body.Close()
	}
	l := tr.Limiter()
	if err := l.Wait(context.Background(), "k", PerSecond(10)); err != nil {
		t.Errorf("Wait = %v, want nil in dry run", err)
	}
	if ok, err := l.Allow(context.Background(), "k", PerSecond(10)); !ok || err != nil {
		t.Errorf("Allow = %v, %v; want true in dry run", ok, err)
	}
	if reached.Load() != 20 || l.Mode() != ModeClosed {
		t.Errorf("%d of 20 requests reached the provider in mode %v; want all, in mode closed", reached.Load(), l.Mode())
	}
	for _, r := range tel.recorded() {
		if r != (recorded{outcome: "refused", errType: "unavailable", mode: "closed", dryRun: true}) {
			t.Errorf("span %+v: want refused as unavailable, mode closed, in dry run", r)
		}
	}
	n := sumOf(tel.collect(t), "quota.acquisitions", []attribute.KeyValue{dryRunAttr, obs.AttrOutcome.String("refused"), obs.AttrMode.String("closed")})
	if n != 22 {
		t.Errorf("quota.acquisitions{refused, closed, dry run} = %d, want 22", n)
	}
}

// FallbackLocal in dry run charges the local share and records its waits,
// without sleeping on them.
func TestDryRunFallbackLocal(t *testing.T) {
	tel := newTelemetry(t)
	srv, rdb := limiterServer(t)
	l := NewLimiter(rdb, append(tel.options(), WithDryRun(), WithPolicy(FallbackLocal(2)), WithLogger(discardLogger()))...)
	srv.Kill()

	// The share, 5/s and a burst of 2, starts empty: enforced, 20 waits
	// would take 4s.
	start := time.Now()
	for range 20 {
		if err := l.Wait(context.Background(), "k", Limit{Rate: 10, Burst: 4}); err != nil {
			t.Fatal(err)
		}
	}
	elapsed := time.Since(start)
	longest, waited := 0.0, 0
	for _, r := range tel.recorded() {
		if r.mode != "local" || r.outcome != "granted" || !r.dryRun {
			t.Errorf("span %+v: want granted from the local share in dry run", r)
		}
		if r.wait > 0.1 {
			waited++
		}
		longest = max(longest, r.wait)
	}
	t.Logf("20 waits in %v; %d would have waited, the longest %.2fs", elapsed, waited, longest)
	if elapsed > 2*time.Second || waited < 18 || longest < 2.5 {
		t.Errorf("20 waits in %v, %d would have waited, the longest %.2fs; want them at once, and the share's queue of 4s recorded", elapsed, waited, longest)
	}
}

// What dry run does with a deadline it would miss, invalid input, a
// KeyFunc that fails, Allow and WithNoWait; and the context's own end.
func TestDryRunRecordsRefusals(t *testing.T) {
	tel := newTelemetry(t)
	_, rdb := limiterServer(t)
	ctx := context.Background()
	l := NewLimiter(rdb, append(tel.options(), WithDryRun())...)
	lim := Limit{Rate: 1, Burst: 1}

	if err := l.Wait(ctx, "k", lim); err != nil { // the token
		t.Fatal(err)
	}
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond) // the next is 1s away
	defer cancel()
	if err := l.Wait(short, "k", lim); err != nil {
		t.Errorf("Wait past the deadline = %v, want nil in dry run", err)
	}
	if err := l.Wait(ctx, "k", lim); err != nil { // the refusal took nothing: 1s, not 2
		t.Error(err)
	}
	if ok, err := l.Allow(ctx, "k", lim); !ok || err != nil {
		t.Errorf("Allow on an empty bucket = %v, %v; want true in dry run", ok, err)
	}
	if err := l.Wait(ctx, "k", Limit{Rate: -1}); err != nil {
		t.Errorf("Wait with an invalid Limit = %v, want nil in dry run", err)
	}
	cancelled, cancelNow := context.WithCancel(ctx)
	cancelNow()
	if err := l.Wait(cancelled, "k", lim); !errors.Is(err, context.Canceled) {
		t.Errorf("Wait with an ended context = %v, want context.Canceled even in dry run", err)
	}

	prov, reached := countingServer(t)
	failKey := func(*http.Request) (string, error) { return "", errors.New("no tenant") }
	for _, tr := range []*Transport{
		NewTransport(rdb, lim, tel.transportOptions(WithDryRun(), WithKey(failKey))...),
		NewTransport(rdb, lim, tel.transportOptions(WithDryRun(), WithNoWait(), WithKey(Fixed("k")))...),
	} {
		resp, err := (&http.Client{Transport: tr}).Get(prov.URL)
		if err != nil {
			t.Fatalf("dry run: %v", err)
		}
		resp.Body.Close()
	}
	if reached.Load() != 2 {
		t.Errorf("%d of 2 requests reached the provider, want both in dry run", reached.Load())
	}

	recs := tel.recorded()
	want := []recorded{
		{outcome: "granted"},
		{outcome: "refused", errType: "would_exceed_deadline"},
		{outcome: "granted", wait: 1},
		{outcome: "refused", errType: "would_wait"},
		{outcome: "error", errType: "invalid_limit"},
		{outcome: "cancelled", errType: "canceled"},
		{outcome: "error", errType: "invalid_key"},
		{outcome: "refused", errType: "would_wait"},
	}
	if len(recs) != len(want) {
		t.Fatalf("%d spans, want %d: %+v", len(recs), len(want), recs)
	}
	for i, w := range want {
		r := recs[i]
		if r.outcome != w.outcome || r.errType != w.errType || !r.dryRun || r.mode != "shared" {
			t.Errorf("span %d: %+v, want %+v in dry run", i, r, w)
		}
		if w.wait > 0 && (r.wait < 0.8*w.wait || r.wait > w.wait) || w.wait == 0 && r.wait != 0 {
			t.Errorf("span %d: a would-be wait of %.3fs, want %vs", i, r.wait, w.wait)
		}
	}
}

// TestEveryScriptHonoursWithClock: under WithClock, the slots, the pause
// and the fleet's roll call are reckoned on the callers' clock.
func TestEveryScriptHonoursWithClock(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ahead := 1000 * time.Hour
	clock := func() time.Time { return time.Now().Add(ahead) }
	l := NewLimiter(rdb, WithClock(clock), WithPolicy(FallbackLocal(2).CountingWorkers()))
	ctx := context.Background()
	near := func(what string, got, want time.Time) {
		t.Helper()
		t.Logf("%s: %v ahead of this machine's clock", what, time.Until(got).Round(time.Minute))
		if d := got.Sub(want); d < -time.Minute || d > time.Minute {
			t.Errorf("%s at %v, want %v (the callers' clock)", what, got, want)
		}
	}
	slot, err := l.AcquireSlot(ctx, "clocked", 2)
	if err != nil {
		t.Fatal(err)
	}
	defer slot.Release()
	key, _ := bucketKey(l.cfg.prefix, "clocked")
	held, err := rdb.ZRangeWithScores(ctx, key+slots.HeldSuffix, 0, -1).Result()
	if err != nil || len(held) != 1 {
		t.Fatalf("slots held: %v, %v", held, err)
	}
	near("the slot's lease ends", time.UnixMicro(int64(held[0].Score)), clock().Add(l.cfg.slotLease))
	if err := l.Pause(ctx, "clocked", time.Minute); err != nil {
		t.Fatal(err)
	}
	st, err := l.Status(ctx, "clocked")
	if err != nil {
		t.Fatal(err)
	}
	near("the pause began", st.PausedSince, clock())
	if err := l.Wait(ctx, "roll-call", PerSecond(100)); err != nil {
		t.Fatal(err)
	}
	var beat []redis.Z
	eventually(t, 5*time.Second, "the roll call", func() bool {
		beat, _ = rdb.ZRangeWithScores(ctx, l.cfg.prefix+"workers", 0, -1).Result()
		return len(beat) == 1
	})
	near("the roll call lapses", time.UnixMilli(int64(beat[0].Score)), clock().Add(local.BeatTTL))
	if d := l.resumeIn(ctx); d <= 0 {
		t.Errorf("resumeIn = %v, want the delay ahead", d)
	}
	at, err := rdb.Get(ctx, l.cfg.prefix+"resume").Int64()
	if err != nil {
		t.Fatal(err)
	}
	near("the fleet resumes", time.UnixMicro(at), clock().Add(resumeDelay))
}

func TestConstructorsPanicOnNil(t *testing.T) {
	mustPanic(t, "NewLimiter(nil)", func() { NewLimiter(nil) })
	mustPanic(t, "NewTransport(nil)", func() { NewTransport(nil, PerSecond(1)) })
	mustPanic(t, "WithKey(nil)", func() { WithKey(nil) })
	mustPanic(t, "WithLogger(nil)", func() { WithLogger(nil) })
	mustPanic(t, "WithClock(nil)", func() { WithClock(nil) })
	mustPanic(t, "WithMaxWait(0)", func() { WithMaxWait(0) })
}

// TestWithLimiterRefusesLimiterOptions: an option of the Limiter's own
// beside WithLimiter would have no effect, so NewTransport refuses it.
func TestWithLimiterRefusesLimiterOptions(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	NewTransport(nil, PerSecond(1), WithLimiter(l), WithConcurrency(2)) // a Transport's own: accepted
	defer func() {
		if recover() == nil {
			t.Error("NewTransport with WithLimiter and WithPrefix did not panic")
		}
	}()
	NewTransport(nil, PerSecond(1), WithLimiter(l), WithPrefix("other:"))
}
