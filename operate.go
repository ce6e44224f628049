package quota

import (
	"cmp"
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/local"
	"github.com/sharedquota/quota/internal/store"
	"github.com/sharedquota/quota/status"
)

// Status is a bucket as Limiter.Status reads it from Redis: the whole
// bucket (package status), and its first layer in quota's terms.
type Status struct {
	// Every layer with what it granted lately, the pause, the resume after
	// an outage, the classes, the tenants, the slots and the Limiters.
	status.Bucket
	// Limit is the first layer's Limit in force: the override when there
	// is one, otherwise the Limit the fleet's Limiters last passed for the
	// bucket. It is the zero Limit when no Limiter has used the bucket
	// lately and there is no override; Tokens and Queue are zero then.
	Limit Limit
	// Override is the Limit set by SetLimit, or nil.
	Override *Limit
	// Tokens and Queue are the first layer's (see status.Layer).
	Tokens float64
	Queue  time.Duration
	// Workers is len(Limiters), those that used it in the last 5 seconds.
	Workers int
	// FleetWorkers is the fleet's roll call under
	// FallbackLocal(n).CountingWorkers(): the Limiters alive that share
	// the Redis and the prefix; 0 when no Limiter counts workers.
	FleetWorkers int
}

// SetLimit stores lim as the Limit of the first layer of the bucket called
// name, in place of the Limit its callers pass, for every Limiter that
// shares the Redis and the prefix: within a second, without a restart.
// Further layers (WithLayers, the layers of WaitN) keep their own Limits. The
// override stays until ClearLimit; the fleet's local shares under
// FallbackLocal follow it too. A caller asking for more tokens than the
// override's burst is refused with ErrExceedsBurst. A daily Limit cannot be
// an override (ErrInvalidLimit).
func (l *Limiter) SetLimit(ctx context.Context, name string, lim Limit) error {
	lim, err := lim.resolve()
	if err == nil && lim.Zone != nil {
		err = fmt.Errorf("%w: SetLimit(%q, %v): an override is a rate, not a daily Limit", ErrInvalidLimit, name, lim)
	}
	if err != nil {
		return err
	}
	_, err = l.operate(ctx, name, store.RecordOp{Op: "limit", Limit: store.Limit(lim)})
	return err
}

// ClearLimit removes the override of the bucket called name: its callers'
// Limits apply again, within a second.
func (l *Limiter) ClearLimit(ctx context.Context, name string) error {
	_, err := l.operate(ctx, name, store.RecordOp{Op: "clear"})
	return err
}

// Pause stops every grant from the bucket called name, in every process
// that shares the Redis and the prefix, for d, or until Resume when d is
// Forever. The pause is written into the bucket, so that every take sees
// it, whatever its Limiter has heard. Grants already given and not yet due
// are held as well: a grant due t after the pause began falls due t after
// it ends, so that the queue resumes in its order and at its pace. Callers
// wait through the pause within their deadlines (Allow and WithNoWait
// refuse at once). A bucket has one pause, shared with the provider's
// Retry-After: a pause while one is in force extends it, never shortens
// it. A d below a microsecond fails with ErrInvalidLimit.
func (l *Limiter) Pause(ctx context.Context, name string, d time.Duration) error {
	if d != Forever && d < time.Microsecond {
		return fmt.Errorf("%w: a pause of %v; it must last a microsecond or more", ErrInvalidLimit, d)
	}
	_, err := l.operate(ctx, name, store.RecordOp{Op: "hold", Hold: d})
	return err
}

// Resume ends the pause of the bucket called name, if one is in force,
// whoever set it: the grants it held fall due as if it had ended now.
func (l *Limiter) Resume(ctx context.Context, name string) error {
	_, err := l.operate(ctx, name, store.RecordOp{Op: "resume"})
	return err
}

// Status reads the bucket called name from Redis, whole (see Status).
// It needs a client that pipelines, as *redis.Client and
// *redis.ClusterClient do.
func (l *Limiter) Status(ctx context.Context, name string) (Status, error) {
	rdb, ok := l.store.Client().(redis.Cmdable)
	if _, err := bucketKey(l.cfg.prefix, name); err != nil || !ok {
		return Status{}, cmp.Or(err, fmt.Errorf("quota: Status needs a client that pipelines, not a %T", l.store.Client()))
	}
	var now time.Time // the server's, but for a Limiter WithClock
	if l.cfg.clock != nil {
		now = l.cfg.clock()
	}
	b, err := status.ReadAt(ctx, rdb, l.cfg.prefix, name, now)
	if err != nil {
		return Status{}, l.classify(ctx, err)
	}
	st := Status{Bucket: b, Workers: len(b.Limiters)}
	if len(b.Layers) > 0 {
		first := b.Layers[0]
		st.Limit, st.Tokens, st.Queue = Limit{Rate: first.Rate, Burst: first.Burst}, first.Tokens, first.Queue
		if first.Override {
			st.Override = &Limit{Rate: first.Rate, Burst: first.Burst}
		}
	}
	// The roll call of CountingWorkers, which lives beside the buckets.
	if st.FleetWorkers, err = local.Alive(ctx, rdb, l.cfg.prefix, b.Now.UnixMicro()); err != nil {
		return Status{}, l.classify(ctx, err)
	}
	return st, nil
}

// operate runs a record op of the bucket called name.
func (l *Limiter) operate(ctx context.Context, name string, op store.RecordOp) (control.Record, error) {
	key, err := bucketKey(l.cfg.prefix, name)
	if err != nil {
		return control.Record{}, err
	}
	r, err := l.controls.Op(ctx, key, op)
	if err != nil {
		return control.Record{}, l.classify(ctx, err)
	}
	return r, nil
}
