package quota

import (
	"sync"
	"time"
)

// DefaultSlotLease is how long a concurrency slot outlives the last sign of
// life of the process that holds it, unless WithSlotLease says otherwise.
const DefaultSlotLease = 10 * time.Second

// A Slot is one of a bucket's concurrency slots, held from its acquisition
// until Release. While it is held, the Limiter renews its lease in Redis.
type Slot struct {
	release func()
	once    sync.Once
}

// Release hands the slot back: the next caller waiting for one of the
// bucket's slots, in any process, gets it. Release returns at once; the
// Redis call runs in the background, and a slot whose release fails comes
// back when its lease ends. Releasing a slot again does nothing. A nil Slot
// may be released.
func (s *Slot) Release() {
	if s == nil {
		return
	}
	s.once.Do(func() {
		if s.release != nil {
			s.release()
		}
	})
}
