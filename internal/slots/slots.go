// Package slots holds a bucket's concurrency slots in Redis (slots.lua):
// at most n held at once across every process, waiters queued first come,
// first served and woken by the release that frees their slot, leases
// renewed while held or awaited, so that a dead holder's slots come back.
package slots

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redisx"
)

//go:embed slots.lua
var slotsSource string

// releaseTimeout bounds the Redis call that hands a slot back; the caller
// does not wait for it. A release that fails leaves the slot to its lease,
// which is no longer renewed.
const releaseTimeout = time.Second

// The suffixes, after a bucket's key, of the keys of its concurrency slots:
// the slots held, the waiters' leases and the queue.
const (
	HeldSuffix    = ":slots"
	WaitingSuffix = ":slots:waiting"
	QueueSuffix   = ":slots:queue"
)

// The timing of the calls that run in the background: each is bounded by
// callTimeout, and cancellations that find Redis unavailable try again
// with a backoff from minBackoff to maxBackoff.
const (
	callTimeout = 2 * time.Second
	minBackoff  = 50 * time.Millisecond
	maxBackoff  = 500 * time.Millisecond
)

// Slots are a Limiter's concurrency slots in Redis: the ones it holds and
// the ones its callers wait for, by bucket, each bucket with the loop that
// renews its leases. Hand-offs are announced on a channel, on which the
// Limiter listens and hands them to Handed; its waiters keep the listener
// on.
type Slots struct {
	script  *redisx.Script
	rdb     redis.Scripter
	events  *redisx.Listener
	channel string // on which hand-offs are announced
	clock   func() time.Time
	lease   time.Duration // of each slot and each waiter
	id      string        // this Limiter's, the prefix of its ids
	seq     atomic.Uint64
	logger  *slog.Logger

	mu sync.Mutex
	m  map[string]*Set // by the bucket's key
}

// A Set is what a Limiter holds of one bucket's slots and waits for.
type Set struct {
	name     string   // the bucket's, for the logs
	key      string   // the bucket's
	keys     []string // held, waiting, queue
	n        int      // the slots the bucket has, as last asked
	users    int      // acquisitions under way
	held     map[string]struct{}
	lost     map[string]struct{}  // of held: Redis no longer knows them
	waiting  map[string]chan bool // true: granted; false: abandoned
	cause    error                // why the waiters were last abandoned
	renewing bool                 // the renewal loop runs
}

// New returns the Slots kept in rdb, whose hand-offs are published on
// channel, on which events listens; each slot and waiter has a lease of
// lease, on the clock now (nil: the server's). Lost holders are logged to
// logger.
func New(rdb redis.Scripter, events *redisx.Listener, channel string, now func() time.Time, lease time.Duration, logger *slog.Logger) *Slots {
	var id [6]byte
	_, _ = rand.Read(id[:]) // never fails
	return &Slots{
		script:  redisx.NewScript(rdb, slotsSource),
		rdb:     rdb,
		events:  events,
		channel: channel,
		clock:   now,
		lease:   lease,
		id:      hex.EncodeToString(id[:]),
		logger:  logger,
	}
}

// run runs op of slots.lua on set's keys.
func (s *Slots) run(ctx context.Context, set *Set, n int, op string, ids ...string) *redis.Cmd {
	args := make([]any, 0, 5+len(ids))
	now := ""
	if s.clock != nil {
		now = strconv.FormatInt(s.clock().UnixMicro(), 10)
	}
	args = append(args, op, n, s.lease.Microseconds(), s.channel, now)
	for _, id := range ids {
		args = append(args, id)
	}
	cmd, _ := s.script.Run(ctx, set.keys, args...)
	return cmd
}

// ErrNone is a try's answer when every slot is held.
var ErrNone = errors.New("no slot free")

