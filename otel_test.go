package quota

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

// Tests of the telemetry (otel.go, and the spans and metrics the Limiter
// records): wait spans, of Allow and of pauses too, metrics and their keys,
// and the gauges of slots.

// spanContextHook records the span in the context of each take.
type spanContextHook struct{ seen chan trace.SpanContext }

func (spanContextHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (h spanContextHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if scriptOp(cmd) == "take" {
			h.seen <- trace.SpanContextFromContext(ctx)
		}
		return next(ctx, cmd)
	}
}
func (spanContextHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func TestWaitSpan(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	tel := newTelemetry(t)
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	redisSpans := spanContextHook{make(chan trace.SpanContext, 10)}
	rdb.AddHook(redisSpans)

	endedBeforeSend, sends := true, 0
	base := roundTripFunc(func(r *http.Request) (*http.Response, error) {
		sends++
		endedBeforeSend = endedBeforeSend && len(tel.waitSpans()) == sends
		if got := trace.SpanContextFromContext(r.Context()); got.SpanID() == tel.waitSpanIDOrZero() {
			t.Error("the request was sent in the wait span's context")
		}
		return okResponse(r)
	})
	tr := NewTransport(rdb, Limit{Rate: 2, Burst: 1}, tel.transportOptions(WithBase(base))...)

	ctx, caller := tel.tp.Tracer("test").Start(context.Background(), "caller")
	req, _ := http.NewRequestWithContext(ctx, "GET", "https://api.example.com/v1", nil)
	if _, err := tr.RoundTrip(req); err != nil {
		t.Fatal(err)
	}
	// The second request waits for the bucket to refill: 500 ms less the
	// time the first took.
	if _, err := tr.RoundTrip(req.Clone(ctx)); err != nil {
		t.Fatal(err)
	}
	caller.End()

	if !endedBeforeSend {
		t.Error("the wait span had not ended when the request was sent")
	}
	spans := tel.waitSpans()
	if len(spans) != 2 {
		t.Fatalf("%d quota.wait spans, want 2", len(spans))
	}
	s := spans[1]
	if s.Parent().SpanID() != caller.SpanContext().SpanID() || s.SpanKind() != trace.SpanKindInternal {
		t.Errorf("span parent %v kind %v, want the caller's span and internal", s.Parent().SpanID(), s.SpanKind())
	}
	a := attrs(s)
	for k, want := range map[attribute.Key]attribute.Value{
		"quota.key":               attribute.StringValue("api.example.com"),
		"quota.limit.rate":        attribute.Float64Value(2),
		"quota.limit.burst":       attribute.Float64Value(1),
		"quota.tokens":            attribute.Float64Value(1),
		"quota.mode":              attribute.StringValue("shared"),
		"quota.outcome":           attribute.StringValue("granted"),
		"quota.redis.round_trips": attribute.IntValue(1),
	} {
		if a[k] != want {
			t.Errorf("attribute %s = %v, want %v", k, a[k].String(), want.String())
		}
	}
	if w := a["quota.wait.seconds"]; w.Type() != attribute.FLOAT64 || w.AsFloat64() < 0.1 || w.AsFloat64() > 1.5 {
		t.Errorf("quota.wait.seconds = %v, want about 0.5", w.String())
	}
	if s.Status().Code != codes.Unset || len(s.Events()) != 0 {
		t.Errorf("a granted wait has status %v and %d events", s.Status(), len(s.Events()))
	}
	// The Redis call ran in the wait span's context, where a tracing hook
	// such as redisotel nests its span.
	<-redisSpans.seen
	if got := <-redisSpans.seen; got.SpanID() != s.SpanContext().SpanID() {
		t.Errorf("the Redis call ran in span %v, want the wait span %v", got.SpanID(), s.SpanContext().SpanID())
	}
}

func TestWaitSpanErrors(t *testing.T) {
	tel := newTelemetry(t)
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(limiterOptions(mr.Addr()))
	defer rdb.Close()
	l := NewLimiter(rdb, append(tel.options(), WithLogger(discardLogger()))...)
	ctx := context.Background()

	_ = l.Wait(ctx, "k", Limit{Rate: -1})
	short, cancel := context.WithTimeout(ctx, 5*time.Second)
	_ = l.WaitN(short, "k", 2, Limit{Rate: 0.1, Burst: 2})
	_ = l.Wait(short, "k", Limit{Rate: 0.1, Burst: 2}) // 10 s away: would pass the deadline
	cancel()
	mr.Close()
	_ = l.Wait(ctx, "k", PerSecond(1)) // FailClosed

	want := []struct{ outcome, errType, mode string }{
		{"error", "invalid_limit", "shared"},
		{"granted", "", "shared"},
		{"refused", "would_exceed_deadline", "shared"},
		{"refused", "unavailable", "closed"},
	}
	spans := tel.waitSpans()
	if len(spans) != len(want) {
		t.Fatalf("%d spans, want %d", len(spans), len(want))
	}
	for i, w := range want {
		a := attrs(spans[i])
		if a["quota.outcome"].AsString() != w.outcome || a["error.type"].AsString() != w.errType || a["quota.mode"].AsString() != w.mode {
			t.Errorf("span %d: outcome %q error.type %q mode %q, want %+v", i, a["quota.outcome"].AsString(), a["error.type"].AsString(), a["quota.mode"].AsString(), w)
		}
		if wantErr := w.errType != ""; wantErr != (spans[i].Status().Code == codes.Error) {
			t.Errorf("span %d: status %v", i, spans[i].Status())
		}
		if len(spans[i].Events()) != 0 {
			t.Errorf("span %d has %d events, want none", i, len(spans[i].Events()))
		}
	}
}

func TestMetrics(t *testing.T) {
	tel := newTelemetry(t)
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	rdb.AddHook(dueHook{})
	// The script's clock stands still, so that every wait is what the
	// bucket says, whatever the machine does meanwhile.
	frozen := time.Now()
	l := NewLimiter(rdb, append(tel.options(), WithName("geo"), WithClock(func() time.Time { return frozen }))...)
	ctx := context.Background()
	lim := Limit{Rate: 10, Burst: 2}

	// Two granted at once, one granted after 100ms, one cancelled while
	// it waits 200ms (and refunded), one refused at its deadline. Each
	// call's duration is bounded by what the test sees: at least the wait
	// it slept, at most the time the call took.
	var atLeast, atMost []time.Duration
	call := func(f func() error) error {
		start := time.Now()
		err := f()
		atMost = append(atMost, time.Since(start))
		return err
	}
	for i := range 3 {
		wctx, rec := withDueRecord(ctx)
		if err := call(func() error { return l.Wait(wctx, "k", lim) }); err != nil {
			t.Fatal(err)
		}
		if want := time.Duration(max(i-1, 0)) * 100 * time.Millisecond; rec.Wait != want {
			t.Fatalf("wait %d: %v, want %v", i+1, rec.Wait, want)
		}
		atLeast = append(atLeast, rec.Wait)
	}
	cctx, rec := withDueRecord(ctx)
	cancelled, cancel := context.WithCancel(cctx)
	go func() { <-rec.granted; cancel() }() // while it waits
	if err := call(func() error { return l.Wait(cancelled, "k", lim) }); !errors.Is(err, context.Canceled) || rec.Wait != 200*time.Millisecond {
		t.Fatalf("err = %v after a wait of %v, want context.Canceled after 200ms", err, rec.Wait)
	}
	atLeast = append(atLeast, 0)
	short, cancel2 := context.WithTimeout(ctx, 250*time.Millisecond) // the 2 tokens are 300ms away
	defer cancel2()
	if err := call(func() error { return l.WaitN(short, "k", 2, lim) }); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Fatalf("err = %v", err)
	}
	atLeast = append(atLeast, 0)

	var rm metricdata.ResourceMetrics
	eventually(t, 10*time.Second, "the refund", func() bool { // it runs in the background
		if err := tel.reader.Collect(ctx, &rm); err != nil {
			t.Fatal(err)
		}
		return sumOf(rm, "quota.refunds", nil) == 1
	})
	for _, c := range []struct {
		outcome string
		want    int64
	}{{"granted", 3}, {"cancelled", 1}, {"refused", 1}} {
		got := sumOf(rm, "quota.acquisitions", []attribute.KeyValue{obs.AttrMode.String("shared"), obs.AttrOutcome.String(c.outcome)})
		if got != c.want {
			t.Errorf("quota.acquisitions{outcome=%s} = %d, want %d", c.outcome, got, c.want)
		}
	}
	if got := sumOf(rm, "quota.refunds", nil); got != 1 {
		t.Errorf("quota.refunds = %d, want 1", got)
	}

	h := find(rm, "quota.wait.duration")
	if h == nil {
		t.Fatal("no quota.wait.duration")
	}
	hist := h.Data.(metricdata.Histogram[float64])
	var count, slow uint64 // slow: waits of 50ms or more
	var sum float64
	for _, dp := range hist.DataPoints {
		count += dp.Count
		sum += dp.Sum
		if len(dp.Bounds) != len(obs.WaitBuckets) || dp.Bounds[0] != 0.001 || dp.Bounds[len(dp.Bounds)-1] != 10 {
			t.Errorf("bucket bounds %v, want 1ms to 10s", dp.Bounds)
		}
		for i, b := range dp.Bounds {
			if b >= 0.05 {
				slow += dp.BucketCounts[i+1]
			}
		}
	}
	var least, most time.Duration
	var slowAtLeast, slowAtMost uint64
	for i := range atMost {
		least, most = least+atLeast[i], most+atMost[i]
		if atLeast[i] >= 50*time.Millisecond {
			slowAtLeast++
		}
		if atMost[i] >= 50*time.Millisecond {
			slowAtMost++
		}
	}
	t.Logf("quota.wait.duration: %d waits, %d of 50ms or more (%d to %d by the test's clock), %.4fs in all (%.4fs to %.4fs)",
		count, slow, slowAtLeast, slowAtMost, sum, least.Seconds(), most.Seconds())
	if count != 5 || h.Unit != "s" {
		t.Errorf("quota.wait.duration: %d waits, unit %q; want 5 in s", count, h.Unit)
	}
	if slow < slowAtLeast || slow > slowAtMost || sum < least.Seconds() || sum > most.Seconds() {
		t.Errorf("quota.wait.duration: %d waits of 50ms or more, %.4fs in all; the calls took %d to %d, %v to %v",
			slow, sum, slowAtLeast, slowAtMost, least, most)
	}

	g := find(rm, "quota.limiter.mode")
	if g == nil {
		t.Fatal("no quota.limiter.mode")
	}
	for _, dp := range g.Data.(metricdata.Gauge[int64]).DataPoints {
		name, _ := dp.Attributes.Value(obs.AttrLimiter)
		mode, _ := dp.Attributes.Value(obs.AttrMode)
		if want := map[bool]int64{true: 1, false: 0}[mode.AsString() == "shared"]; dp.Value != want || name.AsString() != "geo" {
			t.Errorf("quota.limiter.mode{%s,%s} = %d, want %d", name.AsString(), mode.AsString(), dp.Value, want)
		}
	}
	for _, m := range []string{"quota.acquisitions", "quota.wait.duration"} {
		if hasAttr(find(rm, m), obs.AttrKey) {
			t.Errorf("%s carries quota.key without WithMetricKeys", m)
		}
	}
}

