package slots

import (
	"context"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/redisx"
)

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
	if count > 0 {
		s.obs.SlotEvent(set.name, obs.Handed, count)
	}
}

// renew makes sure the set's leases are renewed while it holds or awaits
// anything, the first time within next.
func (s *Slots) renew(set *Set, next time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if set.renewing {
		return
	}
	set.renewing = true
	go s.renewLoop(set, next)
}

// The states of an id in the reply of a renewal (slots.lua).
const (
	slotUnknown  = -1 // Redis lost it
	slotWaits    = 0
	slotHolds    = 1
	slotAgain    = 2 // Redis lost it, and holds it again
	slotRequeued = 3 // Redis lost it, and it waits again
)

// renewLoop renews the leases of the set's ids every quarter lease, and
// sooner while callers wait: when the first lease held ends, so that a
// dead holder's slot comes back as its lease ends. When Redis is
// unavailable, the waiters go to the policy (abandon).
func (s *Slots) renewLoop(set *Set, next time.Duration) {
	for {
		time.Sleep(min(max(next, time.Millisecond), s.lease/4))
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		hint, empty, err := s.renewOnce(ctx, set)
		cancel()
		switch {
		case empty:
			s.mu.Lock()
			if len(set.held)+len(set.waiting) == 0 {
				set.renewing = false
				s.mu.Unlock()
				return
			}
			s.mu.Unlock()
			next = s.lease / 4 // holders Redis lost, until they go
		case err != nil:
			if redisx.Outage(context.Background(), err, s.cluster()) != nil {
				s.abandon(set, err)
			}
			next = s.lease / 4
		default:
			next = hint
		}
	}
}

// Missed is told that hand-offs may have been announced that the
// Limiter did not hear: it listens again after its connection broke, and
// Redis may have restarted and forgotten its queues. The waiters, which
// make no call while they wait, renew Rejoin later rather than at their
// next renewal, a quarter lease away: the renewal finds the slots handed
// to them meanwhile, and queues again those Redis lost, so that a restart
// does not leave them waiting while callers that came after are served.
func (s *Slots) Missed() {
	for _, set := range s.sets(func(set *Set) bool { return len(set.waiting) > 0 }) {
		time.AfterFunc(s.rejoin, func() {
			ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
			defer cancel()
			if _, _, err := s.renewOnce(ctx, set); redisx.Outage(context.Background(), err, s.cluster()) != nil {
				s.abandon(set, err)
			}
		})
	}
}

// Register renews every set's leases now, and so holds in Redis again the
// slots in use here that it does not hold: those the policy granted while
// Redis was unavailable, and those Redis lost meanwhile. The Limiter
// calls it once Redis answers, before the fleet resumes the shared slots;
// until they resume (Shared), a slot the policy grants is held in Redis at
// once.
func (s *Slots) Register(ctx context.Context) error {
	s.mu.Lock()
	sets := make([]*Set, 0, len(s.m))
	for _, set := range s.m {
		sets = append(sets, set)
	}
	s.mu.Unlock()
	s.answering.Store(true) // a slot granted from now on is held at once
	for _, set := range sets {
		if _, _, err := s.renewOnce(ctx, set); err != nil {
			s.answering.Store(false)
			return err
		}
	}
	return nil
}

// Reregister is off only in tests: a slot in use that Redis does not hold
// is not held again.
var Reregister = true

