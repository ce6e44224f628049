package quota

import (
	"context"
	"time"

	"github.com/sharedquota/quota/internal/slots"
)

// A Slot is one of a bucket's concurrency slots, held from its acquisition
// until Release. While it is held, the Limiter renews its lease in Redis.
type Slot struct {
	h *slots.Held // nil: it holds nothing
}

// Release hands the slot back: the next caller waiting for one of the
// bucket's slots, in any process, gets it. Release returns at once; the
// Redis call runs in the background, and a slot whose release fails comes
// back when its lease ends. Releasing a slot again does nothing. A nil Slot
// may be released.
func (s *Slot) Release() {
	if s != nil {
		s.h.Release()
	}
}

// linger releases the slot d from now: its request ended (cancelled, or
// failed) after it was sent, and the provider may still work on it.
func (s *Slot) linger(d time.Duration) {
	if s != nil {
		s.h.Linger(d)
	}
}

// confirm makes sure, before its request is sent, that the slot is still
// held (see slots.Held.Confirm): a holder that stalled longer than its
// lease may find its slot granted to another. When it is not, confirm
// reports false: the request is to queue again.
func (s *Slot) confirm(ctx context.Context) (bool, error) {
	if s == nil || s.h == nil || !checkLeases {
		return true, nil
	}
	return s.h.Confirm(ctx)
}

// checkLeases is off only in tests: a request is sent on its slot
// without checking its lease first.
var checkLeases = true
