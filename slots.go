package quota

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
	"github.com/sharedquota/quota/internal/breaker"
	"github.com/sharedquota/quota/internal/redisx"
)

//go:embed slots.lua
var slotsSource string

// DefaultSlotLease is how long a concurrency slot outlives the last sign of
// life of the process that holds it, unless WithSlotLease says otherwise.
const DefaultSlotLease = 10 * time.Second

// releaseTimeout bounds the Redis call that hands a slot back; the caller
// does not wait for it. A release that fails leaves the slot to its lease,
// which is no longer renewed.
const releaseTimeout = time.Second

// The suffixes, after a bucket's key, of the keys of its concurrency slots:
// the slots held, the waiters' leases and the queue.
const (
	slotsHeldSuffix    = ":slots"
	slotsWaitingSuffix = ":slots:waiting"
	slotsQueueSuffix   = ":slots:queue"
)

// A Slot is one of a bucket's concurrency slots, held from its acquisition
// until Release. While it is held, the Limiter renews its lease in Redis.
type Slot struct {
	release func()
	once    sync.Once
}

// Release hands the slot back: the next caller waiting for one of the
// bucket's slots, in any process, gets it. Release returns at once; the
// Redis call runs in the background, and a slot whose release fails comes
// back when its lease ends. Releasing a slot again does nothing. A nil Slot
// may be released.
func (s *Slot) Release() {
	if s == nil {
		return
	}
	s.once.Do(func() {
		if s.release != nil {
			s.release()
		}
	})
}

// slots are a Limiter's concurrency slots in Redis (slots.lua): the ones it
// holds and the ones its callers wait for, by bucket, each bucket with the
// loop that renews its leases. Hand-offs are announced on the Limiter's
// control channel (listener.go), which its waiters keep listening.
type slots struct {
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
	m  map[string]*slotSet // by the bucket's key
}

// slotSet is what a Limiter holds of one bucket's slots and waits for.
type slotSet struct {
	b        bucket   // for the breaker
	keys     []string // held, waiting, queue
	n        int      // the slots the bucket has, as last asked
	users    int      // acquisitions under way
	held     map[string]struct{}
	lost     map[string]struct{}  // of held: Redis no longer knows them
	waiting  map[string]chan bool // true: granted; false: abandoned
	cause    error                // why the waiters were last abandoned
	renewing bool                 // the renewal loop runs
}

func newSlots(rdb redis.Scripter, cfg config, events *redisx.Listener) *slots {
	var id [6]byte
	_, _ = rand.Read(id[:]) // never fails
	return &slots{
		script:  redisx.NewScript(rdb, slotsSource),
		rdb:     rdb,
		events:  events,
		channel: cfg.prefix + controlChannel,
		clock:   cfg.clock,
		lease:   cfg.slotLease,
		id:      hex.EncodeToString(id[:]),
		logger:  cfg.logger,
	}
}

// run runs op of slots.lua on set's keys.
func (s *slots) run(ctx context.Context, set *slotSet, n int, op string, ids ...string) *redis.Cmd {
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

// errNoSlot is a try's answer when every slot is held.
var errNoSlot = errors.New("quota: no slot free")

// use returns the set of bucket b, made if new, and keeps it while its
// caller works with it.
func (s *slots) use(b bucket, n int) *slotSet {
	s.mu.Lock()
	defer s.mu.Unlock()
	set, ok := s.m[b.keys[0]]
	if !ok {
		key := b.keys[0]
		set = &slotSet{
			b:       bucket{name: b.name, keys: b.keys[:1:1], lims: b.lims[:1:1]},
			keys:    []string{key + slotsHeldSuffix, key + slotsWaitingSuffix, key + slotsQueueSuffix},
			held:    make(map[string]struct{}),
			waiting: make(map[string]chan bool),
		}
		if s.m == nil {
			s.m = make(map[string]*slotSet)
		}
		s.m[key] = set
	}
	set.n = n
	set.users++
	return set
}

// leave ends an acquisition that use began.
func (s *slots) leave(set *slotSet) {
	s.mu.Lock()
	set.users--
	s.mu.Unlock()
	s.done(set)
}

// acquire asks for one of the n slots of bucket b and waits for it in
// the bucket's queue until ctx ends; with try, it takes one only if one is
// free now. It returns the slot's id.
func (s *slots) acquire(ctx context.Context, b bucket, n int, try bool) (*slotSet, string, error) {
	set := s.use(b, n)
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
		err = fmt.Errorf("%w: unexpected reply %v", ErrScript, v)
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
		return nil, "", errNoSlot
	}
	s.renew(set, time.Duration(v[1])*time.Microsecond)
	select {
	case ok := <-granted:
		if !ok {
			s.forget(set, id)
			s.mu.Lock()
			cause := set.cause
			s.mu.Unlock()
			return nil, "", &abandonedError{cause} // the policy serves
		}
		return set, id, nil
	case <-ctx.Done():
		s.cancel(set, id)
		return nil, "", ctx.Err()
	}
}

