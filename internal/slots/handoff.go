package slots

import (
	"strings"
	"time"
)

// A waiter is a caller waiting for a slot.
type waiter struct {
	id      string
	granted chan handoff
	since   time.Time // when its lease in Redis was last set
	// requeued: Redis lost it and a renewal queued it again, so that an
	// announcement of a hand-off to it may be one it slept through.
	requeued bool
}

// A handoff is what a waiter is told: granted (ok) with the grant of its
// take, or abandoned, or to ask again (not ok).
type handoff struct {
	ok    bool
	taken Taken
}

// Handed gives the slots of the bucket under key, announced handed to
// ids, to the waiters here among them. Each id may be followed by "=" and
// the grant of its take.
func (s *Slots) Handed(key string, ids []string) {
	s.mu.Lock()
	set := s.m[key]
	s.mu.Unlock()
	if set == nil {
		return
	}
	prefix := s.id + "."
	var mine []string
	var taken []Taken
	for _, id := range ids {
		if !strings.HasPrefix(id, prefix) {
			continue
		}
		id, grant, _ := strings.Cut(id, "=")
		t, err := parseTaken(grant)
		if err != nil {
			t = nil // its holder takes its tokens itself
		}
		mine = append(mine, id)
		taken = append(taken, t)
	}
	if len(mine) > 0 {
		s.granted(set, mine, taken, time.Time{})
	}
}

// granted hands the slots ids of set to their waiters here, each with the
// grant of its take and its lease as set at since, or as the waiter's was
// when since is zero.
func (s *Slots) granted(set *Set, ids []string, taken []Taken, since time.Time) {
	s.mu.Lock()
	count := 0
	for i, id := range ids {
		if w, ok := set.waiting[id]; ok {
			delete(set.waiting, id)
			h := &holder{since: since}
			if since.IsZero() {
				h.since = w.since // a hand-off keeps the waiter's lease
				h.verify = w.requeued
			}
			set.held[id] = h
			w.granted <- handoff{ok: true, taken: taken[i]}
			count++
		}
	}
	s.mu.Unlock()
	if count > 0 && s.told.Handed != nil {
		s.told.Handed(set.name, count)
	}
}
