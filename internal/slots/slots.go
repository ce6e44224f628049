// Package slots holds a bucket's concurrency slots in Redis (slots.lua):
// at most n held at once across every process, waiters queued by the
// priority class of their takes and then first come, first served, woken by the release that frees their slot, leases
// renewed while held or awaited, so that a dead holder's slots come back.
// A slot and its tokens are asked for in one call, and the release that
// hands a waiter its slot takes the waiter's tokens too; releases ride on
// the process's next call for the bucket.
// It also keeps the slots a policy grants while Redis is unavailable, in
// the same count as those Redis granted, and registers them in Redis when
// it answers again; and it holds each slot for its caller until released
// (Held), reporting the slots held and what becomes of them.
package slots

import (
	"context"
	"crypto/rand"
	"embed"
	"encoding/hex"
	"errors"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/obs"
	"github.com/sharedquota/quota/internal/pending"
	"github.com/sharedquota/quota/internal/redisx"
	"github.com/sharedquota/quota/internal/store"
)

// The slot script, in parts of one concern each, joined in this order
// into the one script every call runs (see slots.lua): the contract and
// what every operation does first, the queue by priority class, the
// hand-offs, then the operations and the keys' expiry.
var sourceParts = []string{"slots.lua", "queue.lua", "handoff.lua", "ops.lua"}

//go:embed *.lua
var sources embed.FS

var slotsSource = func() string {
	var b strings.Builder
	for _, name := range sourceParts {
		part, err := sources.ReadFile(name)
		if err != nil {
			panic(err)
		}
		b.Write(part)
	}
	return b.String()
}()

// releaseTimeout bounds the Redis call that hands a slot back; the caller
// does not wait for it. A release that fails leaves the slot to its lease,
// which is no longer renewed.
const releaseTimeout = time.Second

// ReleaseDelay is how long a release waits for the process's next call for
// its bucket, on which it rides, before it is sent alone: the longest a
// hand-off to a waiter is delayed so that a release costs no call.
var ReleaseDelay = time.Millisecond

// The suffixes, after a bucket's key, of the keys of its concurrency slots:
// the slots held, the waiters' leases and the queue.
const (
	HeldSuffix    = ":slots"
	WaitingSuffix = ":slots:waiting"
	QueueSuffix   = ":slots:queue"
	TakesSuffix   = ":slots:takes"
)

// The timing of the calls that run in the background: each is bounded by
// callTimeout, and cancellations that find Redis unavailable try again
// with a backoff from minBackoff to maxBackoff.
const (
	callTimeout = 2 * time.Second
	minBackoff  = 50 * time.Millisecond
	maxBackoff  = 500 * time.Millisecond
)

// Slots are a Limiter's concurrency slots: the ones it holds and the ones
// its callers wait for, by bucket, each bucket with the loop that renews
// its leases in Redis. Hand-offs are announced on a channel, on which the
// Limiter listens and hands them to Handed; its waiters keep the listener
// on.
type Slots struct {
	script   *redisx.Script
	rdb      redis.Scripter
	events   *redisx.Listener
	channel  string // on which hand-offs are announced
	clock    func() time.Time
	lease    time.Duration // of each slot and each waiter
	leaseArg any           // the lease in microseconds, as the script reads it
	rejoin   time.Duration // from a missed announcement to the waiters' renewal
	id       string        // this Limiter's, the prefix of its ids
	seq      atomic.Uint64
	logger   *slog.Logger
	obs      *obs.Obs
	onLinger func(key string) // told of a change in the slots held lingering

	// sends counts the releases and cancellations not yet sent, or
	// under way: Flush waits for them.
	sends pending.Count

	// answering is set while Redis answers again and the fleet has yet to
	// resume the shared slots (from Register until Shared): a slot the
	// policy grants meanwhile is held in Redis at once (holdNow).
	answering atomic.Bool

	mu sync.Mutex
	m  map[string]*Set // by the bucket's key
}

// Options are the settings of Slots.
type Options struct {
	Channel string           // on which hand-offs are announced
	Clock   func() time.Time // the callers' clock; nil: the server's
	Lease   time.Duration    // of each slot and each waiter
	Logger  *slog.Logger     // for the slots Redis lost; nil: none
	Obs     *obs.Obs         // reports the slots held and what becomes of them
	// Rejoin is how long after the Limiter listens again its waiters
	// renew (see Missed): long enough for every Limiter to have found
	// Redis again and held in it the slots its policy granted.
	Rejoin time.Duration
}

// A Take is a caller's tokens, asked for with its slot: the KEYS and ARGV
// of the take's script (internal/store's TakeCall), or of a pool's take
// (PoolCall), which chooses its deployment then. With Deadline set, the
// take's longest wait is the caller's deadline: a hand-off counts it down.
type Take struct {
	Keys     []string
	Args     []any
	Deadline bool
}

