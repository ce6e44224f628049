// Package standin holds the stand-ins the packages' runnable examples
// run against, so that they print the same every time: for the fleet's
// Redis, a miniredis whose clock stands still; for the provider, a
// function that answers every request sent through http.DefaultTransport,
// without a network. Only tests import it.
package standin

import (
	"log"
	"net/http"
	"net/http/httptest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
)

// Redis starts a stand-in for the fleet's Redis.
func Redis() *miniredis.Miniredis {
	mr, err := miniredis.Run()
	if err != nil {
		log.Fatal(err)
	}
	mr.SetTime(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	return mr
}

// Client returns a client of the stand-in Redis with the options of
// quota.RedisOptions, but timeouts long enough that a loaded test machine
// does not pass for an outage.
func Client(mr *miniredis.Miniredis) *redis.Client {
	o := quota.RedisOptions(mr.Addr())
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 5*time.Second, 5*time.Second, 5*time.Second, 5*time.Second
	return redis.NewClient(o)
}

// roundTripFunc is an http.RoundTripper made of a function.
type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// Provider makes answer reply to every request sent through
// http.DefaultTransport, the base RoundTripper of a Transport without
// WithBase, until the returned function restores it. The Transport must be
// made after the call.
func Provider(answer func(w http.ResponseWriter, r *http.Request)) (restore func()) {
	saved := http.DefaultTransport
	http.DefaultTransport = roundTripFunc(func(r *http.Request) (*http.Response, error) {
		w := httptest.NewRecorder()
		answer(w, r)
		resp := w.Result()
		resp.Request = r
		return resp, nil
	})
	return func() { http.DefaultTransport = saved }
}
