package quota

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/faultproxy"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of why RedisOptions never retries a command (redisopts.go): a take
// whose reply is lost leaves its tokens taken, and each retry of it can
// take them again.

// A reply lost after the script ran (a read timeout) leaves its tokens
// taken: the bucket under-issues, never over-issues. go-redis retries a
// timed-out read MaxRetries times, and each retry can take them again.
func TestFaultLostReply(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	for _, tc := range []struct {
		retries int
		taken   int // tokens the lost reply costs
		fails   bool
	}{
		{retries: -1, taken: 1, fails: true},
		{retries: 3, taken: 2, fails: false}, // the retry's reply arrives
	} {
		srv := redistest.Start(t)
		admin := srv.Client(t)
		proxy := faultproxy.New(t, srv.Addr())
		ws := newWorkers(t, 1, proxy.Addr(), Limit{Rate: 1, Burst: 10}, FailClosed, func(o *redis.Options) {
			o.MaxRetries = tc.retries
			o.ReadTimeout = 200 * time.Millisecond
		})
		l, ctx := ws[0].tr.Limiter(), context.Background()
		lim := Limit{Rate: 1, Burst: 10}
		if err := l.Wait(ctx, "lost", lim); err != nil {
			t.Fatal(err)
		}
		// Once it listens, the Limiter reads the record again, in the
		// background, for what it may have missed: let that read land, so
		// that the reply dropped is the take's.
		<-l.events.Ready()
		listening := l.events.Since()
		e := l.controls.Lookup("quota:{lost}")
		eventually(t, 5*time.Second, "the read after listening", func() bool {
			return !e.Reading() && e.Load().ReadAt().After(listening)
		})
		before, _ := admin.Get(ctx, "quota:{lost}").Float64()
		proxy.DropNextReplies(1)
		err := l.Wait(ctx, "lost", lim)
		after, _ := admin.Get(ctx, "quota:{lost}").Float64()
		taken := (after - before) / 1e6 // one token is a second of refill
		t.Logf("MaxRetries %d: Wait returned %v; the bucket lost %.3f tokens", tc.retries, err, taken)
		if tc.fails != (err != nil) {
			t.Errorf("MaxRetries %d: err = %v", tc.retries, err)
		}
		if taken < float64(tc.taken)-0.001 || taken > float64(tc.taken)+0.001 {
			t.Errorf("MaxRetries %d: a lost reply took %.3f tokens, want %d", tc.retries, taken, tc.taken)
		}
	}
}
