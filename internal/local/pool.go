package local

import (
	"math"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// Soonest returns which of cs, a pool's deployments, this process's local
// shares grant n soonest, as the pool's script chooses in Redis (see
// store.TakePool): a deployment of the first tier that grants at once,
// else a last resort that does, else the one that grants soonest. It
// reserves nothing.
func (ls *Shares) Soonest(cs []store.Candidate, n store.Cost, workers int) int {
	best, soonest := 0, time.Duration(math.MaxInt64)
	for _, last := range []bool{false, true} {
		for i, c := range cs {
			if c.Last != last {
				continue
			}
			r, err := ls.Reserve(c.Bucket, n, workers)
			if err != nil {
				continue
			}
			r.Undo()
			if r.Delay == 0 {
				return i
			}
			if r.Delay < soonest {
				best, soonest = i, r.Delay
			}
		}
	}
	return best
}
