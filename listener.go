package quota

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A listener is a Limiter's one subscription: every announcement of every
// bucket the Limiter uses comes on the prefix's control channel, on one
// connection to Redis (on a Cluster, to one node: PUBLISH reaches every
// node). A payload is a bucket's key, whose control record changed, or
// "s <key> <id>...", the concurrency slots handed to those waiters.
//
// It listens while the Limiter is in use: from the first acquisition until
// none has been made for controlIdle and no caller sleeps, waits or holds
// anything that an announcement may concern. go-redis resubscribes after a
// reconnect; what was announced meanwhile is lost, and every caller that
// waits for an announcement also has a timer.
type listener struct {
	rdb     redis.Scripter
	channel string

	// What an announcement is for: set once, before the first use.
	control func(key string)               // a bucket's record changed
	handed  func(key string, ids []string) // slots handed to waiters
	stopped func()                         // it stopped listening
	started func()                         // it listens: what came before was missed

	idle    time.Duration // it stops listening when unused this long
	lastUse atomic.Int64  // unix ns
	mu      sync.Mutex
	on      bool
	holders int
	up      chan struct{} // closed once the subscription is confirmed, or failed
	upAt    time.Time     // when it was
}

// subscriber is a client that can listen on the channels of PUBLISH.
type subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

func newListener(rdb redis.Scripter, prefix string) *listener {
	return &listener{rdb: rdb, channel: prefix + controlChannel, idle: controlIdle}
}

// use records a use of the Limiter and listens if it does not; it reports
// whether it was listening already.
func (ls *listener) use() bool {
	touch(&ls.lastUse, time.Now().UnixNano())
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.on {
		return true
	}
	ls.start()
	return false
}

// hold keeps the listener on until the func it returns is called.
func (ls *listener) hold() (release func()) {
	ls.mu.Lock()
	ls.holders++
	if !ls.on {
		ls.start()
	}
	ls.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			ls.mu.Lock()
			ls.holders--
			ls.mu.Unlock()
			touch(&ls.lastUse, time.Now().UnixNano())
		})
	}
}

// ready returns a channel closed once the listener listens: what is
// announced after that reaches it, unless its connection breaks.
func (ls *listener) ready() <-chan struct{} {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.up == nil {
		ls.up = make(chan struct{})
		close(ls.up) // a client that cannot subscribe: the timers serve
	}
	return ls.up
}

// since returns when the listener last began to listen: announcements
// made before may have been missed.
func (ls *listener) since() time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.upAt
}

// start subscribes; ls.mu is held.
func (ls *listener) start() {
	s, ok := ls.rdb.(subscriber)
	if !ok {
		return
	}
	ls.on = true
	ls.up = make(chan struct{})
	go ls.run(s, ls.up)
}

// run hands each announcement on, until the Limiter has gone unused.
func (ls *listener) run(s subscriber, up chan struct{}) {
	subs := ls.subscribe(s) // connects: not on a caller's path
	msgs := make(chan *redis.Message)
	stop := make(chan struct{})
	defer close(stop)
	for _, sub := range subs {
		defer sub.Close()
		ctx, cancel := context.WithTimeout(context.Background(), probeTimeout)
		_, _ = sub.Receive(ctx) // the confirmation; without it, the timers serve
		cancel()
		go func() {
			for msg := range sub.Channel() {
				select {
				case msgs <- msg:
				case <-stop:
					return
				}
			}
		}()
	}
	ls.mu.Lock()
	ls.upAt = time.Now()
	ls.mu.Unlock()
	close(up)
	if ls.started != nil {
		ls.started()
	}
	idle := time.NewTicker(ls.idle / 4)
	defer idle.Stop()
	for {
		select {
		case msg := <-msgs:
			ls.dispatch(msg.Payload)
		case <-idle.C:
			if time.Since(time.Unix(0, ls.lastUse.Load())) < ls.idle {
				continue
			}
			ls.mu.Lock()
			if ls.holders > 0 {
				ls.mu.Unlock()
				continue
			}
			ls.on = false
			ls.mu.Unlock()
			if ls.stopped != nil {
				ls.stopped()
			}
			return
		}
	}
}

// subscribe subscribes to the control channel: on one connection, which
// hears every node of a Cluster (PUBLISH reaches them all), or on one per
// shard of a Ring, whose shards are Redis servers of their own.
func (ls *listener) subscribe(s subscriber) []*redis.PubSub {
	ring, ok := s.(*redis.Ring)
	if !ok {
		return []*redis.PubSub{s.Subscribe(untraced(), ls.channel)}
	}
	var mu sync.Mutex
	var subs []*redis.PubSub
	_ = ring.ForEachShard(untraced(), func(ctx context.Context, shard *redis.Client) error {
		sub := shard.Subscribe(ctx, ls.channel)
		mu.Lock()
		subs = append(subs, sub)
		mu.Unlock()
		return nil
	})
	return subs
}

func (ls *listener) dispatch(payload string) {
	if rest, ok := strings.CutPrefix(payload, "s "); ok {
		fields := strings.Fields(rest)
		if len(fields) > 1 && ls.handed != nil {
			ls.handed(fields[0], fields[1:])
		}
		return
	}
	if ls.control != nil {
		ls.control(payload)
	}
}
