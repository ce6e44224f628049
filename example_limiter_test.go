package quota_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/standin"
	"github.com/sharedquota/quota/llm"
)

// Examples of the Limiter's own calls (limiter.go, concurrency.go,
// meter.go): Wait, Allow, WaitN, AcquireSlot and Reserve.

// A Limiter gates work that is not an HTTP request: here, mail through a
// relay that takes six a minute, three at once.
func ExampleLimiter_Wait() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()

	// README:
	l := quota.NewLimiter(rdb)
	relay := quota.Limit{Rate: 6.0 / 60, Burst: 3} // six a minute, three at once

	for mail := 1; mail <= 4; mail++ {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		err := l.Wait(ctx, "smtp-relay", relay)
		cancel()
		if err != nil {
			// The wait would pass the deadline, or Redis is unavailable.
			fmt.Printf("mail %d: %v\n", mail, err)
			continue
		}
		fmt.Printf("mail %d: sent\n", mail) // send the mail
	}
	// end README

	// Output:
	// mail 1: sent
	// mail 2: sent
	// mail 3: sent
	// mail 4: quota: wait would exceed the context deadline: "smtp-relay" needs 10s
}

// A caller that would rather do something else than wait takes a token
// only if there is one now.
func ExampleLimiter_Allow() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	l := quota.NewLimiter(rdb)
	errBusy := errors.New("busy: try later")

	sample := func(ctx context.Context) error {
		// README:
		ok, err := l.Allow(ctx, "metrics-api", quota.Limit{Rate: 1, Burst: 2})
		if err != nil {
			return err // invalid input, or Redis unavailable under FailClosed
		}
		if !ok {
			return errBusy // nothing was taken
		}
		// end README
		return nil // send the sample
	}
	for i := 1; i <= 3; i++ {
		fmt.Printf("sample %d: %v\n", i, sample(context.Background()))
	}
	// Output:
	// sample 1: <nil>
	// sample 2: <nil>
	// sample 3: busy: try later
}

// A bucket can obey several Limits at once: every call takes its tokens
// from all of them or from none.
func ExampleLimiter_WaitN() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	l := quota.NewLimiter(rdb)
	ctx := context.Background()

	// README:
	// 3 tokens of the bucket "geocoder", which obeys 10 a second and 300 a minute.
	err := l.WaitN(ctx, "geocoder", 3, quota.PerSecond(10), quota.PerMinute(300))
	// end README
	if err != nil {
		log.Fatal(err)
	}
	st, err := l.Status(ctx, "geocoder")
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s: %g of %g tokens left in the first layer\n", st.Limit, st.Tokens, st.Limit.Burst)
	// Output: 10/s burst 30: 27 of 30 tokens left in the first layer
}

// At most four jobs of a batch API run at once across the fleet.
func ExampleLimiter_AcquireSlot() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	l := quota.NewLimiter(rdb)
	running, finish := make(chan struct{}, 8), make(chan struct{})

	job := func(ctx context.Context) error {
		// README:
		slot, err := l.AcquireSlot(ctx, "batch-api", 4)
		if err != nil {
			return err // ctx ended first, or Redis unavailable under FailClosed
		}
		defer slot.Release()
		// end README
		running <- struct{}{}
		<-finish // the job runs until the example lets it finish
		return nil
	}

	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() { job(context.Background()) })
	}
	for range 4 {
		<-running
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	fmt.Println("a fifth job while four run:", job(ctx))
	cancel()
	close(finish)
	wg.Wait()
	fmt.Println("a sixth job once they finished:", job(context.Background()))
	// Output:
	// a fifth job while four run: context deadline exceeded
	// a sixth job once they finished: <nil>
}

// Work that is not an http.Request reserves its amount of each limit and
// settles with what it used.
func ExampleLimiter_Reserve() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	l := quota.NewLimiter(rdb)
	ctx := context.Background()

	// README:
	meters := []quota.Meter{
		{Name: quota.MeterRequests, Limit: quota.PerMinute(50)},
		{Name: llm.MeterInputTokens, Limit: llm.PerMinute(40000)},
		{Name: llm.MeterOutputTokens, Limit: llm.PerMinute(8000)},
	}
	r, err := l.Reserve(ctx, "anthropic", meters, quota.Usage{
		quota.MeterRequests: 1, llm.MeterInputTokens: 1200, llm.MeterOutputTokens: 1024,
	})
	if err != nil {
		return // ctx ended first, or Redis is unavailable under FailClosed
	}
	// ... call the API ...
	r.Settle(quota.Usage{llm.MeterInputTokens: 1187, llm.MeterOutputTokens: 311})
	// end README

	if err := l.Flush(ctx); err != nil { // the settle, before the process exits
		log.Fatal(err)
	}
	fmt.Println("reserved", r.Reserved()[llm.MeterOutputTokens], "output tokens, settled with 311")
	// Output: reserved 1024 output tokens, settled with 311
}

// A daily quota refills all at once at a time of day in a zone, beside
// the bucket's rate, in the same call.
func ExampleDaily() {
	redisServer := standin.Redis()
	defer redisServer.Close()
	rdb := standin.Client(redisServer)
	defer rdb.Close()
	// The stand-in's clock stands still: the Limiter's reads it too.
	l := quota.NewLimiter(rdb, quota.WithClock(func() time.Time { return time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC) }))
	ctx := context.Background()

	// README:
	// 10 requests a second, and 2 a day, which refill at midnight Pacific time.
	pacific, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		log.Fatal(err)
	}
	day := quota.Daily(2, 0, pacific)
	for range 3 {
		ok, err := l.AllowN(ctx, "gemini", 1, quota.PerSecond(10), day)
		fmt.Println(ok, err)
	}
	// end README
	fmt.Println(day)
	// Output:
	// true <nil>
	// true <nil>
	// false <nil>
	// 2 a day from 00:00 America/Los_Angeles
}
