package slots

import (
	"context"
	"slices"
)

// AcquireLocal waits until ctx ends for a slot of the bucket called name
// under key, of n slots, from the share this process may hold while Redis
// is unavailable: it holds at most share at once, those Redis granted
// before among them. With try, it takes one only if one is free now, and
// fails with ErrNone otherwise. Callers wait in order; they fail with
// ErrAgain once Redis answers again (Shared). The slot is in use from its
// grant, and is registered in Redis when Redis answers (Register).
func (s *Slots) AcquireLocal(ctx context.Context, name, key string, n, share int, try bool) (*Set, string, error) {
	set := s.use(name, key, n)
	defer s.leave(set)
	id := s.newID()
	s.mu.Lock()
	set.share = share
	if len(set.local) == 0 && len(set.held) < share {
		set.held[id] = &holder{inUse: true}
		s.mu.Unlock()
		s.renew(set, s.lease/4)
		s.holdNow(set)
		return set, id, nil
	}
	if try {
		s.mu.Unlock()
		return nil, "", ErrNone
	}
	w := &waiter{id: id, granted: make(chan handoff, 1)}
	set.local = append(set.local, w)
	s.mu.Unlock()
	select {
	case h := <-w.granted:
		if !h.ok {
			return nil, "", ErrAgain
		}
		s.renew(set, s.lease/4)
		s.holdNow(set)
		return set, id, nil
	case <-ctx.Done():
		s.mu.Lock()
		i := slices.Index(set.local, w)
		if i >= 0 {
			set.local = slices.Delete(set.local, i, i+1)
		}
		s.mu.Unlock()
		if i < 0 && (<-w.granted).ok {
			s.Release(set, id) // granted as the context ended
		}
		return nil, "", ctx.Err()
	}
}

// HoldOpen holds a slot of the bucket called name under key, of n slots,
// that the policy granted without counting (FailOpen): it is in use from
// its grant, and registered in Redis when Redis answers (Register).
func (s *Slots) HoldOpen(name, key string, n int) (*Set, string) {
	set := s.use(name, key, n)
	defer s.leave(set)
	id := s.newID()
	s.mu.Lock()
	set.held[id] = &holder{inUse: true}
	s.mu.Unlock()
	s.renew(set, s.lease/4)
	s.holdNow(set)
	return set, id
}

// holdNow holds set's slots in use in Redis at once while Redis answers
// again before the fleet resumes the shared slots (see answering): the
// Limiters of the fleet each hold theirs again as they resume, and one
// that resumes a moment before another would otherwise be granted shared
// slots beside those the other's policy granted meanwhile.
func (s *Slots) holdNow(set *Set) {
	if !s.answering.Load() {
		return
	}
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		defer cancel()
		_, _, _ = s.renewOnce(ctx, set)
	}()
}

// Shared sends the callers waiting for a slot of a share to Redis, which
// answers again: they fail with ErrAgain.
func (s *Slots) Shared() {
	s.answering.Store(false)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, set := range s.m {
		for _, w := range set.local {
			w.granted <- handoff{}
		}
		set.local = nil
	}
}

// grantLocal, with s.mu held, grants the set's share to its local waiters
// in order while it holds fewer slots than its share.
func (s *Slots) grantLocal(set *Set) {
	for len(set.local) > 0 && len(set.held) < set.share {
		w := set.local[0]
		set.local = set.local[1:]
		set.held[w.id] = &holder{inUse: true}
		w.granted <- handoff{ok: true}
	}
}
