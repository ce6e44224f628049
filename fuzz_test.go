package quota

import (
	"context"
	"net/http"
	"net/url"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Fuzz tests of the key functions (keyfunc.go, bucket.go) and of the script
// (internal/store) on a real redis-server.

// FuzzKeys feeds arbitrary URLs, Host headers and region headers to the
// key functions: none may panic, and no Redis key may pass the bound.
func FuzzKeys(f *testing.F) {
	f.Add("https://api.example.com/v1", "", "eu")
	f.Add("http://[::1]:80/", "API.EXAMPLE.COM.", "")
	f.Add("https://a:443", "a:80", "{x}")
	f.Add("https:///path", "\x00\xff", "eu/west")
	mr := miniredis.RunT(f)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer rdb.Close()
	l := NewLimiter(rdb)
	maxKey := len(DefaultPrefix) + len("{}") + store.MaxNameLen + 2 // shortened, and escaped
	keyFuncs := []KeyFunc{Host, Join(Host, Header("X-Region")), Join(Fixed("acct"), Host, Header("X-Region"))}

	f.Fuzz(func(t *testing.T, rawURL, host, region string) {
		u, err := url.Parse(rawURL)
		if err != nil {
			return
		}
		req := &http.Request{URL: u, Host: host, Header: http.Header{"X-Region": {region}}}
		for _, kf := range keyFuncs {
			name, err := kf(req)
			if err != nil {
				continue
			}
			if name == "" {
				t.Fatalf("empty name without an error for %q %q %q", rawURL, host, region)
			}
			key, err := bucketKey(l.cfg.prefix, name)
			if err != nil {
				t.Fatalf("redisKey(%q): %v", name, err)
			}
			if len(key) > maxKey {
				t.Fatalf("key of %d bytes, bound %d", len(key), maxKey)
			}
			if tag := hashTag(key); tag == "" || hashTag(key+control.Suffix) != tag {
				t.Fatalf("key %q: hash tag %q, its record's %q", key, tag, hashTag(key+control.Suffix))
			}
		}
	})
}

// FuzzScript runs the script on a real redis-server with every Limit, token
// count and wait the API accepts: the script must never fail, and its reply
// must keep its contract.
func FuzzScript(f *testing.F) {
	for _, seed := range []struct{ rate, burst, n float64 }{
		{10, 5, 1}, {1e-6, 0, 1}, {1e9, 1e9, 1e9}, {0.1, 1, 1}, {3, 2, 2},
		{1e300, 1, 1}, {1e-300, 1e-300, 1e-300}, {5, 0, 15}, {1, 1e6, 0.5},
	} {
		f.Add(seed.rate, seed.burst, seed.n, int64(time.Second))
	}
	rdb := redistest.Start(f).Client(f)
	l := NewLimiter(rdb)
	ctx := context.Background()

	f.Fuzz(func(t *testing.T, rate, burst, n float64, maxWait int64) {
		lim, err := Limit{Rate: rate, Burst: burst}.resolve()
		if err != nil || lim.checkTokens("fuzz", n) != nil {
			return // the API refuses these before Redis
		}
		maxWait = min(max(maxWait, 0), int64(time.Hour)) / 1000
		for _, key := range []string{"quota:{fuzz}", "quota:{fuzz-" + lim.String() + "}"} {
			r, err := l.store.Take(ctx, oneLayer(key, lim), store.Tokens(n), time.Duration(maxWait)*time.Microsecond)
			if err != nil {
				t.Fatalf("take %v of %v, max wait %dus: %v", n, lim, maxWait, err)
			}
			if r.Wait < 0 || (r.Granted() && r.Wait.Microseconds() > maxWait) {
				t.Fatalf("take %v of %v, max wait %dus: reply %+v", n, lim, maxWait, r)
			}
			if err := l.store.Refund(ctx, oneLayer(key, lim), store.Tokens(n), r.Tats); err != nil {
				t.Fatalf("refund %v of %v: %v", n, lim, err)
			}
		}
	})
}