func TestMetricKeys(t *testing.T) {
	tel := newTelemetry(t)
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	l := NewLimiter(rdb, append(tel.options(), WithMetricKeys())...)
	if err := l.Wait(context.Background(), "api.example.com", PerSecond(10)); err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	tel.reader.Collect(context.Background(), &rm)
	if !hasAttr(find(rm, "quota.acquisitions"), obs.AttrKey) {
		t.Error("quota.acquisitions lacks quota.key with WithMetricKeys")
	}
}

func hasAttr(m *metricdata.Metrics, key attribute.Key) bool {
	if m == nil {
		return false
	}
	var sets []attribute.Set
	switch d := m.Data.(type) {
	case metricdata.Sum[int64]:
		for _, dp := range d.DataPoints {
			sets = append(sets, dp.Attributes)
		}
	case metricdata.Histogram[float64]:
		for _, dp := range d.DataPoints {
			sets = append(sets, dp.Attributes)
		}
	}
	for _, s := range sets {
		if s.HasValue(key) {
			return true
		}
	}
	return false
}

func TestPauseSpan(t *testing.T) {
	tel := newTelemetry(t)
	_, rdb, _ := newMini(t)
	prov := answering(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "1")
		w.WriteHeader(http.StatusTooManyRequests)
	})
	tr := NewTransport(rdb, PerSecond(10), tel.transportOptions()...)
	ctx, caller := tel.tp.Tracer("test").Start(context.Background(), "caller")
	if err := getVia(t, tr, ctx, prov.URL, nil); err != nil {
		t.Fatal(err)
	}
	caller.End()
	var pause sdktrace.ReadOnlySpan
	for _, s := range tel.spans.Ended() {
		if s.Name() == "quota.pause" {
			pause = s
		}
	}
	if pause == nil || pause.Parent().SpanID() != caller.SpanContext().SpanID() || pause.Status().Code == codes.Error {
		t.Fatalf("no quota.pause span under the caller's span after a 429 with Retry-After: %v", pause)
	}
	if got := attrs(pause)["quota.pause.seconds"]; got.AsFloat64() != 1 {
		t.Errorf("quota.pause.seconds = %v, want the Retry-After of 1", got.String())
	}
}

