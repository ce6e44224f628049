package quota

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/store"
)

// Forever, given to Pause, pauses a bucket until Resume.
const Forever time.Duration = store.Forever

// Who set a bucket's pause, as Status reports it.
const (
	PausedByProvider = "provider"
	PausedByOperator = "operator"
)

// Status is a bucket as Limiter.Status reads it from Redis.
type Status struct {
	// Name is the bucket's name.
	Name string
	// Limit is the first layer's Limit in force: the override when there
	// is one, otherwise the Limit the fleet's Limiters last passed for the
	// bucket. It is the zero Limit when no Limiter has used the bucket
	// lately and there is no override; Tokens and Queue are zero then.
	Limit Limit
	// Override is the Limit set by SetLimit, or nil.
	Override *Limit
	// Tokens is what the first layer holds now, out of Limit.Burst.
	Tokens float64
	// Queue is how long until the last grant already given falls due:
	// how long a caller arriving now would wait, pauses aside.
	Queue time.Duration
	// Paused tells whether a pause is in force; PausedSince is when it
	// began and PausedUntil when it ends, the zero Time for a pause with
	// no end (Forever). PausedBy tells who set its end: PausedByProvider
	// (a Retry-After, or none remaining until a reset) or PausedByOperator
	// (Pause). A bucket has one pause, whoever asks: it ends at the latest
	// end asked for.
	Paused      bool
	PausedSince time.Time
	PausedUntil time.Time
	PausedBy    string
	// Workers is the number of Limiters that used the bucket in the last
	// five seconds.
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
// override's burst is refused with ErrExceedsBurst.
func (l *Limiter) SetLimit(ctx context.Context, name string, lim Limit) error {
	lim, err := lim.resolve()
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

// Status reads the bucket called name from Redis: the Limit in force and
// the tokens it holds, its queue, its pause and its users.
func (l *Limiter) Status(ctx context.Context, name string) (Status, error) {
	r, err := l.operate(ctx, name, store.RecordOp{Op: "status"})
	if err != nil {
		return Status{}, err
	}
	st := Status{Name: name, Workers: r.Users}
	switch {
	case r.Override != nil:
		o := Limit(*r.Override)
		st.Limit, st.Override = o, &o
	case r.Seen != nil:
		st.Limit = Limit(*r.Seen)
	}
	if lim := st.Limit; lim.Rate > 0 {
		st.Tokens = lim.Burst
		if r.Tat > r.Now {
			owed := float64(r.Tat-r.Now) / 1e6
			st.Tokens = lim.Burst - owed*lim.Rate
			st.Queue = max(0, time.Duration((owed-lim.Burst/lim.Rate)*1e9)).Round(time.Microsecond)
		}
	}
	if r.Since != 0 {
		st.PausedSince = time.UnixMicro(r.Since)
		if r.Until < 0 {
			st.Paused = true
		} else {
			st.PausedUntil = time.UnixMicro(r.Until)
			st.Paused = r.Until > r.Now
		}
		st.PausedBy = r.Source
		if !st.Paused {
			st.PausedSince, st.PausedUntil, st.PausedBy = time.Time{}, time.Time{}, ""
		}
	}
	// The roll call of CountingWorkers, which lives beside the buckets.
	if z, ok := l.store.Client().(interface {
		ZCount(ctx context.Context, key, min, max string) *redis.IntCmd
	}); ok {
		n, err := z.ZCount(ctx, l.cfg.prefix+"workers", strconv.FormatInt(r.Now/1000, 10), "+inf").Result()
		if err != nil {
			return Status{}, l.classify(ctx, err)
		}
		st.FleetWorkers = int(n)
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