// use returns the set of the bucket called name under key, made if new,
// and keeps it while its caller works with it.
func (s *Slots) use(name, key string, n int) *Set {
	s.mu.Lock()
	defer s.mu.Unlock()
	set, ok := s.m[key]
	if !ok {
		set = &Set{
			name:    name,
			key:     key,
			keys:    []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix},
			held:    make(map[string]struct{}),
			waiting: make(map[string]chan bool),
		}
		if s.m == nil {
			s.m = make(map[string]*Set)
		}
		s.m[key] = set
	}
	set.n = n
	set.users++
	return set
}

// leave ends an acquisition that use began.
func (s *Slots) leave(set *Set) {
	s.mu.Lock()
	set.users--
	s.mu.Unlock()
	s.done(set)
}

// Acquire asks for one of the n slots of the bucket called name under key
// and waits for it in the bucket's queue until ctx ends; with try, it
// takes one only if one is free now, and fails with ErrNone otherwise. It
// returns the slot's set and id, for Release. A waiter that a renewal
// found Redis unavailable for fails with an *AbandonedError.
func (s *Slots) Acquire(ctx context.Context, name, key string, n int, try bool) (*Set, string, error) {
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
			return nil, "", ctx.Err()
		}
	}
	id := s.id + "." + strconv.FormatUint(s.seq.Add(1), 36)
	granted := make(chan bool, 1)
	s.mu.Lock()
	set.waiting[id] = granted // before the call: its announcement may come first
	s.mu.Unlock()

	op := "acquire"
	if try {
		op = "try"
	}
	v, err := s.run(ctx, set, n, op, id).Int64Slice()
	if err == nil && len(v) != 2 {
		err = fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	if err != nil {
		s.forget(set, id)
		return nil, "", err
	}
	if v[0] == 1 {
		s.hold(set, id)
		return set, id, nil
	}
	if try {
		s.forget(set, id)
		return nil, "", ErrNone
	}
	s.renew(set, time.Duration(v[1])*time.Microsecond)
	select {
	case ok := <-granted:
		if !ok {
			s.forget(set, id)
			s.mu.Lock()
			cause := set.cause
			s.mu.Unlock()
			return nil, "", &AbandonedError{cause} // the policy serves
		}
		return set, id, nil
	case <-ctx.Done():
		s.cancel(set, id)
		return nil, "", ctx.Err()
	}
}

// hold moves id from the set's waiters to its holders.
func (s *Slots) hold(set *Set, id string) {
	s.mu.Lock()
	delete(set.waiting, id)
	set.held[id] = struct{}{}
	s.mu.Unlock()
	s.renew(set, s.lease/4)
}

// forget drops id, which holds nothing.
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
	delete(set.lost, id)
	s.mu.Unlock()
	op := "cancel"
	if granted {
		op = "release"
	}
	s.background(set, op, id)
}

// Release hands the slot id of set back, in the background.
func (s *Slots) Release(set *Set, id string) {
	s.mu.Lock()
	delete(set.held, id)
	delete(set.lost, id)
	s.mu.Unlock()
	s.background(set, "release", id)
}

// background runs op for id without making the caller wait, then lets the
// set go if nothing else uses it.
func (s *Slots) background(set *Set, op, id string) {
	s.mu.Lock()
	n := set.n
	s.mu.Unlock()
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
		defer cancel()
		_ = s.run(ctx, set, n, op, id).Err() // on failure, the lease ends it
		s.done(set)
	}()
}

// done lets the set go once nothing is held or awaited of it.
func (s *Slots) done(set *Set) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(set.held) == 0 && len(set.waiting) == 0 && set.users == 0 && s.m[set.key] == set {
		delete(s.m, set.key)
	}
}

// Handed gives the slots of the bucket under key, announced handed to
// ids, to the waiters here among them.
func (s *Slots) Handed(key string, ids []string) {
	s.mu.Lock()
	set := s.m[key]
	s.mu.Unlock()
	if set == nil {
		return
	}
	prefix := s.id + "."
	var mine []string
	for _, id := range ids {
		if strings.HasPrefix(id, prefix) {
			mine = append(mine, id)
		}
	}
	if len(mine) > 0 {
		s.granted(set, mine)
	}
}