// Taken is the take's reply to a Take, its integers in order; nil when a
// slot came without its tokens (none were asked for, the take failed, or
// the grant of a hand-off was lost), which its holder then takes itself.
type Taken []int64

// A Set is what a Limiter holds of one bucket's slots and waits for.
type Set struct {
	name     string   // the bucket's, for the logs
	key      string   // the bucket's
	keys     []string // held, waiting, queue, takes
	n        int      // the slots the bucket has, as last asked
	share    int      // of them this process may hold while Redis is unavailable
	users    int      // acquisitions under way
	held     map[string]*holder
	waiting  map[string]*waiter       // in Redis's queue
	local    []*waiter                // for a slot of the share, in order
	cause    error                    // why the waiters were last abandoned
	renewing bool                     // the renewal loop runs
	lingers  int                      // slots held lingering (Held.Linger)
	released []string                 // ids released here, to ride on the next call
	flushing bool                     // a call to send them alone is due
	call     atomic.Pointer[[]string] // keys, then the last take's keys
}

// withTake returns the set's keys followed by those of a take, take.
func (set *Set) withTake(take []string) []string {
	if p := set.call.Load(); p != nil && slices.Equal((*p)[len(set.keys):], take) {
		return *p
	}
	keys := slices.Concat(set.keys, take)
	set.call.Store(&keys)
	return keys
}

// A holder is a slot held here.
type holder struct {
	// since is when the call that last set its lease in Redis began; zero
	// when Redis never held it (the policy granted it).
	since time.Time
	// inUse: its request may be at the provider, so that the slot is held
	// in Redis again should Redis lose it.
	inUse bool
	// lost: Redis lost it before its use; it is not to be used.
	lost bool
	// verify: Confirm asks Redis, whatever its lease says: it was handed
	// by an announcement that may be older than its waiter's new place.
	verify bool
}

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

// New returns the Slots kept in rdb, whose hand-offs events hears.
func New(rdb redis.Scripter, events *redisx.Listener, o Options) *Slots {
	var id [6]byte
	_, _ = rand.Read(id[:]) // never fails
	return &Slots{
		script:   redisx.NewScript(rdb, Source(store.TakeSource())), // to take a caller's tokens with its slot
		rdb:      rdb,
		events:   events,
		channel:  o.Channel,
		clock:    o.Clock,
		lease:    o.Lease,
		leaseArg: o.Lease.Microseconds(),
		rejoin:   o.Rejoin,
		id:       hex.EncodeToString(id[:]),
		logger:   o.Logger,
		obs:      o.Obs,
	}
}

// Source returns the slot script's source around the take's source
// bucket, which it runs as the function bucket(KEYS, ARGV), and the pool's
// take (internal/store's PoolSource), which runs bucket.
func Source(bucket string) string {
	if bucket == "" {
		bucket = "return redis.error_reply('quota: no take script')"
	}
	return "local function bucket(KEYS, ARGV)\n" + bucket + "\nend\n" + store.PoolSource() + slotsSource
}

// run runs op of slots.lua on set's keys with ids, and with take for an
// acquisition, the releases made here since the last call riding on it.
// Should the call fail, they are sent again: a release is idempotent.
func (s *Slots) run(ctx context.Context, set *Set, n int, op string, take *Take, ids ...string) *redis.Cmd {
	s.mu.Lock()
	released := set.released
	set.released = nil
	s.mu.Unlock()
	keys := set.keys
	extra := 0
	if take != nil {
		extra = 1 + len(take.Args)
		keys = set.withTake(take.Keys)
	}
	args := make([]any, 0, 6+len(released)+len(ids)+extra)
	args = append(args, op, n, s.leaseArg, s.channel, redisx.Now(s.clock), len(released))
	for _, id := range released {
		args = append(args, id)
	}
	for _, id := range ids {
		args = append(args, id)
	}
	if take != nil {
		deadline := "0"
		if take.Deadline {
			deadline = "1"
		}
		args = append(args, deadline)
		args = append(args, take.Args...)
	}
	cmd, _ := s.script.Run(ctx, keys, args...)
	if cmd.Err() != nil && len(released) > 0 {
		s.release(set, released...)
	}
	s.sends.Done(len(released))
	return cmd
}

// ErrNone is a try's answer when every slot is held.
var ErrNone = errors.New("no slot free")

// ErrAgain tells a caller waiting for a slot of the policy's share that
// Redis answers again: it is to ask Redis.
var ErrAgain = errors.New("ask Redis again")

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
			keys:    []string{key + HeldSuffix, key + WaitingSuffix, key + QueueSuffix, key + TakesSuffix},
			held:    make(map[string]*holder),
			waiting: make(map[string]*waiter),
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

// newID returns an id no other slot or waiter has.
func (s *Slots) newID() string {
	return s.id + "." + strconv.FormatUint(s.seq.Add(1), 36)
}

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