func TestAllowSpans(t *testing.T) {
	tel := newTelemetry(t)
	_, rdb := limiterServer(t)
	l := NewLimiter(rdb, tel.options()...)
	ctx := context.Background()
	lim := Limit{Rate: 0.05, Burst: 1}
	l.Allow(ctx, "k", lim)
	l.Allow(ctx, "k", lim)
	spans := tel.waitSpans()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want 2", len(spans))
	}
	for i, want := range []struct{ outcome, errType string }{{"granted", ""}, {"refused", "would_wait"}} {
		a := attrs(spans[i])
		if a["quota.outcome"].AsString() != want.outcome || a["error.type"].AsString() != want.errType {
			t.Errorf("span %d: outcome %q error.type %q, want %+v", i, a["quota.outcome"].AsString(), a["error.type"].AsString(), want)
		}
		if _, ok := a["quota.dry_run"]; ok {
			t.Errorf("span %d carries quota.dry_run without WithDryRun", i)
		}
	}
}

func TestSlotTelemetry(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	tel := newTelemetry(t)
	l := NewLimiter(rdb, tel.options()...)
	ctx := context.Background()
	first, err := l.AcquireSlot(ctx, "seen", 1)
	if err != nil {
		t.Fatal(err)
	}
	var rm metricdata.ResourceMetrics
	tel.reader.Collect(ctx, &rm)
	if held := sumOf(rm, "quota.slots.held", []attribute.KeyValue{obs.AttrMode.String("shared")}); held != 1 {
		t.Errorf("quota.slots.held = %d while one is held, want 1", held)
	}
	go func() {
		// Released 300 ms after the second queued for it, so that it is
		// handed on however late a loaded machine sends the second's call.
		key, _ := bucketKey(DefaultPrefix, "seen")
		for start := time.Now(); time.Since(start) < 5*time.Second; time.Sleep(5 * time.Millisecond) {
			if n, _ := rdb.ZCard(ctx, key+slots.WaitingSuffix).Result(); n > 0 {
				break
			}
		}
		time.Sleep(300 * time.Millisecond)
		first.Release()
	}()
	second, err := l.AcquireSlot(ctx, "seen", 1)
	if err != nil {
		t.Fatal(err)
	}
	second.Release()
	spans := tel.waitSpans()
	if len(spans) != 2 {
		t.Fatalf("%d wait spans, want 2", len(spans))
	}
	a := attrs(spans[1])
	if w := a[obs.AttrSlotWait].AsFloat64(); w < 0.2 || a[obs.AttrSlots].AsInt64() != 1 {
		t.Errorf("the second span: slot wait %v s, slots %v; want about 0.3 s and 1", w, a[obs.AttrSlots].AsInt64())
	}
	eventually(t, 5*time.Second, "the gauge back to zero", func() bool {
		var rm metricdata.ResourceMetrics
		tel.reader.Collect(ctx, &rm)
		return sumOf(rm, "quota.slots.held", []attribute.KeyValue{obs.AttrMode.String("shared")}) == 0
	})
	rm = metricdata.ResourceMetrics{}
	tel.reader.Collect(ctx, &rm)
	if n := sumOf(rm, "quota.slot.events", []attribute.KeyValue{obs.AttrSlotEvent.String(obs.Handed)}); n != 1 {
		t.Errorf("%d slots handed, want 1: the second waited for the first's release", n)
	}
	if find(rm, "quota.slot.wait.duration") == nil {
		t.Error("no quota.slot.wait.duration")
	}
}