// granted hands the slots announced in payload to their waiters here.
func (s *Slots) granted(set *Set, ids []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		if ch, ok := set.waiting[id]; ok {
			delete(set.waiting, id)
			set.held[id] = struct{}{}
			ch <- true
		}
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
	slotUnknown = -1 // Redis lost it
	slotWaits   = 0
	slotHolds   = 1
)

// renewLoop renews the leases of the set's ids every quarter lease, and
// sooner while callers wait: when the first lease held ends, so that a
// dead holder's slot comes back as its lease ends. A waiter that a renewal
// finds holding a slot gets it, should its announcement have been lost. A
// waiter that Redis lost is queued again by the renewal itself, at the
// end of the queue, and keeps waiting; a holder that Redis lost keeps its
// slot, since nothing can be undone, and is logged once and no longer
// renewed. When Redis is unavailable, the waiters go to the policy
// (abandon).
func (s *Slots) renewLoop(set *Set, next time.Duration) {
	for {
		time.Sleep(min(max(next, time.Millisecond), s.lease/4))
		s.mu.Lock()
		// "h", then the h ids held, then those awaited.
		ids := make([]string, 1, 1+len(set.held)+len(set.waiting))
		for id := range set.held {
			if _, lost := set.lost[id]; !lost {
				ids = append(ids, id)
			}
		}
		ids[0] = strconv.Itoa(len(ids) - 1)
		for id := range set.waiting {
			ids = append(ids, id)
		}
		if len(ids) == 1 {
			set.renewing = false
			s.mu.Unlock()
			return
		}
		n := set.n
		s.mu.Unlock()

		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		v, err := s.run(ctx, set, n, "renew", ids...).Slice()
		cancel()
		next = s.lease / 4
		if err != nil {
			if redisx.Outage(context.Background(), err, s.cluster()) != nil {
				s.abandon(set, err)
			}
			continue
		}
		if len(v) > 0 {
			if us, ok := v[0].(int64); ok {
				next = time.Duration(us)*time.Microsecond + time.Millisecond
			}
		}
		// The states of the ids, in the order sent, after the hint.
		h, _ := strconv.Atoi(ids[0])
		var held, lost []string
		for i := 1; i < len(v) && i < len(ids); i++ {
			switch v[i] {
			case int64(slotHolds):
				held = append(held, ids[i])
			case int64(slotUnknown):
				if i <= h {
					lost = append(lost, ids[i])
				}
			}
		}
		s.granted(set, held)
		s.lostHolders(set, lost)
	}
}

// lostHolders notes the ids held here that Redis no longer knows of: their
// slots may be taken by others while they are still held, so that the
// bucket has more in use than it has slots until they are released.
func (s *Slots) lostHolders(set *Set, ids []string) {
	if len(ids) == 0 {
		return
	}
	s.mu.Lock()
	count := 0
	for _, id := range ids {
		if _, ok := set.held[id]; !ok {
			continue // released meanwhile
		}
		if set.lost == nil {
			set.lost = make(map[string]struct{})
		}
		set.lost[id] = struct{}{}
		count++
	}
	s.mu.Unlock()
	if count > 0 && s.logger != nil {
		s.logger.LogAttrs(context.Background(), slog.LevelWarn,
			"quota: Redis lost concurrency slots held here; the bucket may have more in use than it has slots until they are released",
			slog.String("bucket", set.name),
			slog.Int("slots", count),
		)
	}
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
	for id, ch := range set.waiting {
		delete(set.waiting, id)
		ids = append(ids, id)
		set.cause = cause
		ch <- false
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
		err := s.run(ctx, set, n, "cancel", ids...).Err()
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
