// Package updates runs the changes a provider's answer, or the end of an
// outage, makes to a bucket besides taking tokens. They run in the
// background: a response is returned to its caller at once, whatever
// Redis is doing. The package bounds them and accounts for their
// failures: a metric, and a log record at most once a minute.
package updates

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/pending"
)

// The kinds of update.
const (
	Pause       = "pause"        // a Retry-After, or none remaining until a reset
	Lower       = "lower"        // the provider says fewer remain
	Settle      = "settle"       // a request's real cost (WithSettle)
	SettleLocal = "settle_local" // the local shares, when the shared bucket resumes
	Refuse      = "refuse"       // a refusal cuts the rate the fleet learns (quota.Adaptive)
)

// Bounds on the updates in the background: each gets Timeout, at most
// maxUpdates run at once (more are dropped and counted as failures), and
// failures are logged at most once every failureLogEvery.
const (
	Timeout         = time.Second
	maxUpdates      = 64
	failureLogEvery = time.Minute
)

// errTooMany is the failure of an update dropped because maxUpdates were
// already running.
var errTooMany = errors.New("quota: too many bucket updates in flight")

// An Update is one change to a bucket, of a kind, with the span it is
// traced under (quota.<kind>).
type Update struct {
	Kind string
	Run  func(context.Context) error
}

// A Runner runs a Limiter's bucket updates in the background and accounts
// for their failures.
type Runner struct {
	slots   chan struct{}
	running pending.Count
	obs     *obs.Obs
	logger  *slog.Logger
	client  string // the Redis address(es), for the logs

	mu       sync.Mutex
	logged   time.Time // when failures were last logged
	unlogged int64     // failures since
}

// New returns a Runner that reports to o and logs to logger.
func New(o *obs.Obs, logger *slog.Logger, client string) *Runner {
	return &Runner{slots: make(chan struct{}, maxUpdates), obs: o, logger: logger, client: client}
}

// Start runs us on the bucket called bucket, one after another, in the
// background, under a context that keeps ctx's values but not its end
// and ends after Timeout. fail turns the error of an update into the
// error it failed with, given that context. Start returns at once.
func (r *Runner) Start(ctx context.Context, bucket string, us []Update, fail func(context.Context, error) error) {
	select {
	case r.slots <- struct{}{}:
	default:
		for _, u := range us {
			r.Failed(u.Kind, errTooMany)
		}
		return
	}
	r.running.Add(1)
	go func() {
		defer r.running.Done(1)
		defer func() { <-r.slots }()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), Timeout)
		defer cancel()
		for _, u := range us {
			uctx, end := r.obs.Update(ctx, "quota."+u.Kind, bucket)
			err := u.Run(uctx)
			if err != nil {
				err = fail(ctx, err)
			}
			end(err)
			if err != nil {
				r.Failed(u.Kind, err)
			}
		}
	}()
}

// Wait returns once no update is running, or with ctx's error.
func (r *Runner) Wait(ctx context.Context) error { return r.running.Wait(ctx) }

// Failed counts a failed update and logs it, or keeps it for the next log
// record when one was written less than failureLogEvery ago.
func (r *Runner) Failed(kind string, err error) {
	r.obs.UpdateFailed(kind, err)
	r.mu.Lock()
	now := time.Now()
	if !r.logged.IsZero() && now.Sub(r.logged) < failureLogEvery {
		r.unlogged++
		r.mu.Unlock()
		return
	}
	earlier := r.unlogged
	r.logged, r.unlogged = now, 0
	r.mu.Unlock()
	r.logger.LogAttrs(context.Background(), slog.LevelWarn, "quota: a bucket update failed",
		slog.String("redis", r.client),
		slog.String("update", kind),
		slog.Int64("earlier_failures", earlier),
		slog.String("cause", err.Error()),
	)
}
