package main

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// fleet is goroutines of the test taking from buckets through one
// Limiter, each grant counted when its Wait returns.
type fleet struct {
	l      *quota.Limiter
	ctx    context.Context
	wg     sync.WaitGroup
	mu     sync.Mutex
	grants map[string][]time.Time
}

// startFleet starts a fleet on rdb; it stops when the test ends, before
// the servers do.
func startFleet(t *testing.T, rdb redis.UniversalClient) *fleet {
	ctx, cancel := context.WithCancel(context.Background())
	f := &fleet{
		l:      quota.NewLimiter(rdb, quota.WithLogger(slog.New(slog.DiscardHandler))),
		ctx:    ctx,
		grants: map[string][]time.Time{},
	}
	t.Cleanup(func() { cancel(); f.wg.Wait() })
	return f
}

// take runs workers goroutines that Wait on the bucket called name in a
// loop, holding one of its slots, of slots, for hold, when slots > 0.
func (f *fleet) take(name string, workers int, lim quota.Limit, slots int, hold time.Duration) {
	for range workers {
		f.wg.Go(func() {
			for f.ctx.Err() == nil {
				var slot *quota.Slot
				if slots > 0 {
					s, err := f.l.AcquireSlot(f.ctx, name, slots)
					if err != nil {
						continue
					}
					slot = s
				}
				if f.l.Wait(f.ctx, name, lim) == nil {
					f.mu.Lock()
					f.grants[name] = append(f.grants[name], time.Now())
					f.mu.Unlock()
				}
				if slot != nil {
					select {
					case <-time.After(hold):
					case <-f.ctx.Done():
					}
					slot.Release()
				}
			}
		})
	}
}

// count returns the grants of the bucket called name in (from, to].
func (f *fleet) count(name string, from, to time.Time) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for _, at := range f.grants[name] {
		if at.After(from) && !at.After(to) {
			n++
		}
	}
	return n
}

// waitGrants waits until the fleet has had a grant of each bucket named,
// or fails the test after screenWait.
func (f *fleet) waitGrants(t *testing.T, names ...string) {
	t.Helper()
	deadline := time.Now().Add(screenWait)
	for _, n := range names {
		for f.count(n, time.Time{}, time.Now()) == 0 {
			if time.Now().After(deadline) {
				t.Fatalf("no grant of %s in %v", n, screenWait)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
}

// TestTopCluster: on a Cluster, top finds the buckets on every master and
// reads each from its own, from the nodes' list as from one node.
func TestTopCluster(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	tmux := needTmux(t)
	bin := buildQuotactl(t)
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	f := startFleet(t, c.Client(t))
	names := []string{"a", "b", "c", "d", "e", "f"}
	masters := map[string]bool{}
	for _, n := range names {
		f.take(n, 1, quota.PerSecond(10), 0, 0) // busy: an idle bucket's keys lapse
		masters[c.MasterFor(bucketKey(quota.DefaultPrefix, n)).Addr()] = true
	}
	if len(masters) < 2 {
		t.Fatalf("the buckets are on %d master(s); want them on two or more", len(masters))
	}
	f.waitGrants(t, names...)
	if err := f.l.Pause(ctx, "e", time.Minute); err != nil {
		t.Fatal(err)
	}
	target, err := parseTarget(strings.Join(c.Addrs(), ","), func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	rdb, err := connect(ctx, target)
	if err != nil {
		t.Fatal(err)
	}
	defer rdb.Close()
	msg := fetch(ctx, redisSource(rdb, quota.DefaultPrefix), true, nil, "")
	if msg.scanErr != nil || msg.readErr != nil || !slices.Equal(msg.names, names) {
		t.Fatalf("fetch on the Cluster: names %v, errors %v, %v; want %v", msg.names, msg.scanErr, msg.readErr, names)
	}
	for _, n := range names {
		b := msg.buckets[n]
		if len(b.Layers) != 1 || b.Layers[0].Rate != 10 || len(b.Limiters) != 1 || b.Paused != (n == "e") {
			t.Errorf("bucket %s read %+v; want one layer of 10/s, one Limiter, paused only if e", n, b)
		}
	}

	// The command, given one node, as redis-cli -c takes it.
	p := startPane(t, tmux, bin, "-redis", c.Addrs()[0], "top")
	p.waitFor("the six buckets, e paused", func(s string) bool {
		for _, n := range names {
			if rowOf(s, n) == "" {
				return false
			}
		}
		return strings.Contains(s, "6 buckets") && strings.Contains(rowOf(s, "e"), "by operator")
	})
	p.keys("q")
	if code := p.exited(2 * time.Second); code != 0 {
		t.Errorf("exit %d on q; want 0", code)
	}
}
