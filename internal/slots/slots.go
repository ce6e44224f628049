// Package slots holds a bucket's concurrency slots in Redis (slots.lua):
// at most n held at once across every process, waiters queued by the
// priority class of their takes and then first come, first served, woken by the release that frees their slot, leases
// renewed while held or awaited, so that a dead holder's slots come back.
// A slot and its tokens are asked for in one call, and the release that
// hands a waiter its slot takes the waiter's tokens too; releases ride on
// the process's next call for the bucket.
// It also keeps the slots a policy grants while Redis is unavailable, in
// the same count as those Redis granted, and registers them in Redis when
// it answers again.
package slots

import (
	"context"
	"crypto/rand"
	_ "embed"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/pending"
	"github.com/sharedquota/quota/internal/redisx"
)

//go:embed slots.lua
var slotsSource string

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
	id       string        // this Limiter's, the prefix of its ids
	seq      atomic.Uint64
	logger   *slog.Logger
	told     Events

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
	Told    Events           // what the slots do, for the metrics
	// Bucket is the source of the take's script (internal/store's
	// TakeSource: the take's parts alone), which the slot operations run
	// to take a caller's tokens with its slot.
	Bucket string
}

// A Take is a caller's tokens, asked for with its slot: the KEYS and ARGV
// of the take's script (internal/store's TakeCall). With Deadline set, the
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

// Events are told what the slots do, for the metrics. Each may be nil.
type Events struct {
	// Handed: n slots were handed to waiters here by a release.
	Handed func(name string, n int)
	// Checked: a slot's lease was renewed before its first use (kept), or
	// found ended.
	Checked func(name string, kept bool)
	// Registered: n slots in use here that Redis did not hold (granted by
	// the policy, or lost by Redis) are held in Redis again.
	Registered func(name string, n int)
}

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
		script:   redisx.NewScript(rdb, Source(o.Bucket)),
		rdb:      rdb,
		events:   events,
		channel:  o.Channel,
		clock:    o.Clock,
		lease:    o.Lease,
		leaseArg: o.Lease.Microseconds(),
		id:       hex.EncodeToString(id[:]),
		logger:   o.Logger,
		told:     o.Told,
	}
}

// Source returns the slot script's source around the take's source
// bucket, which it runs as the function bucket(KEYS, ARGV).
func Source(bucket string) string {
	if bucket == "" {
		bucket = "return redis.error_reply('quota: no take script')"
	}
	return "local function bucket(KEYS, ARGV)\n" + bucket + "\nend\n" + slotsSource
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

// checked tells of a lease checked before its slot's first use.
func (s *Slots) checked(set *Set, kept bool) {
	if s.told.Checked != nil {
		s.told.Checked(set.name, kept)
	}
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
	if registered > 0 && s.told.Registered != nil {
		s.told.Registered(set.name, registered)
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

// renewReply decodes the reply to a renewal of ids, the first holders of
// them holders: the hint and the states, and the grants of the waiters
// that hold a slot, in order.
func renewReply(reply []any, ids, holders int) (v []int64, grants []Taken, err error) {
	if len(reply) < 1+ids {
		return nil, nil, fmt.Errorf("%w: %d states for %d ids", redisx.ErrReply, len(reply)-1, ids)
	}
	v = make([]int64, 1+ids)
	handed := 0
	for i := range v {
		x, ok := reply[i].(int64)
		if !ok {
			return nil, nil, fmt.Errorf("%w: %v", redisx.ErrReply, reply)
		}
		v[i] = x
		if i > holders && x == slotHolds {
			handed++
		}
	}
	if len(reply) != 1+ids+handed {
		return nil, nil, fmt.Errorf("%w: %d grants for %d hand-offs", redisx.ErrReply, len(reply)-1-ids, handed)
	}
	for _, r := range reply[1+ids:] {
		g, _ := r.(string)
		t, err := parseTaken(g)
		if err != nil {
			t = nil
		}
		grants = append(grants, t)
	}
	return v, grants, nil
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