// TestSlotLingerTelemetry: a request cancelled after it was written keeps
// its slot for the linger, in the gauge as lingering, then lets it go.
func TestSlotLingerTelemetry(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	rdb := newServerClient(t)
	tel := newTelemetry(t)
	arrived := make(chan struct{}, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	}))
	defer srv.Close()
	const linger = 500 * time.Millisecond
	client := &http.Client{Transport: NewTransport(rdb, fastLimit, tel.transportOptions(WithConcurrency(1), WithSlotLinger(linger))...)}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-arrived
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL, nil)
	if _, err := client.Do(req); err == nil {
		t.Fatal("want the cancellation")
	}
	cancelled := time.Now()
	lingering := func() int64 {
		var rm metricdata.ResourceMetrics
		tel.reader.Collect(context.Background(), &rm)
		return sumOf(rm, "quota.slots.held", []attribute.KeyValue{obs.AttrSlotState.String(obs.Lingering)})
	}
	if n := lingering(); n != 1 {
		t.Errorf("%d slots lingering after the cancel, want 1", n)
	}
	// The slot is still held: another request waits for it.
	req, _ = http.NewRequest("GET", srv.URL, nil)
	wctx, wcancel := context.WithTimeout(context.Background(), linger/5)
	defer wcancel()
	if _, err := client.Do(req.WithContext(wctx)); !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("a request during the linger: %v, want to wait for the slot", err)
	}
	eventually(t, 5*time.Second, "the lingering slot let go", func() bool { return lingering() == 0 })
	if d := time.Since(cancelled); d < linger {
		t.Errorf("let go %v after the cancel, want the linger, %v", d, linger)
	}
	var rm metricdata.ResourceMetrics
	tel.reader.Collect(context.Background(), &rm)
	if n := sumOf(rm, "quota.slot.events", []attribute.KeyValue{obs.AttrSlotEvent.String(obs.Lingered)}); n != 1 {
		t.Errorf("%d lingered events, want 1", n)
	}
}
