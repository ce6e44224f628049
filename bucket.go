package quota

import (
	"fmt"
	"time"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/store"
)

// bucket is one bucket's layers, and what its Limiter knows of its
// control record.
type bucket struct {
	store.Bucket
	ctl *control.Entry // what the Limiter read of its control record; nil in none

	// Under a control record: the state whose override Lims holds, and
	// the first layer's Limit as the caller passed it.
	st     *control.State
	passed Limit
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
	if len(lims) == 0 {
		return bucket{}, fmt.Errorf("%w: no Limit given", ErrInvalidLimit)
	}
	var one [1]store.Limit
	resolved := one[:0]
	for _, lim := range lims {
		lim, err := lim.resolve()
		if err != nil {
			return bucket{}, err
		}
		resolved = append(resolved, store.Limit(lim))
	}
	return bucket{Bucket: store.New(prefix, name, resolved, meters...)}, nil
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

// costTime returns how long c takes to accrue at the rate of b's slowest
// layer for it.
func (b bucket) costTime(c store.Cost) time.Duration {
	var d time.Duration
	for i, lim := range b.Lims {
		d = max(d, time.Duration(c.Of(i)/lim.Rate*float64(time.Second)))
	}
	return d
}
