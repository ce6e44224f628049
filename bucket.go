package quota

import (
	"fmt"

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
// resolved, without asking Redis anything.
func newBucket(prefix, name string, lims []Limit) (bucket, error) {
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
	return bucket{Bucket: store.New(prefix, name, resolved)}, nil
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