// renewOnce renews the leases of what the set holds and awaits, and
// returns how long until the first lease held ends; empty when it holds
// and awaits nothing. A waiter that the renewal finds holding a slot gets
// it, should its announcement have been lost. A waiter that Redis lost is
// queued again by the renewal itself, at the end of the queue, and keeps
// waiting. A holder in use that Redis lost is held in Redis again, and
// logged; one not yet in use is marked lost, so that Confirm drops it.
func (s *Slots) renewOnce(ctx context.Context, set *Set) (hint time.Duration, empty bool, err error) {
	s.mu.Lock()
	var use, idle, wait []string
	for id, h := range set.held {
		switch {
		case h.inUse && Reregister:
			use = append(use, id)
		case !h.lost:
			idle = append(idle, id)
		}
	}
	for id := range set.waiting {
		wait = append(wait, id)
	}
	n := set.n
	s.mu.Unlock()
	if len(use)+len(idle)+len(wait) == 0 {
		return 0, true, nil
	}
	ids := slices.Concat(use, idle, wait)
	args := append([]string{strconv.Itoa(len(use)), strconv.Itoa(len(idle))}, ids...)
	start := time.Now()
	reply, err := s.run(ctx, set, n, "renew", nil, args...).Slice()
	if err != nil {
		return 0, false, err
	}
	v, grants, err := renewReply(reply, len(ids), len(use)+len(idle))
	if err != nil {
		return 0, false, err
	}
	var handed, orphans []string
	var taken []Taken
	again, registered, g := 0, 0, 0
	s.mu.Lock()
	for i, id := range ids {
		state := v[1+i]
		if i >= len(use)+len(idle) {
			if state == slotHolds {
				g++
			}
			if w := set.waiting[id]; w != nil {
				switch state {
				case slotHolds:
					handed = append(handed, id)
					taken = append(taken, grants[g-1])
				case slotWaits:
					w.since = start
				case slotRequeued:
					w.since, w.requeued = start, true
				}
			}
			continue
		}
		h := set.held[id]
		switch {
		case h == nil:
			if state == slotAgain {
				orphans = append(orphans, id) // released meanwhile
			}
		case state == slotHolds:
			h.since = start
		case state == slotAgain:
			registered++
			if !h.since.IsZero() {
				again++ // lost by Redis, not granted by the policy
			}
			h.since = start
		case state == slotUnknown:
			h.lost = true
		}
	}
	s.mu.Unlock()
	s.granted(set, handed, taken, start)
	if len(orphans) > 0 {
		s.release(set, orphans...)
	}
	if registered > 0 {
		// Slots in use here that Redis did not hold (granted by the
		// policy, or lost by Redis) are held in Redis again.
		s.obs.SlotEvent(set.name, obs.Registered, registered)
	}
	if again > 0 && s.logger != nil {
		s.logger.LogAttrs(context.Background(), slog.LevelWarn,
			"quota: Redis had lost concurrency slots in use here; they are held again, and the bucket may have more in use than it has slots until they are released",
			slog.String("bucket", set.name),
			slog.Int("slots", again),
		)
	}
	return time.Duration(v[0])*time.Microsecond + time.Millisecond, false, nil
}

// An AbandonedError is the answer to a waiter that a renewal abandoned
// because Redis is unavailable (Cause): the breaker is to trip, and the
// policy to serve.
type AbandonedError struct{ Cause error }

func (e *AbandonedError) Error() string { return "slot renewal failed: " + e.Cause.Error() }
func (e *AbandonedError) Unwrap() error { return e.Cause }

// abandon sends the set's waiters to the policy, Redis being unavailable
// (cause), and takes their ids out of the queue in the background, so that
// once Redis answers they do not take the slots released for callers that
// wait. Should that fail, the ids leave with their leases.
func (s *Slots) abandon(set *Set, cause error) {
	s.mu.Lock()
	ids := make([]string, 0, len(set.waiting))
	for id, w := range set.waiting {
		delete(set.waiting, id)
		ids = append(ids, id)
		set.cause = cause
		w.granted <- handoff{}
	}
	n := set.n
	s.mu.Unlock()
	if len(ids) > 0 {
		go s.cancelAll(set, n, ids)
	}
}

// cancelAll cancels ids, that nobody here waits for any longer, trying
// again with backoff until their leases end, then lets the set go if
// nothing else uses it.
func (s *Slots) cancelAll(set *Set, n int, ids []string) {
	defer s.done(set)
	end := time.Now().Add(s.lease) // when their leases end at the latest
	backoff := minBackoff
	for {
		ctx, cancel := context.WithTimeout(context.Background(), min(time.Until(end), releaseTimeout))
		err := s.run(ctx, set, n, "cancel", nil, ids...).Err()
		cancel()
		if redisx.Outage(context.Background(), err, s.cluster()) == nil {
			return
		}
		if time.Until(end) < backoff {
			return
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, maxBackoff)
	}
}

func (s *Slots) cluster() bool {
	return redisx.IsCluster(s.rdb)
}
