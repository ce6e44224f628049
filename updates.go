package quota

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/sharedquota/quota/internal/pending"
	"go.opentelemetry.io/otel/metric"
)

// The changes a provider's answer, or the end of an outage, makes to a
// bucket besides taking tokens. They run in the background: a response is
// returned to its caller at once, whatever Redis is doing.
const (
	updatePause       = "pause"        // a Retry-After, or none remaining until a reset
	updateLower       = "lower"        // the provider says fewer remain
	updateSettle      = "settle"       // a request's real cost (WithSettle)
	updateSettleLocal = "settle_local" // the local shares, when the shared bucket resumes
)

// Bounds on the updates in the background: each gets updateTimeout, at
// most maxUpdates run at once (more are dropped and counted as failures),
// and failures are logged at most once every failureLogEvery.
const (
	updateTimeout   = time.Second
	maxUpdates      = 64
	failureLogEvery = time.Minute
)

// errTooManyUpdates is the failure of an update dropped because maxUpdates
// were already running.
var errTooManyUpdates = errors.New("quota: too many bucket updates in flight")

// updates runs a Limiter's bucket updates in the background and accounts
// for their failures: a metric, a log record at most once a minute, and
// the breaker for those that say Redis is unavailable.
type updates struct {
	slots    chan struct{}
	running  pending.Count
	failures metric.Int64Counter
	cut      metric.Float64Counter
	unknown  metric.Int64Counter
	logger   *slog.Logger
	client   string

	mu       sync.Mutex
	logged   time.Time // when failures were last logged
	unlogged int64     // failures since
}

func (u *updates) init(cfg config, client string, meter metric.Meter) {
	u.slots = make(chan struct{}, maxUpdates)
	u.logger, u.client = cfg.logger, client
	// An instrument error leaves a no-op instrument in place.
	u.failures, _ = meter.Int64Counter("quota.update.failures",
		metric.WithDescription("Bucket updates (pause, lower, settle, settle_local) that failed or were dropped."),
		metric.WithUnit("{update}"))
	u.cut, _ = meter.Float64Counter("quota.settle.cut",
		metric.WithDescription("Tokens a settle reported beyond its bound (see WithSettle) and did not take."),
		metric.WithUnit("{token}"))
	u.unknown, _ = meter.Int64Counter("quota.settle.unknown",
		metric.WithDescription("Metered responses that ended before they told their usage (closed or cut short, or a stream without it): their reservations stand."),
		metric.WithUnit("{response}"))
}

// update is one change to a bucket, with the span it is traced under.
type update struct {
	kind string
	run  func(context.Context) error
}

// start runs us on bucket b, one after another, in the background, under
// a context that keeps ctx's values but not its end. It returns at once.
func (l *Limiter) startUpdates(ctx context.Context, b bucket, us []update) {
	select {
	case l.updates.slots <- struct{}{}:
	default:
		for _, u := range us {
			l.updates.failed(u.kind, errTooManyUpdates)
		}
		return
	}
	l.updates.running.Add(1)
	go func() {
		defer l.updates.running.Done(1)
		defer func() { <-l.updates.slots }()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), updateTimeout)
		defer cancel()
		for _, u := range us {
			uctx, end := l.obs.update(ctx, "quota."+u.kind, b.Name)
			err := u.run(uctx)
			if err != nil {
				err = l.classify(ctx, err)
			}
			end(err)
			if err != nil {
				if errors.Is(err, ErrUnavailable) {
					l.trip(b, err)
				}
				l.updates.failed(u.kind, err)
			}
		}
	}()
}

// failed counts a failed update and logs it, or keeps it for the next log
// record when one was written less than failureLogEvery ago.
func (u *updates) failed(kind string, err error) {
	u.failures.Add(context.Background(), 1, metric.WithAttributes(attrUpdate.String(kind), attrErrorType.String(errorType(err))))
	u.mu.Lock()
	now := time.Now()
	if !u.logged.IsZero() && now.Sub(u.logged) < failureLogEvery {
		u.unlogged++
		u.mu.Unlock()
		return
	}
	earlier := u.unlogged
	u.logged, u.unlogged = now, 0
	u.mu.Unlock()
	u.logger.LogAttrs(context.Background(), slog.LevelWarn, "quota: a bucket update failed",
		slog.String("redis", u.client),
		slog.String("update", kind),
		slog.Int64("earlier_failures", earlier),
		slog.String("cause", err.Error()),
	)
}
