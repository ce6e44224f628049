package quota

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// A pause recorded by any process moves the bucket's queue in Redis, and
// the script announces the move on the bucket's pause channel. Each
// Limiter listens on the channels of the buckets it has callers sleeping
// on, and moves those whose grants were taken before the pause by as much
// as the queue moved. A lost announcement (a reconnecting subscriber, a
// full buffer) leaves its sleepers on their old schedule, never stalled.

// Bounds on listening: a bucket's channel is listened to while the
// Limiter has sleepers on it and for subscriptionIdle after, on at most
// maxSubscriptions buckets at once; a bucket beyond that keeps its old
// schedule. recentPauses are kept for recentFor, for grants whose reply
// arrives after the announcement of a pause that came after their take.
const (
	subscriptionIdle = 10 * time.Second
	maxSubscriptions = 64
	recentPauses     = 4
	recentFor        = time.Second
)

// sleepers are a Limiter's callers sleeping on grants of the shared
// bucket, by bucket key, with the subscriptions that tell them of pauses.
type sleepers struct {
	rdb redis.Scripter

	mu sync.Mutex
	m  map[string]*channel // by the bucket's key
}

// channel is what a Limiter listens to on one bucket's pause channel.
type channel struct {
	sleeping map[*sleeper]struct{}
	sub      *redis.PubSub // nil until subscribed
	idle     *time.Timer   // closes the subscription when nobody sleeps
	recent   []announced
}

// announced is one pause announcement: the queue moved by shift for the
// grants taken before at, on the server's clock in microseconds.
type announced struct {
	at, shift int64
	heard     time.Time
}

// sleeper is one caller sleeping on a grant.
type sleeper struct {
	takenAt int64         // its take, on the server's clock, µs
	moved   chan struct{} // signalled when shift grows
	mu      sync.Mutex    // guards shift
	shift   time.Duration // how far pauses moved its grant
	ch      *channel      // its bucket's
}

func (s *sleeper) move(d time.Duration) {
	s.mu.Lock()
	s.shift += d
	s.mu.Unlock()
	select {
	case s.moved <- struct{}{}:
	default:
	}
}

func (s *sleeper) moves() time.Duration {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shift
}

// subscriber is a client that can listen on the channels of PUBLISH: every
// client but a Cluster's, which listens on those of SPUBLISH.
type subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// add registers a caller sleeping on a grant of bucket key taken at
// takenAt, and listens on the bucket's channel if nobody does yet; the
// Redis calls that start listening run in ctx, the caller's, so that a
// tracing hook nests them under the caller's wait.
func (ss *sleepers) add(ctx context.Context, key string, takenAt int64) *sleeper {
	s := &sleeper{takenAt: takenAt, moved: make(chan struct{}, 1)}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ch, ok := ss.m[key]
	if !ok {
		if len(ss.m) >= maxSubscriptions {
			return s // not listened to: the old schedule
		}
		if ss.m == nil {
			ss.m = make(map[string]*channel)
		}
		ch = &channel{sleeping: make(map[*sleeper]struct{})}
		ss.m[key] = ch
		go ss.listen(context.WithoutCancel(ctx), key, ch)
	}
	if ch.idle != nil {
		ch.idle.Stop()
		ch.idle = nil
	}
	ch.sleeping[s] = struct{}{}
	s.ch = ch
	for _, a := range ch.recent {
		if time.Since(a.heard) < recentFor && takenAt <= a.at {
			s.shift += time.Duration(a.shift) * time.Microsecond
		}
	}
	return s
}

// remove forgets a sleeper that woke, and lets the bucket's subscription
// go once nobody has slept on it for subscriptionIdle.
func (ss *sleepers) remove(key string, s *sleeper) {
	if s.ch == nil {
		return
	}
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ch := s.ch
	delete(ch.sleeping, s)
	if len(ch.sleeping) > 0 || ch.idle != nil {
		return
	}
	ch.idle = time.AfterFunc(subscriptionIdle, func() {
		ss.mu.Lock()
		defer ss.mu.Unlock()
		if len(ch.sleeping) > 0 || ss.m[key] != ch {
			return
		}
		delete(ss.m, key)
		if ch.sub != nil {
			ch.sub.Close()
		}
		ch.sub = nil // a listen still subscribing closes its own
	})
}

