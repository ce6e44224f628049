package store

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/redisx"
)

// A bucket's keys. The bucket's key is the prefix, then the bucket's name
// inside a hash tag: quota:{api.example.com}. The bucket's other keys, all
// in its hash slot, are its key followed by a suffix: its control record
// (ControlSuffix), the settles applied lately (SettledSuffix), one key for
// each further layer, named by the layer's Limit (":RATE/BURST") and, on a
// bucket whose layers meter different things, by what it meters
// (":METER:RATE/BURST"); and the concurrency slots' (internal/slots).
const (
	ControlSuffix = ":ctl"
	SettledSuffix = ":settled"
)

// MaxNameLen bounds a bucket's name inside its Redis key. Longer names,
// which only untrusted input produces, are shortened to a prefix, a "~"
// and a digest of DigestLen hex digits, one byte longer than MaxNameLen.
const (
	MaxNameLen = 200
	DigestLen  = 16
)

// Key returns the Redis key of the bucket named name, which is not empty:
// the prefix, then the name in a hash tag so that every key of one bucket
// shares a Cluster slot. Distinct names have distinct keys. A name longer
// than MaxNameLen is shortened to a prefix and a digest, one byte longer
// than MaxNameLen, which no name kept whole can be; a name that begins
// with "}", which would leave the hash tag empty, or with "%", is written
// after a "%".
func Key(prefix, name string) string {
	if len(name) > MaxNameLen {
		sum := sha256.Sum256([]byte(name))
		digest := hex.EncodeToString(sum[:DigestLen/2])
		name = name[:MaxNameLen-len(digest)] + "~" + digest
	}
	if name != "" && (name[0] == '}' || name[0] == '%') {
		name = "%" + name
	}
	return prefix + "{" + name + "}"
}

// ParseKey splits a Redis key under prefix into the name of the bucket it
// belongs to, as Key wrote it (shortened when it was too long, which
// shortened tells), and the suffix that follows the bucket's key. It
// reports false for a key Key cannot have written; the suffix is not
// checked.
func ParseKey(prefix, key string) (name, suffix string, shortened, ok bool) {
	rest, ok := strings.CutPrefix(key, prefix+"{")
	if !ok {
		return "", "", false, false
	}
	// The suffixes hold no "}": the last one closes the name.
	i := strings.LastIndexByte(rest, '}')
	if i < 0 {
		return "", "", false, false
	}
	name, suffix = rest[:i], rest[i+1:]
	if escaped, ok := strings.CutPrefix(name, "%"); ok {
		if escaped == "" || escaped[0] != '}' && escaped[0] != '%' {
			return "", "", false, false
		}
		name = escaped
	} else if name == "" || name[0] == '}' {
		return "", "", false, false
	}
	switch {
	case len(name) <= MaxNameLen:
		return name, suffix, false, true
	case len(name) == MaxNameLen+1 && isDigest(name[MaxNameLen-DigestLen:]):
		return name, suffix, true, true
	}
	return "", "", false, false
}

// isDigest reports whether s is the "~" and the digest that end a
// shortened name.
func isDigest(s string) bool {
	d, ok := strings.CutPrefix(s, "~")
	_, err := hex.DecodeString(d)
	return ok && len(d) == DigestLen && err == nil && strings.ToLower(d) == d
}

// IsLayerSuffix reports whether s is the suffix of a further layer's key,
// ":RATE/BURST" or ":METER:RATE/BURST", RATE a daily Limit's name for a
// daily layer (see daily.Key).
func IsLayerSuffix(s string) bool {
	lim, colon := strings.CutPrefix(s, ":")
	if meter, rest, ok := strings.Cut(lim, ":"); ok {
		if CheckMeter(meter) != nil {
			return false
		}
		lim = rest
	}
	r, b, slash := strings.Cut(lim, "/")
	if !colon || !slash {
		return false
	}
	_, rerr := strconv.ParseFloat(r, 64)
	if strings.HasPrefix(r, "d") && strings.Contains(r, "@") {
		rerr = nil
	}
	_, berr := strconv.ParseFloat(b, 64)
	return rerr == nil && berr == nil
}

// A Limit is a layer's rate, tokens a second, and burst, validated. A
// daily Limit (a Zone) is a count, Burst tokens a day that refill at once
// at the time of day Reset in Zone (see daily.lua); its Rate is the
// count's average, which what computes with a rate reads.
type Limit struct {
	Rate  float64
	Burst float64
	Reset time.Duration
	Zone  *time.Location
}

// name returns what names lim in a further layer's key: its rate, or a
// daily Limit's time of day and zone (see daily.Key).
func (lim Limit) name() string {
	if lim.Zone != nil {
		return daily.Key(lim.Reset, lim.Zone)
	}
	return redisx.Num(lim.Rate)
}

// A Bucket is one bucket's layers: its name, and the Redis key and Limit
// of each layer, the first layer under the bucket's own key.
type Bucket struct {
	Name   string
	Keys   []string // the layers'
	Lims   []Limit
	Meters []string // what each layer meters, when each meters its own; nil when all share the cost
	Call   []string // the scripts' KEYS: the layers' keys, then the control record's
}

// New returns the bucket named name under prefix with layers lims, which
// are at least one and valid. With meters (one per layer, distinct and
// valid, see CheckMeter), each layer meters a thing of its own: its key
// names it.
func New(prefix, name string, lims []Limit, meters ...string) Bucket {
	key := Key(prefix, name)
	b := Bucket{Name: name}
	if len(lims) == 1 {
		// The usual bucket, one layer, in one allocation.
		one := new(struct {
			call [2]string
			lims [1]Limit
		})
		b.Call, b.Lims = one.call[:], one.lims[:]
	} else {
		b.Call, b.Lims = make([]string, len(lims)+1), make([]Limit, len(lims))
	}
	b.Keys = b.Call[:len(lims):len(lims)]
	b.Call[len(lims)] = key + ControlSuffix
	copy(b.Lims, lims)
	if len(meters) > 0 {
		b.Meters = meters
	}
	for i, lim := range b.Lims {
		b.Keys[i] = key
		if i > 0 {
			// Further layers live beside the first, in its hash slot, under
			// a key that names their Limit, and what they meter.
			b.Keys[i] = key + ":" + lim.name() + "/" + redisx.Num(lim.Burst)
			if b.Meters != nil {
				b.Keys[i] = key + ":" + b.Meters[i] + ":" + lim.name() + "/" + redisx.Num(lim.Burst)
			}
		}
	}
	return b
}

// MaxMeterLen bounds the name of a meter.
const MaxMeterLen = 64

// CheckMeter reports why name cannot name a meter, or nil: a meter's name
// is 1 to MaxMeterLen letters, digits, '_', '-' and '.', which keep its
// layer's key readable and apart from the others'.
func CheckMeter(name string) error {
	if name == "" || len(name) > MaxMeterLen {
		return fmt.Errorf("a meter's name has 1 to %d bytes, not %d", MaxMeterLen, len(name))
	}
	for _, c := range []byte(name) {
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-' || c == '.') {
			return fmt.Errorf("meter %q: a meter's name has letters, digits, '_', '-' and '.' only", name)
		}
	}
	return nil
}

// Same reports whether b and o are the same bucket: the same keys under
// the same Limits.
func (b Bucket) Same(o Bucket) bool {
	return slices.Equal(b.Keys, o.Keys) && slices.Equal(b.Lims, o.Lims) && slices.Equal(b.Meters, o.Meters)
}
