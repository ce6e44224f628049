package slots

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redisx"
)

// ErrNone is a try's answer when every slot is held.
var ErrNone = errors.New("no slot free")

// Acquire asks for one of the n slots of the bucket called name under key
// and waits for it in the bucket's queue until ctx ends; with try, it
// takes one only if one is free now, and fails with ErrNone otherwise.
// With take, the same call takes the caller's tokens when the slot is
// free, and a waiter's are taken by the release that hands it its slot:
// the grant is the take's, or nil when the slot came without its tokens.
// It returns the slot's set and id, for Release. A waiter that a renewal
// found Redis unavailable for fails with an *AbandonedError.
func (s *Slots) Acquire(ctx context.Context, name, key string, n int, try bool, take *Take) (*Set, string, Taken, error) {
	set := s.use(name, key, n)
	defer s.leave(set)
	if !try {
		// Listen for the hand-off before asking: it may come first.
		// Should it be lost, a renewal finds the slot within a quarter
		// lease.
		defer s.events.Hold()()
		select {
		case <-s.events.Ready():
		case <-ctx.Done():
			return nil, "", nil, ctx.Err()
		}
	}
	start := time.Now()
	w := &waiter{id: s.newID(), granted: make(chan handoff, 1), since: start}
	s.mu.Lock()
	set.waiting[w.id] = w // before the call: its announcement may come first
	s.mu.Unlock()

	op := "acquire"
	if try {
		op = "try"
	}
	granted, hint, taken, err := acquireReply(s.run(ctx, set, n, op, take, w.id))
	if err != nil {
		s.forget(set, w.id)
		return nil, "", nil, err
	}
	if granted {
		s.mu.Lock()
		delete(set.waiting, w.id)
		set.held[w.id] = &holder{since: start}
		s.mu.Unlock()
		s.renew(set, s.lease/4)
		return set, w.id, taken, nil
	}
	if try {
		s.forget(set, w.id)
		return nil, "", nil, ErrNone
	}
	s.renew(set, hint)
	select {
	case h := <-w.granted:
		if !h.ok {
			s.forget(set, w.id)
			s.mu.Lock()
			cause := set.cause
			s.mu.Unlock()
			return nil, "", nil, &AbandonedError{cause} // the policy serves
		}
		return set, w.id, h.taken, nil
	case <-ctx.Done():
		s.cancel(set, w.id)
		return nil, "", nil, ctx.Err()
	}
}

// acquireReply decodes the reply to an acquire or a try: whether the slot
// was granted, with the grant of its take, or how long until the first
// lease held ends.
func acquireReply(cmd *redis.Cmd) (granted bool, hint time.Duration, taken Taken, err error) {
	v, err := cmd.Slice()
	if err != nil {
		return false, 0, nil, err
	}
	if len(v) < 2 {
		return false, 0, nil, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	code, ok1 := v[0].(int64)
	us, ok2 := v[1].(int64)
	if !ok1 || !ok2 {
		return false, 0, nil, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	if code != 1 {
		return false, time.Duration(us) * time.Microsecond, nil, nil
	}
	if len(v) > 2 {
		g, _ := v[2].(string)
		if taken, err = parseTaken(g); err != nil {
			return false, 0, nil, err
		}
	}
	return true, 0, taken, nil
}

// parseTaken decodes a grant as the slot script writes it: integers joined
// by commas, nil for "".
func parseTaken(g string) (Taken, error) {
	if g == "" {
		return nil, nil
	}
	parts := strings.Split(g, ",")
	taken := make(Taken, len(parts))
	for i, p := range parts {
		v, err := strconv.ParseInt(p, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%w: grant %q", redisx.ErrReply, g)
		}
		taken[i] = v
	}
	return taken, nil
}

// InUse marks the slot id of set in use: its work has begun.
func (s *Slots) InUse(set *Set, id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if h := set.held[id]; h != nil {
		h.inUse = true
	}
}

// forget drops the waiter id, which holds nothing.
func (s *Slots) forget(set *Set, id string) {
	s.mu.Lock()
	delete(set.waiting, id)
	s.mu.Unlock()
}
