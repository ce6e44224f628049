package main

import "time"

// workerEnv is the environment variable that carries a worker's spec, as
// JSON, from the demo to the worker process it starts.
const workerEnv = "QUOTA_DEMO_WORKER"

// workerArg, as the first argument, makes the binary a worker.
const workerArg = "-worker"

// How a worker limits its requests.
const (
	modeLocal    = "local"    // a golang.org/x/time/rate limiter of its own
	modeShared   = "shared"   // the shared bucket, failing closed
	modeFallback = "fallback" // the shared bucket, FallbackLocal while Redis is down
)

// A workerSpec tells a worker process what to do.
type workerSpec struct {
	ID         int       `json:"id"`
	Mode       string    `json:"mode"`
	URL        string    `json:"url"`
	Redis      string    `json:"redis"`
	Prefix     string    `json:"prefix"` // of the phase's bucket in Redis
	Rate       float64   `json:"rate"`   // per second
	Burst      int       `json:"burst"`
	Workers    int       `json:"workers"` // the fleet's size, for FallbackLocal
	Goroutines int       `json:"goroutines"`
	Start      time.Time `json:"start"` // when to send the first request
	End        time.Time `json:"end"`   // when to stop
}

// A workerReport is what a worker writes to its stdout when it ends. What
// the provider answered, the provider counts itself.
type workerReport struct {
	ID      int       `json:"id"`
	WaitsMS []float64 `json:"waits_ms"` // each sent request's wait for its limiter
	Failed  int       `json:"failed"`   // requests refused by the limiter or lost, not counting the end of the phase
	Mode    string    `json:"mode"`     // the limiter's mode at the end
}
