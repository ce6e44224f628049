package store

import (
	"context"
	"slices"
	"time"
)

// What a Store's sharing of calls holds, for the tests of the packages
// that use it.

// Queued returns how many takes of the bucket under key wait behind its
// call in flight.
func (s *Store) Queued(key string) int {
	if s.batches == nil {
		return 0
	}
	bs := s.batches
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return len(bs.flights[key].queue)
}

// Held reports whether a take holds the call of the bucket under key.
func (s *Store) Held(key string) bool {
	if s.batches == nil {
		return false
	}
	bs := s.batches
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return bs.flights[key].held != nil
}

// Placed reports whether a take whose context is holds the call of the
// bucket under key, or waits behind its call in flight.
func (s *Store) Placed(key string, is func(context.Context) bool) bool {
	if s.batches == nil {
		return false
	}
	bs := s.batches
	bs.mu.Lock()
	defer bs.mu.Unlock()
	f := bs.flights[key]
	match := func(q *queuedTake) bool { return q != nil && is(q.ctx) }
	return match(f.held) || slices.ContainsFunc(f.queue, match)
}

// Horizon returns where the Store last saw the queue of the bucket under
// key end, if it remembers one.
func (s *Store) Horizon(key string) (time.Time, bool) {
	if s.batches == nil {
		return time.Time{}, false
	}
	bs := s.batches
	bs.mu.Lock()
	defer bs.mu.Unlock()
	end, ok := bs.horizons[key]
	return end, ok
}

// Horizons returns how many ends of queues the Store remembers.
func (s *Store) Horizons() int {
	if s.batches == nil {
		return 0
	}
	bs := s.batches
	bs.mu.Lock()
	defer bs.mu.Unlock()
	return len(bs.horizons)
}
