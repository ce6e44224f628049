package quota

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota/internal/slots"
)

// DefaultSlotLease is how long a concurrency slot outlives the last sign of
// life of the process that holds it, unless WithSlotLease says otherwise.
const DefaultSlotLease = 10 * time.Second

// A Slot is one of a bucket's concurrency slots, held from its acquisition
// until Release. While it is held, the Limiter renews its lease in Redis.
type Slot struct {
	l         *Limiter // nil: it holds nothing
	mode      Mode     // in which it was granted
	name      string   // the bucket's
	set       *slots.Set
	id        string
	lingering atomic.Bool
	once      sync.Once
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
		if s.l == nil {
			return
		}
		s.l.slots.Release(s.set, s.id)
		state := slotHeld
		if s.lingering.Load() {
			state = slotLingering
		}
		s.l.obs.slotHeld(s.mode, s.name, state, -1)
	})
}

// linger releases the slot d from now: its request ended (cancelled, or
// failed) after it was sent, and the provider may still work on it.
func (s *Slot) linger(d time.Duration) {
	if s == nil || s.l == nil || d <= 0 {
		s.Release()
		return
	}
	if s.lingering.CompareAndSwap(false, true) {
		s.l.obs.slotHeld(s.mode, s.name, slotHeld, -1)
		s.l.obs.slotHeld(s.mode, s.name, slotLingering, 1)
		s.l.obs.slotEvent(s.name, slotLingered, 1)
	}
	time.AfterFunc(d, s.Release)
}

// confirm makes sure, before its request is sent, that the slot is still
// held, and renews its lease when less than a quarter of it is left: a
// holder that stalled longer than its lease may find its slot granted to
// another. When it is not, the slot holds nothing any longer and confirm
// reports false: the request is to queue again.
func (s *Slot) confirm(ctx context.Context) (bool, error) {
	if s == nil || s.l == nil || !checkLeases {
		return true, nil
	}
	ok, err := s.l.slots.Confirm(ctx, s.set, s.id)
	if !ok {
		s.once.Do(func() { s.l.obs.slotHeld(s.mode, s.name, slotHeld, -1) })
	}
	return ok, err
}

// checkLeases is off only in tests: a request is sent on its slot
// without checking its lease first.
var checkLeases = true
