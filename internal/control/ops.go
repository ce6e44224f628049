package control

import (
	"context"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/store"
)

// Op runs the record op op (limit, clear, hold, resume or status) of the
// bucket whose first key is key, and returns the record it replies. A
// pause (hold) and a resume move the queues of every layer the Limiters
// that use the bucket recorded. An op that changes the record is
// announced by the script; this Limiter reads its entry again at once.
func (c *Controls) Op(ctx context.Context, key string, op store.RecordOp) (Record, error) {
	keys := []string{key}
	if op.Op == "hold" || op.Op == "resume" {
		layers, err := c.layersOf(ctx, key)
		if err != nil {
			return Record{}, err
		}
		for _, suffix := range layers {
			keys = append(keys, key+suffix)
		}
	}
	r, err := c.store.Record(ctx, keys, op)
	if err != nil {
		return Record{}, err
	}
	if e := c.Lookup(key); e != nil {
		_, _ = c.ReadNow(ctx, e)
	}
	return r, nil
}

// layersOf returns the suffixes of the further layers' keys of the bucket
// whose first key is key, as the Limiters that use it last recorded them.
func (c *Controls) layersOf(ctx context.Context, key string) ([]string, error) {
	h, ok := c.store.Client().(interface {
		HGet(ctx context.Context, key, field string) *redis.StringCmd
	})
	if !ok {
		return nil, nil
	}
	layers, err := h.HGet(ctx, key+Suffix, "layers").Result()
	if err == redis.Nil {
		err = nil
	}
	return strings.Fields(layers), err
}
