package status_test

import (
	"context"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/status"
)

func TestMain(m *testing.M) { os.Exit(redistest.Main(m)) }

// perSecond counts events by the second they happened in.
type perSecond struct {
	mu sync.Mutex
	n  map[int64]float64
}

func (p *perSecond) add(at time.Time, n float64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[int64]float64{}
	}
	p.n[at.Unix()] += n
}

// window returns the count of the n seconds that ended at until.
func (p *perSecond) window(until time.Time, n int) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	sum := 0.0
	for s := until.Unix() - int64(n); s < until.Unix(); s++ {
		sum += p.n[s]
	}
	return sum
}

// The rate a bucket reports is what its callers went on, second by
// second, across Limiters that start and stop apart: within 10% of their
// own count over the last five seconds, and over each of them.
func TestRateIsWhatTheFleetWentOn(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	lim := quota.PerSecond(60)
	var count perSecond
	var wg sync.WaitGroup
	// A worker that stops leaves its last grants to the reporter, which
	// tells them within a second or two; one that Flushes, at once.
	worker := func(start, stop time.Duration, flush bool) {
		defer wg.Done()
		rdb := srv.Client(t)
		l := quota.NewLimiter(rdb)
		time.Sleep(start)
		end := time.Now().Add(stop - start)
		for time.Now().Before(end) && ctx.Err() == nil {
			if err := l.Wait(ctx, "api", lim); err != nil {
				return
			}
			count.add(time.Now(), 1)
		}
		if !flush {
			return
		}
		fctx, fcancel := context.WithTimeout(context.Background(), 2*time.Second)
		defer fcancel()
		if err := l.Flush(fctx); err != nil {
			t.Error(err)
		}
	}
	wg.Add(3)
	go worker(0, 9*time.Second, true)
	go worker(0, 5*time.Second, false)
	go worker(2*time.Second, 9*time.Second, true)
	time.Sleep(8 * time.Second)
	rdb := srv.Client(t)
	b, err := status.Read(ctx, rdb, quota.DefaultPrefix, "api")
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	wg.Wait()
	if len(b.Layers) != 1 {
		t.Fatalf("%d layers, want 1: %+v", len(b.Layers), b)
	}
	l := b.Layers[0]
	if len(l.Granted) != status.History {
		t.Fatalf("%d seconds of grants, want %d", len(l.Granted), status.History)
	}
	reported, counted := 5*l.PerSecond(5), count.window(l.GrantedUntil, 5)
	t.Logf("the last five seconds to %v: reported %v, counted %v; by second %v", l.GrantedUntil.Format("15:04:05"), reported, counted, l.Granted[status.History-8:])
	if counted < 150 || math.Abs(reported-counted) > 0.1*counted {
		t.Errorf("reported %v granted in five seconds, the callers counted %v", reported, counted)
	}
	for i, g := range l.Granted[status.History-5:] {
		until := l.GrantedUntil.Add(time.Duration(i-4) * time.Second)
		if c := count.window(until, 1); math.Abs(g-c) > 0.1*c+2 {
			t.Errorf("the second to %v: reported %v, counted %v", until.Format("15:04:05"), g, c)
		}
	}
}