// hold moves id from the set's waiters to its holders.
func (s *slots) hold(set *slotSet, id string) {
	s.mu.Lock()
	delete(set.waiting, id)
	set.held[id] = struct{}{}
	s.mu.Unlock()
	s.renew(set, s.lease/4)
}

// forget drops id, which holds nothing.
func (s *slots) forget(set *slotSet, id string) {
	s.mu.Lock()
	delete(set.waiting, id)
	s.mu.Unlock()
}

// cancel takes a waiter that gave up out of the queue, and releases the
// slot that may have been handed to it meanwhile.
func (s *slots) cancel(set *slotSet, id string) {
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

// release hands the slot id back.
func (s *slots) release(set *slotSet, id string) {
	s.mu.Lock()
	delete(set.held, id)
	delete(set.lost, id)
	s.mu.Unlock()
	s.background(set, "release", id)
}

// background runs op for id without making the caller wait, then lets the
// set go if nothing else uses it.
func (s *slots) background(set *slotSet, op, id string) {
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
func (s *slots) done(set *slotSet) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(set.held) == 0 && len(set.waiting) == 0 && set.users == 0 && s.m[set.b.keys[0]] == set {
		delete(s.m, set.b.keys[0])
	}
}

// handed gives the slots of bucket key, announced handed to ids, to the
// waiters here among them.
func (s *slots) handed(key string, ids []string) {
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
func (s *slots) granted(set *slotSet, ids []string) {
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
func (s *slots) renew(set *slotSet, next time.Duration) {
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
func (s *slots) renewLoop(set *slotSet, next time.Duration) {
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

		ctx, cancel := context.WithTimeout(context.Background(), breaker.ProbeTimeout)
		v, err := s.run(ctx, set, n, "renew", ids...).Slice()
		cancel()
		next = s.lease / 4
		if err != nil {
			if errors.Is(classify(context.Background(), err, s.cluster()), ErrUnavailable) {
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
func (s *slots) lostHolders(set *slotSet, ids []string) {
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
			slog.String("bucket", set.b.name),
			slog.Int("slots", count),
		)
	}
}

// An abandonedError is the answer to a waiter that a renewal abandoned
// because Redis is unavailable: the breaker is to trip, and the policy to
// serve.
type abandonedError struct{ cause error }

func (e *abandonedError) Error() string { return "quota: slot renewal failed: " + e.cause.Error() }
func (e *abandonedError) Unwrap() error { return e.cause }

// abandon sends the set's waiters to the policy, Redis being unavailable
// (cause), and takes their ids out of the queue in the background, so that
// once Redis answers they do not take the slots released for callers that
// wait. Should that fail, the ids leave with their leases.
func (s *slots) abandon(set *slotSet, cause error) {
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
func (s *slots) cancelAll(set *slotSet, n int, ids []string) {
	defer s.done(set)
	end := time.Now().Add(s.lease) // when their leases end at the latest
	backoff := breaker.MinBackoff
	for {
		ctx, cancel := context.WithTimeout(context.Background(), min(time.Until(end), releaseTimeout))
		err := s.run(ctx, set, n, "cancel", ids...).Err()
		cancel()
		if err == nil || !errors.Is(classify(context.Background(), err, s.cluster()), ErrUnavailable) {
			return
		}
		if time.Until(end) < backoff {
			return
		}
		time.Sleep(backoff)
		backoff = min(2*backoff, breaker.MaxBackoff)
	}
}

func (s *slots) cluster() bool {
	return redisx.IsCluster(s.rdb)
}
