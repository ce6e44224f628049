package store

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
)

// A Candidate is one deployment of a pool (see pool.lua): its bucket, and
// whether it is a last resort, taken from only when the others cannot
// grant at once.
type Candidate struct {
	Bucket
	Last bool
}

// TakePool takes n from one of the candidates, whose buckets share a hash
// tag, in one script call: from the first tier's candidate with the most
// room that grants at once, else a last resort's that does, else from the
// one that grants soonest, when its wait is at most maxWait (pool.lua). It
// returns the grant and the index of the candidate it came from, or that
// refused it. Pool takes do not share calls.
func (s *Store) TakePool(ctx context.Context, cs []Candidate, n Cost, maxWait time.Duration) (Grant, int, error) {
	keys, args := s.PoolCall(cs, n, maxWait)
	cmd, trips := s.poolScript.Run(ctx, keys, args...)
	if err := cmd.Err(); err != nil {
		return Grant{Trips: trips, Size: 1}, 0, err
	}
	v, err := cmd.Int64Slice()
	if err != nil {
		return Grant{Trips: trips, Size: 1}, 0, fmt.Errorf("%w: %v", redisx.ErrReply, cmd.Val())
	}
	g, i, err := DecodePool(cs, v)
	g.Trips, g.Size = trips, 1
	return g, i, err
}

// PoolCall returns the KEYS and ARGV of a pool's take of n from the
// candidates (pool.lua), for a script that runs one inside its own
// (internal/slots).
func (s *Store) PoolCall(cs []Candidate, n Cost, maxWait time.Duration) (keys []string, args []any) {
	args = []any{"pool", s.Now(), len(cs)}
	var takes []any
	for _, c := range cs {
		a := s.takeArgs(c.Bucket, caller{n, maxWait})
		tier := 0
		if c.Last {
			tier = 1
		}
		keys = append(keys, c.Call...)
		args = append(args, strconv.Itoa(len(c.Call))+" "+strconv.Itoa(len(a))+" "+strconv.Itoa(tier))
		takes = append(takes, a...)
	}
	return keys, append(args, takes...)
}

// DecodePool reads a pool's take's reply, v: the grant, and the index of
// the candidate of cs it came from or that refused it.
func DecodePool(cs []Candidate, v []int64) (Grant, int, error) {
	if len(v) < 2 || v[0] < 1 || int(v[0]) > len(cs) {
		return Grant{}, 0, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	i := int(v[0]) - 1
	g, err := Decode(cs[i].Bucket, v[1:])
	return g, i, err
}