// Status tells every layer of a metered bucket, its tenants, its
// classes, its slots and its pause.
func TestWholeBucket(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel() // before the client closes
	rdb := srv.Client(t)
	l := quota.NewLimiter(rdb, quota.WithTenants(quota.Tenants{Weights: map[string]float64{"gold": 3}}))
	meters := []quota.Meter{
		{Name: quota.MeterRequests, Limit: quota.PerSecond(100)},
		{Name: "input_tokens", Limit: quota.Limit{Rate: 1000, Burst: 2000}},
	}
	tctx := quota.ContextWithTenant(ctx, "gold")
	begun := time.Now()
	for range 3 {
		r, err := l.Reserve(tctx, "llm", meters, quota.Usage{"requests": 1, "input_tokens": 500})
		if err != nil {
			t.Fatal(err)
		}
		r.Settle(quota.Usage{"requests": 1, "input_tokens": 600})
	}
	if _, err := l.Reserve(quota.ContextWithTenant(ctx, "free"), "llm", meters, quota.Usage{"requests": 1, "input_tokens": 100}); err != nil {
		t.Fatal(err)
	}
	if err := l.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	b := read(t, rdb, "llm")
	if len(b.Layers) != 2 || b.Layers[0].Meter != "requests" || b.Layers[1].Meter != "input_tokens" ||
		b.Layers[1].Rate != 1000 || b.Layers[1].Burst != 2000 {
		t.Fatalf("layers %+v", b.Layers)
	}
	// What refilled since the first take, at 1,000 a second, is held too.
	refilled := 1000 * time.Since(begun).Seconds()
	if tok := b.Layers[1].Tokens; tok > 2000-1900+refilled+1 || tok < 2000-1900-1 {
		t.Errorf("input_tokens holds %v, want 100 after 1,900 taken, and at most the %.0f refilled since", tok, refilled)
	}
	if len(b.Tenants) != 2 || b.Tenants[0].Name != "free" || b.Tenants[1].Name != "gold" || b.Tenants[1].Weight != 3 ||
		b.Tenants[1].Granted != 3 || math.Abs(b.Tenants[1].Share-0.75) > 1e-9 {
		t.Errorf("tenants %+v", b.Tenants)
	}
	if len(b.Limiters) != 1 {
		t.Errorf("Limiters %v, want one", b.Limiters)
	}

	// A slot held, one queued, a class pushed, a pause, an override.
	s1, err := l.AcquireSlot(ctx, "slots", 1)
	if err != nil {
		t.Fatal(err)
	}
	queued := make(chan error, 1)
	qctx, qcancel := context.WithCancel(ctx)
	go func() {
		s, err := l.AcquireSlot(qctx, "slots", 1)
		if err == nil {
			s.Release()
		}
		queued <- err
	}()
	// The classes' Limiter keeps no tenants, which keep the queue short.
	cl := quota.NewLimiter(rdb)
	slow := quota.Limit{Rate: 1, Burst: 1}
	for range 3 {
		if _, err := cl.AllowN(ctx, "classes", 1, slow); err != nil {
			t.Fatal(err)
		}
	}
	if err := cl.SetLimit(ctx, "classes", quota.Limit{Rate: 2, Burst: 2}); err != nil {
		t.Fatal(err)
	}
	// Class 0 queues 4 s; a class 3 take pushes it.
	for range 8 {
		go func() {
			if err := cl.Wait(ctx, "classes", slow); err != nil && ctx.Err() == nil {
				t.Log(err)
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	hi, hcancel := context.WithCancel(quota.ContextWithPriority(ctx, 3))
	go func() { _ = cl.Wait(hi, "classes", slow) }()
	deadline := time.Now().Add(5 * time.Second)
	var sb status.Bucket
	for time.Now().Before(deadline) {
		sb = read(t, rdb, "slots")
		if sb.Slots.Held == 1 && sb.Slots.Waiting == 1 {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if sb.Slots != (status.Slots{Held: 1, Waiting: 1}) {
		t.Errorf("slots %+v, want 1 held and 1 waiting", sb.Slots)
	}
	qcancel()
	<-queued
	s1.Release()
	var cb status.Bucket
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if cb = read(t, rdb, "classes"); len(cb.Classes) > 1 {
			break
		}
	}
	hcancel()
	if len(cb.Layers) != 1 || !cb.Layers[0].Override || cb.Layers[0].Rate != 2 {
		t.Errorf("classes' layer %+v, want the override of 2/s", cb.Layers)
	}
	var pushed bool
	for _, c := range cb.Classes {
		pushed = pushed || c.Priority == 0 && c.Pushed > 0
	}
	if !pushed {
		t.Errorf("classes %+v: class 0 not pushed", cb.Classes)
	}
	if err := cl.Pause(ctx, "classes", time.Minute); err != nil {
		t.Fatal(err)
	}
	pb := read(t, rdb, "classes")
	if !pb.Paused || pb.PausedBy != "operator" || pb.PausedUntil.Sub(pb.Now) < 59*time.Second {
		t.Errorf("a pause of a minute read as %v %v %v", pb.Paused, pb.PausedBy, pb.PausedUntil.Sub(pb.Now))
	}
}

func read(t *testing.T, rdb redis.Cmdable, name string) status.Bucket {
	t.Helper()
	b, err := status.Read(context.Background(), rdb, quota.DefaultPrefix, name)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// A slot whose request was cancelled after it was sent lingers, and
// Status tells it within two seconds of its start and of its end.
func TestLingeringSlots(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	arrived := make(chan struct{}, 1)
	api := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	}))
	defer api.Close()
	const linger = 3 * time.Second
	tr := quota.NewTransport(rdb, quota.PerSecond(100), quota.WithKey(quota.Fixed("slots")),
		quota.WithConcurrency(2), quota.WithSlotLinger(linger))
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		<-arrived
		cancel()
	}()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, api.URL, nil)
	_, err := (&http.Client{Transport: tr}).Do(req)
	if err == nil {
		t.Fatal("want the cancellation")
	}
	cancelled := time.Now()
	until := func(what string, within time.Duration, ok func(status.Slots) bool) {
		t.Helper()
		var s status.Slots
		for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			if s = read(t, rdb, "slots").Slots; ok(s) {
				return
			}
		}
		t.Fatalf("slots %+v %v after the cancel; want %s", s, time.Since(cancelled).Round(time.Millisecond), what)
	}
	until("1 held, 1 lingering", 2*time.Second, func(s status.Slots) bool { return s.Held == 1 && s.Lingering == 1 })
	until("none held or lingering", linger+2*time.Second, func(s status.Slots) bool { return s.Held == 0 && s.Lingering == 0 })
	if d := time.Since(cancelled); d < linger {
		t.Errorf("the slot went %v after the cancel, before its linger of %v", d, linger)
	}
}