// listen subscribes to the pause channel of bucket key and moves the
// sleepers of each announcement, until the subscription is closed. Once
// subscribed, it reads the pause in force, if any, from its record: an
// announcement made before the subscription, which the first callers to
// sleep on a bucket would otherwise miss.
func (ss *sleepers) listen(ctx context.Context, key string, ch *channel) {
	name := key + channelSuffix
	var sub *redis.PubSub
	switch c := ss.rdb.(type) {
	case *redis.ClusterClient:
		sub = c.SSubscribe(ctx, name)
	case subscriber:
		sub = c.Subscribe(ctx, name)
	default:
		return
	}
	ss.mu.Lock()
	if ss.m[key] != ch { // let go while subscribing
		ss.mu.Unlock()
		sub.Close()
		return
	}
	ch.sub = sub
	ss.mu.Unlock()

	rctx, cancel := context.WithTimeout(ctx, probeTimeout)
	if _, err := sub.Receive(rctx); err == nil { // subscribed
		if g, ok := ss.rdb.(getter); ok {
			if record, err := g.Get(rctx, key+pausedSuffix).Result(); err == nil {
				for _, a := range parseRecord(record) {
					ss.heard(ch, a[0], a[1])
				}
			}
		}
	}
	cancel()
	for msg := range sub.Channel() {
		if at, shift, ok := parseAnnouncement(msg.Payload); ok {
			ss.heard(ch, at, shift)
		}
	}
}

type getter interface {
	Get(ctx context.Context, key string) *redis.StringCmd
}

// heard moves the sleepers of ch whose grants were taken before at by
// shift, once for each announcement however often it is heard.
func (ss *sleepers) heard(ch *channel, at, shift int64) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	for _, a := range ch.recent {
		if a.at == at {
			return
		}
	}
	ch.recent = append(ch.recent, announced{at: at, shift: shift, heard: time.Now()})
	if len(ch.recent) > recentPauses {
		ch.recent = ch.recent[1:]
	}
	for s := range ch.sleeping {
		if s.takenAt <= at {
			s.move(time.Duration(shift) * time.Microsecond)
		}
	}
}

// parseAnnouncement reads "<at> <shift>", microseconds.
func parseAnnouncement(p string) (at, shift int64, ok bool) {
	a, b, found := strings.Cut(p, " ")
	if !found {
		return 0, 0, false
	}
	at, err1 := strconv.ParseInt(a, 10, 64)
	shift, err2 := strconv.ParseInt(b, 10, 64)
	return at, shift, err1 == nil && err2 == nil && shift > 0
}

// parseRecord reads the announcements of a pause's record,
// "<end> <at>:<shift> ...".
func parseRecord(record string) [][2]int64 {
	var out [][2]int64
	for _, f := range strings.Fields(record)[1:] {
		a, b, found := strings.Cut(f, ":")
		at, err1 := strconv.ParseInt(a, 10, 64)
		shift, err2 := strconv.ParseInt(b, 10, 64)
		if found && err1 == nil && err2 == nil && shift > 0 {
			out = append(out, [2]int64{at, shift})
		}
	}
	return out
}

// errOutpaced tells waitTokens that its grant was taken at a rate that a
// change had already made slower (controlState.outpaced).
var errOutpaced = errors.New("quota: taken at a rate no longer in force")

// sleepOn waits for a grant of bucket b that falls due after g.wait, and
// later by as much as the pauses recorded meanwhile moved it: a provider's
// pause, announced on the bucket's channel, and an operator's (Pause),
// which the bucket's control record tells. When ctx ends first, or a pause
// moves the grant past ctx's deadline, it returns how far the grant had
// been moved with the error, for the refund. When a change of the Limit
// in force outpaced the grant, it returns errOutpaced.
func (l *Limiter) sleepOn(ctx context.Context, b bucket, g grant) (time.Duration, error) {
	if g.wait <= 0 {
		return 0, nil
	}
	due := time.Now().Add(g.wait)
	takenAt := g.takenAt(b)
	s := l.sleepers.add(ctx, b.keys[0], takenAt)
	defer l.sleepers.remove(b.keys[0], s)
	deadline, hasDeadline := ctx.Deadline()
	var ctl *controlState
	var replaced <-chan struct{}
	if b.ctl != nil {
		ctl = b.ctl.load()
		replaced = ctl.replaced
	}
	// when returns when the grant falls due, false while a pause with no
	// end holds it.
	when := func() (time.Time, bool) {
		at := due.Add(s.moves())
		if ctl == nil {
			return at, true
		}
		at = ctl.rescale(at, takenAt, b.lims[0].Rate, b.ctl.rate(ctl))
		return ctl.hold(at, takenAt)
	}
	t := time.NewTimer(0)
	t.Stop()
	defer t.Stop()
	for {
		if ctl != nil && ctl.outpaced(takenAt, b.lims[0].Rate, b.ctl.rate(ctl)) {
			return 0, errOutpaced
		}
		at, ends := when()
		if ends && hasDeadline && at.After(deadline) {
			return at.Sub(due), ErrWouldExceedDeadline
		}
		if ends {
			t.Reset(time.Until(at))
		}
		select {
		case <-t.C:
			if at, ends := when(); ends && !time.Now().Before(at) {
				return 0, nil
			}
		case <-s.moved:
		case <-replaced:
			ctl = b.ctl.load()
			replaced = ctl.replaced
		case <-ctx.Done():
			if at, ends := when(); ends {
				return at.Sub(due), ctx.Err()
			}
			return s.moves(), ctx.Err()
		}
	}
}
