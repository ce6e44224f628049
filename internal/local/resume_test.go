package local

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
)

// A Limiter that finds Redis after the fleet resumed, its probe held by a
// hung connection, resumes at once: it does not record an instant of its
// own, which would send the fleet back to its local shares until then.
func TestLateLimiterResumesAtOnce(t *testing.T) {
	m := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: m.Addr()})
	t.Cleanup(func() { rdb.Close() })
	r := NewResume(rdb, "quota:")
	ctx := context.Background()
	const delay = 750 * time.Millisecond
	t0 := time.Now()
	us := func(t time.Time) string { return strconv.FormatInt(t.UnixMicro(), 10) }

	d, at, err := r.In(ctx, delay, us(t0))
	if err != nil || d != delay || at != t0.Add(delay).UnixMicro() {
		t.Fatalf("the first to find Redis: %v, %d, %v; want %v and its instant", d, at, err, delay)
	}
	d2, at2, err := r.In(ctx, delay, us(t0.Add(delay/3)))
	if err != nil || at2 != at || d2 != delay-delay/3 {
		t.Errorf("the second, %v later: %v, %d, %v; want the same instant, %v ahead", delay/3, d2, at2, err, delay-delay/3)
	}
	// The slowest: its probe hung for ProbeTimeout, then backed off.
	late := delay + resumeLinger - 100*time.Millisecond
	m.FastForward(late)
	d3, at3, err := r.In(ctx, delay, us(t0.Add(late)))
	if err != nil || d3 != 0 || at3 != at {
		t.Errorf("a Limiter that finds Redis %v after the first: %v, %d, %v; want 0 and the fleet's instant %d", late, d3, at3, err, at)
	}
	// Long after, an outage is a new one: its first Limiter records anew.
	m.FastForward(200 * time.Millisecond)
	later := t0.Add(late + 200*time.Millisecond)
	if d4, at4, err := r.In(ctx, delay, us(later)); err != nil || d4 != delay || at4 != later.Add(delay).UnixMicro() {
		t.Errorf("after the instant expired: %v, %d, %v; want a new instant %v ahead", d4, at4, err, delay)
	}
}
