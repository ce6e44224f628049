package quota

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/store"
)

// controlIdle is how long a Limiter stays unused before it stops
// listening; a variable for the tests.
var controlIdle = time.Minute

// controlled returns b under its control record: with the override as its
// first layer's Limit, and the entry that tells of its pauses. A record
// that cannot be read because Redis is unavailable leaves b as it was read
// last, and the breaker learns of the outage; any other failure to read
// it is the caller's error. A read of the record counts among the span's
// round trips.
func (l *Limiter) controlled(ctx context.Context, span *obs.Span, b bucket) (bucket, error) {
	e, sent, err := l.controls.Entry(ctx, b.Bucket, control.Limit(b.Lims[0]), l.mode() == ModeShared)
	if sent {
		span.Trips++
	}
	if err != nil {
		cerr := l.classify(ctx, err)
		if !errors.Is(cerr, ErrUnavailable) {
			return bucket{}, cerr
		}
		l.trip(b, err)
	}
	if e.Mixed(control.Limit(b.Lims[0])) {
		l.cfg.logger.Warn("quota: callers pass different Limits for one bucket: each take counts at its own, and Status tells the first",
			"bucket", b.Name, "first", Limit(e.Passed()), "now", b.limit(0))
	}
	b.ctl, b.passed = e, b.limit(0)
	return b.under(e), nil
}

// under returns b under the state of its control record e read last: with
// the override, if any, as its first layer's Limit, else the Limit its
// callers pass.
func (b bucket) under(e *control.Entry) bucket {
	st := e.Load()
	want := b.passed
	if o, ok := st.Override(); ok {
		want = Limit(o)
	}
	if b.limit(0) != want {
		b.Lims = slices.Clone(b.Lims)
		b.Lims[0] = store.Limit(want)
	}
	return b
}

// minRetry is the least a caller that the script refused for a pause the
// Limiter did not know of waits before it takes again.
const minRetry = 250 * time.Millisecond

// maxWait returns how long the caller accepts to wait (see
// control.MaxWait): none when noWait is set.
func (l *Limiter) maxWait(ctx context.Context, noWait bool) (wait time.Duration, deadline bool) {
	if noWait {
		return 0, false
	}
	return control.MaxWait(ctx, l.cfg.maxWait)
}

// sleep waits for d or until ctx ends, whichever comes first.
func sleep(ctx context.Context, d time.Duration) error {
	return control.Sleep(ctx, d, nil)
}

// awaitPause waits while b is paused, as far as the Limiter knows, when
// the script cannot queue the caller behind the pause (see
// Controls.AwaitPause), and refuses with ErrWouldExceedDeadline when the
// pause ends after ctx's deadline. Under dry run it records the wait and
// returns; under noWait the script decides, with the record as it is
// now: a pause this Limiter knows of may have been resumed since. A
// pool's take waits for none: its script passes over a paused deployment.
func (l *Limiter) awaitPause(ctx context.Context, span *obs.Span, b bucket, o *ask) error {
	if b.ctl == nil || o.pool != nil {
		return ctx.Err()
	}
	if span.DryRun || o.noWait {
		if end, forever, paused := b.ctl.Load().PausedAt(time.Now()); span.DryRun && paused && !forever {
			span.Wait = time.Until(end)
		}
		return ctx.Err()
	}
	until, err := l.controls.AwaitPause(ctx, b.ctl, l.cfg.maxWait)
	if err == control.ErrPastDeadline {
		return fmt.Errorf("%w: %q is paused %s", ErrWouldExceedDeadline, b.Name, until)
	}
	return err
}
