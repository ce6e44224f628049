package main

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/slots"
	"github.com/sharedquota/quota/internal/store"
)

// The keys of a bucket are laid out by internal/store (the bucket's key,
// its control record, its settles and its further layers) and
// internal/slots (its concurrency slots): quotactl reads them with theirs.
// A bucket's other keys are its key followed by one of keySuffixes, or by
// a further layer's suffix (store.IsLayerSuffix).
var keySuffixes = []string{store.ControlSuffix, slots.HeldSuffix, slots.WaitingSuffix, slots.QueueSuffix, slots.TakesSuffix, store.SettledSuffix}

// bucketKey returns the key of the bucket called name, which is not empty.
func bucketKey(prefix, name string) string { return store.Key(prefix, name) }

// missing reports whether Redis holds none of the keys of the bucket
// called name: neither its key, nor its control record, nor the keys of
// its slots or settles. A further layer's key, named only in the control
// record, is not looked for: it outlives the others only until that layer
// is full again. The keys share a hash slot, so that one pipeline to one
// node reads them all. It asks PTTL, which the package's ACL allows, and
// counts a failure as not missing.
func missing(ctx context.Context, rdb redis.UniversalClient, prefix, name string) bool {
	key := bucketKey(prefix, name)
	cmds, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		p.PTTL(ctx, key)
		for _, s := range keySuffixes {
			p.PTTL(ctx, key+s)
		}
		return nil
	})
	if err != nil {
		return false
	}
	for _, c := range cmds {
		if c.(*redis.DurationCmd).Val() != -2 { // -2: no such key
			return false
		}
	}
	return true
}

// scanCount is the COUNT of each SCAN: enough keys a call to keep the
// calls few, few enough that Redis serves its other clients between two.
const scanCount = 1000

// listed is a bucket that list found: its name, or when its key holds the
// name shortened, that shortened form.
type listed struct {
	Name      string `json:"name"`
	Shortened bool   `json:"shortened,omitempty"`
}

// list returns the buckets under prefix that have a key in Redis, each
// once, sorted by name. It scans the keys with SCAN, never KEYS, on every
// master of a Cluster.
func list(ctx context.Context, rdb redis.UniversalClient, prefix string) ([]listed, error) {
	var mu sync.Mutex
	found := map[listed]bool{}
	scan := func(ctx context.Context, c *redis.Client) error {
		it := c.Scan(ctx, 0, globEscape(prefix)+"{*", scanCount).Iterator()
		for it.Next(ctx) {
			if b, ok := bucketOf(prefix, it.Val()); ok {
				mu.Lock()
				found[b] = true
				mu.Unlock()
			}
		}
		return it.Err()
	}
	var err error
	switch c := rdb.(type) {
	case *redis.ClusterClient:
		err = c.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, c)
	default:
		err = fmt.Errorf("cannot scan the keys of a %T", rdb)
	}
	if err != nil {
		return nil, err
	}
	buckets := slices.AppendSeq(make([]listed, 0, len(found)), maps.Keys(found))
	slices.SortFunc(buckets, func(a, b listed) int { return strings.Compare(a.Name, b.Name) })
	return buckets, nil
}

// bucketOf returns the bucket that key belongs to, under prefix, and
// whether it is a key of a bucket at all, as bucketKey and keySuffixes
// lay them out.
func bucketOf(prefix, key string) (listed, bool) {
	name, suffix, shortened, ok := store.ParseKey(prefix, key)
	if !ok || suffix != "" && !slices.Contains(keySuffixes, suffix) && !store.IsLayerSuffix(suffix) {
		return listed{}, false
	}
	return listed{Name: name, Shortened: shortened}, true
}

// globEscape escapes the characters special in a pattern of SCAN's MATCH.
func globEscape(s string) string {
	var b strings.Builder
	for i := range len(s) {
		if strings.IndexByte(`*?[]\`, s[i]) >= 0 {
			b.WriteByte('\\')
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
