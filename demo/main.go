// Command quotademo shows, in under a minute, the problem the quota package
// solves and its cure.
//
// Four worker processes call one provider that allows 600 requests a
// minute. With a local limiter each, every worker keeps to 600/min and the
// provider receives four times that, answering 429. Sharing one quota bucket
// in Redis, the same four send exactly 600/min. The third phase kills Redis
// with SIGKILL in the middle and restarts it: with quota.FallbackLocal each
// worker falls back to a quarter of the limit, logs the change loudly, and
// returns to the shared bucket when Redis is back, the whole fleet at one
// instant; the demo reports the busiest second from the restart on. With
// -pause, a fourth phase uses the shared bucket again, and 40% into it the
// provider answers one request with 429 and Retry-After: the worker that
// receives it pauses the shared bucket, the pause reaches every worker and
// every grant already queued, and the demo reports the requests that still
// arrived from 50 ms after the 429 until the pause ended, when the traffic
// resumed and its busiest second after the pause.
//
// The demo starts everything it needs on loopback: a redis-server (unless
// -redis is given), a fake provider that enforces the limit with 429s, and
// the workers, which are copies of this binary. It prints a summary table,
// writes a picture of what the provider received (PNG and SVG) and exits 1
// if the shared bucket let the provider see more than the limit allows.
//
// Usage:
//
//	go run . [-workers 4] [-goroutines 8] [-rate 600] [-duration 12s] [-pause 2s] [-out demo-out] [-json]
package main

import "github.com/sharedquota/quota/demo/internal/workers"

func main() {
	workers.Main("quotademo", workerArg, runWorker, parseFlags, run)
}
