package quota

import (
	"context"
	"errors"

	"github.com/sharedquota/quota/internal/updates"
)

// startUpdates runs us on bucket b in the background (see
// updates.Runner): an update that fails as unavailable trips the breaker.
func (l *Limiter) startUpdates(ctx context.Context, b bucket, us []updates.Update) {
	l.updates.Start(ctx, b.Name, us, func(ctx context.Context, err error) error {
		err = l.classify(ctx, err)
		if errors.Is(err, ErrUnavailable) {
			l.trip(b, err)
		}
		return err
	})
}
