package slots

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sharedquota/quota/internal/obs"
)

// A Held is a slot its caller holds, from its grant until Release,
// counted in the metrics under the mode it was granted in. A nil Held
// holds nothing.
type Held struct {
	s         *Slots
	mode      string
	set       *Set
	id        string
	lingering atomic.Bool
	once      sync.Once
}

// Hold returns the slot id of set, granted in mode (the Limiter's name of
// it), as its caller holds it, and counts it held.
func (s *Slots) Hold(mode string, set *Set, id string) *Held {
	s.obs.SlotHeld(mode, set.name, obs.Held, 1)
	return &Held{s: s, mode: mode, set: set, id: id}
}

// Mode returns the mode the slot was granted in.
func (h *Held) Mode() string { return h.mode }

// InUse marks the slot in use: its work has begun.
func (h *Held) InUse() { h.s.InUse(h.set, h.id) }

// Release hands the slot back (see Slots.Release), once.
func (h *Held) Release() {
	if h == nil {
		return
	}
	h.once.Do(func() {
		h.s.Release(h.set, h.id)
		state := obs.Held
		if h.lingering.Load() {
			state = obs.Lingering
			h.s.lingered(h.set, -1)
		}
		h.s.obs.SlotHeld(h.mode, h.set.name, state, -1)
	})
}

// Linger releases the slot d from now: its request ended (cancelled, or
// failed) after it was sent, and the provider may still work on it.
func (h *Held) Linger(d time.Duration) {
	if h == nil || d <= 0 {
		h.Release()
		return
	}
	if h.lingering.CompareAndSwap(false, true) {
		h.s.lingered(h.set, 1)
		h.s.obs.SlotHeld(h.mode, h.set.name, obs.Held, -1)
		h.s.obs.SlotHeld(h.mode, h.set.name, obs.Lingering, 1)
		h.s.obs.SlotEvent(h.set.name, obs.Lingered, 1)
	}
	time.AfterFunc(d, h.Release)
}

// Confirm makes sure, before its request is sent, that the slot is still
// held, renewing its lease when less than a quarter of it is left (see
// Slots.Confirm). When it is not, the slot holds nothing any longer and
// Confirm reports false.
func (h *Held) Confirm(ctx context.Context) (bool, error) {
	ok, err := h.s.Confirm(ctx, h.set, h.id)
	if !ok {
		h.once.Do(func() { h.s.obs.SlotHeld(h.mode, h.set.name, obs.Held, -1) })
	}
	return ok, err
}

// lingered counts d more slots of set held lingering, and tells the
// function OnLinger gave.
func (s *Slots) lingered(set *Set, d int) {
	s.mu.Lock()
	set.lingers += d
	s.mu.Unlock()
	if s.onLinger != nil {
		s.onLinger(set.key)
	}
}

// OnLinger has f told the key of each bucket whose slots held lingering
// change in number. Call it before the first use.
func (s *Slots) OnLinger(f func(key string)) { s.onLinger = f }

// Lingering returns how many slots of the bucket whose key is key this
// process holds lingering.
func (s *Slots) Lingering(key string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if set := s.m[key]; set != nil {
		return set.lingers
	}
	return 0
}
