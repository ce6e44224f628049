package quota_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
)

// Examples of the operator's calls (operate.go).

// An operator lowers a bucket's Limit and pauses it for the whole fleet,
// then lifts both.
func ExampleLimiter_SetLimit() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	ctx := context.Background()
	worker := quota.NewLimiter(rdb) // a worker of the fleet, at 100/s
	if err := worker.Wait(ctx, "api.example.com", quota.PerSecond(100)); err != nil {
		log.Fatal(err)
	}

	// README:
	l := quota.NewLimiter(rdb)
	// 20 a second, burst 5, for every Limiter of the fleet, within a second.
	if err := l.SetLimit(ctx, "api.example.com", quota.Limit{Rate: 20, Burst: 5}); err != nil {
		log.Fatal(err)
	}
	// The kill switch: no grant for ten minutes, grants already queued included.
	if err := l.Pause(ctx, "api.example.com", 10*time.Minute); err != nil {
		log.Fatal(err)
	}
	st, err := l.Status(ctx, "api.example.com")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(st.Limit, "paused by", st.PausedBy, "until", st.PausedUntil.UTC().Format(time.RFC3339))
	// end README

	ok, _ := worker.Allow(ctx, "api.example.com", quota.PerSecond(100))
	fmt.Println("a worker's Allow during the pause:", ok)

	// README:
	// Back to the Limit the callers pass, and no pause.
	if err := l.ClearLimit(ctx, "api.example.com"); err != nil {
		log.Fatal(err)
	}
	if err := l.Resume(ctx, "api.example.com"); err != nil {
		log.Fatal(err)
	}
	// end README

	st, err = l.Status(ctx, "api.example.com")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(st.Limit, "paused:", st.Paused)
	// Output:
	// 20/s burst 5 paused by operator until 2026-01-01T00:10:00Z
	// a worker's Allow during the pause: false
	// 100/s burst 300 paused: false
}
