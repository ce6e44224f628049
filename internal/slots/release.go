package slots

import (
	"context"
	"slices"
	"time"

	"github.com/sharedquota/quota/internal/obs"
)

// InUse marks the slot id of set in use: its work has begun.
func (s *Slots) InUse(set *Set, id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := set.held[id]; h != nil {
		h.inUse = true
	}
}

// elapsed returns how long ago t was, by the monotonic clock or the wall
// clock, whichever says longer: a suspended machine may stop the first.
func elapsed(t time.Time) time.Duration {
	now := time.Now()
	return max(now.Sub(t), now.Round(0).Sub(t.Round(0)))
}

// Confirm makes sure, before its first use, that the slot id of set is
// still held: a holder that stalled longer than its lease (a stopped
// process, a suspended machine) may find its slot granted to another. A
// lease with less than a quarter left is renewed; a slot that Redis no
// longer holds is dropped, and Confirm reports false: the caller is to
// queue again. On success the slot is in use. An error from Redis drops
// the slot too.
func (s *Slots) Confirm(ctx context.Context, set *Set, id string) (bool, error) {
	s.mu.Lock()
	h := set.held[id]
	switch {
	case h == nil:
		s.mu.Unlock()
		return false, nil
	case h.since.IsZero() || !h.lost && !h.verify && elapsed(h.since) < s.lease*3/4:
		h.inUse = true
		s.mu.Unlock()
		return true, nil
	}
	lost, n := h.lost, set.n
	s.mu.Unlock()
	if !lost {
		start := time.Now()
		v, err := s.run(ctx, set, n, "renew", nil, "0", "1", id).Slice()
		if err != nil {
			s.Release(set, id)
			return false, err
		}
		if len(v) == 2 && v[1] == int64(slotHolds) {
			s.mu.Lock()
			if h := set.held[id]; h != nil {
				h.since, h.inUse, h.verify = start, true, false
			}
			s.mu.Unlock()
			s.checked(set, true)
			return true, nil
		}
	}
	s.checked(set, false)
	s.mu.Lock()
	delete(set.held, id)
	s.grantLocal(set)
	s.mu.Unlock()
	s.done(set)
	return false, nil
}

// checked counts a lease checked before its slot's first use: renewed
// (kept), or found ended.
func (s *Slots) checked(set *Set, kept bool) {
	event := obs.Lapsed
	if kept {
		event = obs.Renewed
	}
	s.obs.SlotEvent(set.name, event, 1)
}

// forget drops the waiter id, which holds nothing.
func (s *Slots) forget(set *Set, id string) {
	s.mu.Lock()
	delete(set.waiting, id)
	s.mu.Unlock()
}

// cancel takes a waiter that gave up out of the queue, and releases the
// slot that may have been handed to it meanwhile.
func (s *Slots) cancel(set *Set, id string) {
	s.mu.Lock()
	_, granted := set.held[id]
	delete(set.waiting, id)
	delete(set.held, id)
	s.grantLocal(set)
	s.mu.Unlock()
	if granted {
		s.release(set, id)
		return
	}
	s.background(set, "cancel", id)
}

// Release hands the slot id of set back: on the next call for the bucket
// when Redis may hold it, at once otherwise.
func (s *Slots) Release(set *Set, id string) {
	s.mu.Lock()
	h := set.held[id]
	delete(set.held, id)
	s.grantLocal(set)
	s.mu.Unlock()
	if h != nil && h.since.IsZero() {
		s.done(set) // Redis never held it
		return
	}
	s.release(set, id)
}

// release makes ids ride on the next call for set, which is sent for them
// alone should no other come within ReleaseDelay.
func (s *Slots) release(set *Set, ids ...string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sends.Add(len(ids))
	set.released = append(set.released, ids...)
	if !set.flushing {
		set.flushing = true
		time.AfterFunc(ReleaseDelay, func() { s.flush(set) })
	}
}

// flush sends the releases that no call took with it.
func (s *Slots) flush(set *Set) {
	s.mu.Lock()
	set.flushing = false
	ids := set.released
	set.released = nil
	n := set.n
	s.mu.Unlock()
	if len(ids) == 0 {
		s.done(set)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
	defer cancel()
	// On failure, the leases end them: they are renewed no longer.
	_ = s.run(ctx, set, n, "release", nil, ids...).Err()
	s.mu.Lock()
	kept := len(set.released)
	set.released = slices.DeleteFunc(set.released, func(id string) bool { return slices.Contains(ids, id) })
	dropped := kept - len(set.released)
	s.mu.Unlock()
	s.sends.Done(len(ids) + dropped)
	s.done(set)
}

// Flush sends at once the releases waiting for a call to ride on, and
// returns once they and the cancellations under way have been sent (or
// failed, which leaves their slots to their leases), or with ctx's error.
// Releases made meanwhile are waited for too.
func (s *Slots) Flush(ctx context.Context) error {
	for _, set := range s.sets(func(set *Set) bool { return len(set.released) > 0 }) {
		go s.flush(set)
	}
	return s.sends.Wait(ctx)
}

// background runs op for ids without making the caller wait, then lets
// the set go if nothing else uses it.
func (s *Slots) background(set *Set, op string, ids ...string) {
	s.mu.Lock()
	n := set.n
	s.mu.Unlock()
	s.sends.Add(1)
	go func() {
		defer s.sends.Done(1)
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		defer cancel()
		_ = s.run(ctx, set, n, op, nil, ids...).Err() // on failure, the lease ends it
		s.done(set)
	}()
}

// done lets the set go once nothing is held or awaited of it.
func (s *Slots) done(set *Set) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(set.held) == 0 && len(set.waiting) == 0 && len(set.local) == 0 && len(set.released) == 0 && !set.flushing &&
		set.users == 0 && s.m[set.key] == set {
		delete(s.m, set.key)
	}
}

// sets returns the sets for which keep reports true, read under s.mu.
func (s *Slots) sets(keep func(*Set) bool) []*Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	var sets []*Set
	for _, set := range s.m {
		if keep(set) {
			sets = append(sets, set)
		}
	}
	return sets
}
