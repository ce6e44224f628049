package quota_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"time"

	"github.com/sharedquota/quota"
)

// A Limiter gates work that is not an HTTP request: here, mail through a
// relay that takes six a minute, three at once.
func ExampleLimiter_Wait() {
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := standInClient(redisServer)
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
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := standInClient(redisServer)
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
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := standInClient(redisServer)
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
	redisServer := standInRedis()
	defer redisServer.Close()
	rdb := standInClient(redisServer)
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
