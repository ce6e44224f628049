package slots

import (
	"context"
	"slices"
	"time"
)

// releaseTimeout bounds the Redis call that hands a slot back; the caller
// does not wait for it. A release that fails leaves the slot to its lease,
// which is no longer renewed.
const releaseTimeout = time.Second

// ReleaseDelay is how long a release waits for the process's next call for
// its bucket, on which it rides, before it is sent alone: the longest a
// hand-off to a waiter is delayed so that a release costs no call.
var ReleaseDelay = time.Millisecond

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
	s.mu.Lock()
	var due []*Set
	for _, set := range s.m {
		if len(set.released) > 0 {
			due = append(due, set)
		}
	}
	s.mu.Unlock()
	for _, set := range due {
		go s.flush(set)
	}
	return s.sends.Wait(ctx)
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
