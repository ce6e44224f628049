package main

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"

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
const (
	maxName   = 200
	digestLen = 16 // hex digits
)

var keySuffixes = []string{":ctl", ":slots", ":slots:waiting", ":slots:queue", ":slots:takes", ":settled"}

// bucketKey returns the key of the bucket called name, which is not empty.
func bucketKey(prefix, name string) string {
	if len(name) > maxName {
		sum := sha256.Sum256([]byte(name))
		digest := hex.EncodeToString(sum[:digestLen/2])
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
	rest, ok := strings.CutPrefix(key, prefix+"{")
	if !ok {
		return listed{}, false
	}
	// The suffixes hold no "}": the last one closes the name.
	i := strings.LastIndexByte(rest, '}')
	if i < 0 {
		return listed{}, false
	}
	name, suffix := rest[:i], rest[i+1:]
	if suffix != "" && !slices.Contains(keySuffixes, suffix) && !isLayerSuffix(suffix) {
		return listed{}, false
	}
	if escaped, ok := strings.CutPrefix(name, "%"); ok {
		if escaped == "" || escaped[0] != '}' && escaped[0] != '%' {
			return listed{}, false
		}
		name = escaped
	} else if name == "" || name[0] == '}' {
		return listed{}, false
	}
	switch {
	case len(name) <= maxName:
		return listed{Name: name}, true
	case len(name) == maxName+1 && isDigest(name[maxName-digestLen:]):
		return listed{Name: name, Shortened: true}, true
	}
	return listed{}, false
}

// isLayerSuffix reports whether s is the suffix of a further layer's key,
// ":RATE/BURST".
func isLayerSuffix(s string) bool {
	lim, colon := strings.CutPrefix(s, ":")
	r, b, slash := strings.Cut(lim, "/")
	if !colon || !slash {
		return false
	}
	_, rerr := strconv.ParseFloat(r, 64)
	_, berr := strconv.ParseFloat(b, 64)
	return rerr == nil && berr == nil
}

// isDigest reports whether s is the "~" and the digest that end a
// shortened name.
func isDigest(s string) bool {
	d, ok := strings.CutPrefix(s, "~")
	_, err := hex.DecodeString(d)
	return ok && len(d) == digestLen && err == nil && strings.ToLower(d) == d
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