// The instant the fleet leaves its local shares after an outage shows
// while it is ahead, as the record holds it (core.lua's resume).
func TestResumesAt(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	l := quota.NewLimiter(rdb)
	if err := l.Wait(ctx, "api", quota.PerSecond(10)); err != nil {
		t.Fatal(err)
	}
	now := read(t, rdb, "api").Now
	for _, c := range []struct {
		at   time.Time
		want bool
	}{{now.Add(time.Minute), true}, {now.Add(-time.Second), false}} {
		if err := rdb.HSet(ctx, "quota:{api}:ctl", "resume", c.at.UnixMicro()).Err(); err != nil {
			t.Fatal(err)
		}
		if got := read(t, rdb, "api").ResumesAt; got.IsZero() == c.want || c.want && !got.Equal(c.at.Truncate(time.Microsecond)) {
			t.Errorf("a resume at %v read as %v", c.at, got)
		}
	}
}

// A daily layer (quota.Daily) reads as its count: what is used today, what
// is left, and when the day ends, in its zone.
func TestDailyLayer(t *testing.T) {
	t.Parallel()
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	la, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		t.Skip(err)
	}
	// Reset half a day from now, so that the takes and the read fall in
	// one day.
	reset := time.Now().In(la).Add(12 * time.Hour)
	at := time.Duration(reset.Hour())*time.Hour + time.Duration(reset.Minute())*time.Minute
	l := quota.NewLimiter(rdb)
	rate, day := quota.PerSecond(100), quota.Daily(5, at, la)
	for range 3 {
		if ok, err := l.AllowN(ctx, "api", 1, rate, day); !ok || err != nil {
			t.Fatalf("a take of a day of 5: %v, %v", ok, err)
		}
	}
	b := read(t, rdb, "api")
	if len(b.Layers) != 2 || b.Layers[1].Daily == nil {
		t.Fatalf("layers %+v, want the rate's and the day's", b.Layers)
	}
	d, l1 := b.Layers[1].Daily, b.Layers[1]
	t.Logf("the day's layer: %+v, %+v", l1, *d)
	if l1.Burst != 5 || l1.Tokens != 2 || l1.Queue != 0 || d.Used != 3 || d.Tomorrow != 0 || d.Reset != at || d.Zone != "America/Los_Angeles" {
		t.Errorf("a day of 5 with 3 taken reads %v tokens of %v, queue %v, %+v; want 2 of 5, 3 used, reset %v in America/Los_Angeles",
			l1.Tokens, l1.Burst, l1.Queue, *d, at)
	}
	if left := d.Ends.Sub(b.Now); d.Ends.In(la).Hour() != reset.Hour() || d.Ends.In(la).Minute() != reset.Minute() || left <= 11*time.Hour || left > 13*time.Hour {
		t.Errorf("the day ends at %v, %v from now; want at %02d:%02d, about 12 h from now", d.Ends.In(la), left, reset.Hour(), reset.Minute())
	}
	if b.Layers[0].Daily != nil {
		t.Errorf("the rate layer reads as daily: %+v", b.Layers[0])
	}
	// A day as the first layer, before a rate: the record tells it.
	for range 2 {
		if ok, err := l.AllowN(ctx, "first", 1, day, rate); !ok || err != nil {
			t.Fatalf("a take of a day of 5 first: %v, %v", ok, err)
		}
	}
	b = read(t, rdb, "first")
	if len(b.Layers) != 2 || b.Layers[0].Daily == nil || b.Layers[1].Daily != nil {
		t.Fatalf("layers %+v, want the day's and the rate's", b.Layers)
	}
	if d, l0 := b.Layers[0].Daily, b.Layers[0]; l0.Burst != 5 || l0.Tokens != 3 || d.Used != 2 || d.Reset != at || d.Zone != "America/Los_Angeles" {
		t.Errorf("a first day of 5 with 2 taken reads %v tokens of %v, %+v; want 3 of 5, 2 used, reset %v in America/Los_Angeles", l0.Tokens, l0.Burst, *d, at)
	}
}
