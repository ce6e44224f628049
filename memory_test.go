package quota

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// A flood of requests to distinct hosts leaves one small key per host and
// its control record, and every key expires once its bucket is full again
// (the record 10 s after its last read at most).
func TestFloodOfHostsExpires(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	rdb, admin := srv.Client(t), srv.Client(t)
	ctx := context.Background()
	l := NewLimiter(rdb)

	// One idle bucket at the default burst, measured alone.
	if err := l.Wait(ctx, "api.example.com", PerMinute(300)); err != nil {
		t.Fatal(err)
	}
	usage, err := admin.MemoryUsage(ctx, "quota:{api.example.com}").Result()
	if err != nil {
		t.Fatal(err)
	}
	before := usedMemory(t, admin)

	const hosts = 5_000
	lim := Limit{Rate: 0.25, Burst: 1} // full again, and gone, 4s after a take
	names := make(chan string, 1024)
	var wg sync.WaitGroup
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for name := range names {
				if err := l.Wait(ctx, name, lim); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	start := time.Now()
	for i := range hosts {
		names <- fmt.Sprintf("host-%06d.example.com", i)
	}
	close(names)
	wg.Wait()
	took := time.Since(start)

	keys, expires := keyspace(t, admin)
	perKey := float64(usedMemory(t, admin)-before) / float64(keys)
	t.Logf("%d hosts in %v: %d keys, %d with an expiry; MEMORY USAGE of an idle bucket %d bytes, about %.0f bytes per key in used_memory",
		hosts, took.Round(time.Millisecond), keys, expires, usage, perKey)
	// A bucket's key, and its control record while it is in use, for
	// each host and for the bucket measured alone.
	if keys > 2*(hosts+1) || expires != keys {
		t.Errorf("%d keys, %d with an expiry, after %d hosts: want at most two per host, all expiring", keys, expires, hosts)
	}
	if usage > 128 {
		t.Errorf("an idle bucket takes %d bytes, want a small key", usage)
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		n, err := admin.DBSize(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Logf("all keys gone %v after the flood", time.Since(start.Add(took)).Round(time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d keys left 20s after the flood", n)
		}
	}
}

var keyspaceRE = regexp.MustCompile(`db0:keys=(\d+),expires=(\d+)`)

// keyspace returns the number of keys and of keys with an expiry.
func keyspace(t *testing.T, rdb *redis.Client) (keys, expires int64) {
	t.Helper()
	info, err := rdb.Info(context.Background(), "keyspace").Result()
	if err != nil {
		t.Fatal(err)
	}
	m := keyspaceRE.FindStringSubmatch(info)
	if m == nil {
		return 0, 0
	}
	keys, _ = strconv.ParseInt(m[1], 10, 64)
	expires, _ = strconv.ParseInt(m[2], 10, 64)
	return keys, expires
}

var usedMemoryRE = regexp.MustCompile(`used_memory:(\d+)`)

// usedMemory returns the server's used_memory in bytes.
func usedMemory(t *testing.T, rdb *redis.Client) int64 {
	t.Helper()
	info, err := rdb.Info(context.Background(), "memory").Result()
	if err != nil {
		t.Fatal(err)
	}
	m := usedMemoryRE.FindStringSubmatch(info)
	if m == nil {
		t.Fatal("no used_memory in INFO memory")
	}
	n, _ := strconv.ParseInt(m[1], 10, 64)
	return n
}
