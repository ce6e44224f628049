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
	"embed"
	"encoding/hex"
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

// The suffixes, after a bucket's key, of the keys of its concurrency slots:
// the slots held, the waiters' leases and the queue.
const (
	HeldSuffix    = ":slots"
	WaitingSuffix = ":slots:waiting"
	QueueSuffix   = ":slots:queue"
	TakesSuffix   = ":slots:takes"
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
	// Bucket is the bucket script's source (internal/store), which the
	// slot operations run to take a caller's tokens with its slot.
	Bucket string
}

// A Take is a caller's tokens, asked for with its slot: the bucket
// script's KEYS and ARGV of a take. With Deadline set, the take's longest
// wait is the caller's deadline: a hand-off counts it down.
type Take struct {
	Keys     []string
	Args     []any
	Deadline bool
}

// Taken is the bucket script's reply to a Take, its integers in order; nil
// when a slot came without its tokens (none were asked for, the bucket
// script failed, or the grant of a hand-off was lost), which its holder
// then takes itself.
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

// Source returns the slot script's source around the bucket script's
// source bucket, which it runs as the function bucket(KEYS, ARGV).
func Source(bucket string) string {
	if bucket == "" {
		bucket = "return redis.error_reply('quota: no bucket script')"
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

// done lets the set go once nothing is held or awaited of it.
func (s *Slots) done(set *Set) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(set.held) == 0 && len(set.waiting) == 0 && len(set.local) == 0 && len(set.released) == 0 && !set.flushing &&
		set.users == 0 && s.m[set.key] == set {
		delete(s.m, set.key)
	}
}

func (s *Slots) cluster() bool {
	return redisx.IsCluster(s.rdb)
}
