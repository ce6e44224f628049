package quota

import (
	"context"
	"fmt"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/store"
)

// bucket is one bucket's layers, and what its Limiter knows of its
// control record.
type bucket struct {
	store.Bucket
	ctl *control.Entry // what the Limiter read of its control record; nil in none

	passed Limit // under a control record: the first layer's Limit as the caller passed it
}

// bucketKey returns the Redis key of the bucket named name (see
// store.Key); the name must not be empty.
func bucketKey(prefix, name string) (string, error) {
	if name == "" {
		return "", fmt.Errorf("%w: empty bucket name", ErrInvalidKey)
	}
	return store.Key(prefix, name), nil
}

// newBucket returns the bucket named name with layers lims, validated and
// resolved, without asking Redis anything; with meters, one per layer,
// each layer meters a thing of its own.
func newBucket(prefix, name string, lims []Limit, meters ...string) (bucket, error) {
	if name == "" {
		return bucket{}, fmt.Errorf("%w: empty bucket name", ErrInvalidKey)
	}
	resolved, err := resolveAll(lims)
	if err != nil {
		return bucket{}, err
	}
	return bucket{Bucket: store.New(prefix, name, resolved, meters...)}, nil
}

// resolveAll returns lims, at least one, validated and resolved.
func resolveAll(lims []Limit) ([]store.Limit, error) {
	if len(lims) == 0 {
		return nil, fmt.Errorf("%w: no Limit given", ErrInvalidLimit)
	}
	var one [1]store.Limit
	resolved := one[:0]
	for _, lim := range lims {
		lim, err := lim.resolve()
		if err != nil {
			return nil, err
		}
		resolved = append(resolved, store.Limit(lim))
	}
	return resolved, nil
}

// limit returns the Limit of layer i.
func (b bucket) limit(i int) Limit { return Limit(b.Lims[i]) }

// checkTokens reports whether n tokens can ever be granted from every layer.
func (b bucket) checkTokens(n float64) error {
	for i := range b.Lims {
		if err := b.limit(i).checkTokens(b.Name, n); err != nil {
			return err
		}
	}
	return nil
}

// checkCost reports whether c can ever be granted from b: n tokens from
// every layer, or from a bucket of meters its amount from each, zero
// from some but not from all.
func (b bucket) checkCost(c store.Cost) error {
	if c.Each == nil {
		return b.checkTokens(c.N)
	}
	some := false
	for i, n := range c.Each {
		if n == 0 {
			continue
		}
		some = true
		if err := b.limit(i).checkTokens(b.Name+" "+b.Meters[i], n); err != nil {
			return err
		}
	}
	if !some {
		return fmt.Errorf("%w: bucket %q: nothing asked of any meter", ErrInvalidTokens, b.Name)
	}
	return nil
}

// lowered returns b at the rates the fleet learned, where lower than its
// Limits (see Adaptive): the local shares of an outage share those.
func (b bucket) lowered() bucket {
	if b.ctl != nil {
		b.Lims = b.ctl.Load().Lowered(b.Lims)
	}
	return b
}

// deployments returns the deployments of o's pool called p.Name, each
// under its control record and able to grant o, with p's layers after its
// own Limits, and their candidates for a take.
func (l *Limiter) deployments(ctx context.Context, span *obs.Span, p bucket, o ask) ([]bucket, []store.Candidate, error) {
	cs, err := o.pool.Buckets(l.cfg.prefix, p.Name, p.Lims, p.Meters)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", ErrInvalidKey, err)
	}
	bs := make([]bucket, len(cs))
	for i := range cs {
		if bs[i], err = l.controlled(ctx, span, bucket{Bucket: cs[i].Bucket}); err == nil {
			err = bs[i].checkCost(o.cost())
		}
		if err != nil {
			return nil, nil, err
		}
		cs[i].Bucket = bs[i].Bucket
	}
	return bs, cs, nil
}
