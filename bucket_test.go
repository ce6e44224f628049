package quota

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of a bucket's keys in Redis (bucket.go): the key a name maps to and
// its Cluster hash tag, keys that expire once their bucket is full again,
// and a bucket that Redis forgot, which starts full.

func TestRedisKey(t *testing.T) {
	_, rdb, _ := newMini(t)
	l := NewLimiter(rdb)
	if k, _ := bucketKey(l.cfg.prefix, "api.example.com"); k != "quota:{api.example.com}" {
		t.Errorf("redisKey = %q", k)
	}
	if k, _ := bucketKey(NewLimiter(rdb, WithPrefix("acme:rl:")).cfg.prefix, "a"); k != "acme:rl:{a}" {
		t.Errorf("redisKey with prefix = %q", k)
	}
	if _, err := bucketKey(l.cfg.prefix, ""); !errors.Is(err, ErrInvalidKey) {
		t.Errorf("empty name: err = %v, want ErrInvalidKey", err)
	}
	long1, long2 := strings.Repeat("a", 10_000)+"1", strings.Repeat("a", 10_000)+"2"
	k1, _ := bucketKey(l.cfg.prefix, long1)
	k2, _ := bucketKey(l.cfg.prefix, long2)
	if k1 == k2 {
		t.Error("two long names share a key")
	}
	if want := len("quota:{}") + store.MaxNameLen + 1; len(k1) != want {
		t.Errorf("long name: key of %d bytes, want %d", len(k1), want)
	}
	if k, _ := bucketKey(l.cfg.prefix, long1); k != k1 {
		t.Error("a long name's key is not stable")
	}
	// A name of store.MaxNameLen bytes in the shortened form of a long name's
	// (its prefix, "~" and the digest) keeps a key of its own.
	sum := sha256.Sum256([]byte(long1))
	digest := hex.EncodeToString(sum[:8])
	for _, lookalike := range []string{
		long1[:store.MaxNameLen-len(digest)-1] + "~" + digest,
		long1[:store.MaxNameLen-len(digest)] + "~" + digest,
		strings.TrimSuffix(strings.TrimPrefix(k1, "quota:{"), "}"),
	} {
		if k, _ := bucketKey(l.cfg.prefix, lookalike); k == k1 {
			t.Errorf("the name %q shares the key of a long name", lookalike)
		}
	}
	// A name that begins with "}" keeps a hash tag, which every key of
	// its bucket shares; so does one that begins with "%", under another
	// key.
	seen := map[string]string{}
	for _, name := range []string{"}", "}a", "%}a", "%", "%%", "a}", "{", "}}"} {
		k, err := bucketKey(l.cfg.prefix, name)
		if err != nil {
			t.Fatal(err)
		}
		if tag := hashTag(k); tag == "" || hashTag(k+control.Suffix) != tag || hashTag(k+slots.QueueSuffix) != tag {
			t.Errorf("name %q: key %q, hash tag %q", name, k, tag)
		}
		if other, ok := seen[k]; ok {
			t.Errorf("names %q and %q share the key %q", other, name, k)
		}
		seen[k] = name
	}
}

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

func TestFaultRestartedEmptyStartsFull(t *testing.T) {
	srv := redistest.Start(t)
	ws := newWorkers(t, 1, srv.Addr(), Limit{Rate: 1, Burst: 5}, FailClosed, nil)
	l, ctx := ws[0].tr.Limiter(), context.Background()
	lim := Limit{Rate: 1, Burst: 5}
	if err := l.WaitN(ctx, "empty", 5, lim); err != nil {
		t.Fatal(err)
	}
	srv.Kill()
	srv.Restart()
	// The bucket was empty before the restart; Redis forgot it, and it
	// releases a whole burst at once. (The first call may find a connection
	// of the old server and trip the breaker: then ask again once the
	// shared bucket is back.)
	for {
		short, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		start := time.Now()
		err := l.WaitN(short, "empty", 5, lim)
		cancel()
		if errors.Is(err, ErrUnavailable) {
			waitForMode(t, l, ModeShared, 3*time.Second)
			continue
		}
		if err != nil {
			t.Fatalf("a burst of 5 after the restart: %v", err)
		}
		t.Logf("a full burst of 5 granted in %v after the restart", time.Since(start))
		break
	}
}
