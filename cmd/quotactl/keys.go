package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"

	"github.com/redis/go-redis/v9"
)

// The keys of a bucket, as package quota lays them out under its prefix.
// The bucket's key is the prefix, then the bucket's name inside a hash tag:
// quota:{api.example.com}. A name longer than maxName bytes is shortened to
// its first bytes, a "~" and a digest of the whole name, one byte longer
// than maxName; a name that begins with "}" or "%" is written after a "%".
// The bucket's other keys, all in its hash slot, are its key followed by a
// suffix: its control record, its concurrency slots, the settles applied
// lately, and one key for each further layer, named by the layer's Limit
// (":RATE/BURST").
const maxName = 200

var keySuffixes = []string{":ctl", ":slots", ":slots:waiting", ":slots:queue", ":settled"}

// bucketKey returns the key of the bucket called name, which is not empty.
func bucketKey(prefix, name string) string {
	if len(name) > maxName {
		sum := sha256.Sum256([]byte(name))
		digest := hex.EncodeToString(sum[:8])
		name = name[:maxName-len(digest)] + "~" + digest
	}
	if name[0] == '}' || name[0] == '%' {
		name = "%" + name
	}
	return prefix + "{" + name + "}"
}

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
