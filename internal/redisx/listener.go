package redisx

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// A Listener is one subscription to a channel, on one connection to Redis
// (on a Cluster, to one node: PUBLISH reaches every node; on a Ring, one
// per shard, which are servers of their own).
//
// It listens while in use: from the first Use or Hold until it has not
// been used for its idle time and nothing holds it. go-redis resubscribes
// after a reconnect; what was published meanwhile is lost, so every caller
// that waits for a message must also have a timer, and the listener tells
// its Started handler again once it listens again.
type Listener struct {
	rdb     redis.Scripter
	channel string
	h       Handlers

	idle    time.Duration // it stops listening when unused this long
	lastUse atomic.Int64  // unix ns
	mu      sync.Mutex
	on      bool
	holders int
	up      chan struct{} // closed once the subscription is confirmed, or failed
	upAt    time.Time     // when it was
}

// Handlers are what a Listener calls, on its own goroutine.
type Handlers struct {
	Message func(payload string) // a message on the channel
	// Started: it listens, from its start or again after its connection
	// broke (Redis restarted, failed over, or the network dropped): what
	// was published before was missed.
	Started func()
	Stopped func() // it stopped listening
}

// confirmTimeout bounds the wait for the server to confirm a subscription.
const confirmTimeout = 2 * time.Second

// subscriber is a client that can listen on the channels of PUBLISH.
type subscriber interface {
	Subscribe(ctx context.Context, channels ...string) *redis.PubSub
}

// NewListener returns the Listener of channel on rdb, which stops
// listening once unused for idle. Set its Handlers before its first use.
func NewListener(rdb redis.Scripter, channel string, idle time.Duration) *Listener {
	return &Listener{rdb: rdb, channel: channel, idle: idle}
}

// Handle sets what the listener calls; call it before the first use.
func (ls *Listener) Handle(h Handlers) { ls.h = h }

// Idle returns how long the listener stays on unused.
func (ls *Listener) Idle() time.Duration { return ls.idle }

// Use records a use and listens if it does not; it reports whether it was
// listening already.
func (ls *Listener) Use() bool {
	Touch(&ls.lastUse, time.Now().UnixNano())
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.on {
		return true
	}
	ls.start()
	return false
}

// Hold keeps the listener on until the func it returns is called.
func (ls *Listener) Hold() (release func()) {
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
			Touch(&ls.lastUse, time.Now().UnixNano())
		})
	}
}

// Ready returns a channel closed once the listener listens: what is
// published after that reaches it, unless its connection breaks.
func (ls *Listener) Ready() <-chan struct{} {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.up == nil {
		ls.up = make(chan struct{})
		close(ls.up) // a client that cannot subscribe: the timers serve
	}
	return ls.up
}

// Since returns when the listener last began to listen: messages
// published before may have been missed.
func (ls *Listener) Since() time.Time {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.upAt
}

// start subscribes; ls.mu is held.
func (ls *Listener) start() {
	s, ok := ls.rdb.(subscriber)
	if !ok {
		return
	}
	ls.on = true
	ls.up = make(chan struct{})
	go ls.run(s, ls.up)
}

// run hands each message on, until the listener has gone unused.
func (ls *Listener) run(s subscriber, up chan struct{}) {
	subs := ls.subscribe(s) // connects: not on a caller's path
	msgs := make(chan *redis.Message)
	again := make(chan struct{}, 1) // a subscription confirmed after the first
	stop := make(chan struct{})
	defer close(stop)
	for _, sub := range subs {
		defer sub.Close()
		ctx, cancel := context.WithTimeout(context.Background(), confirmTimeout)
		_, _ = sub.Receive(ctx) // the confirmation; without it, the timers serve
		cancel()
		go func() {
			// A confirmation that comes later is go-redis's resubscription
			// after a reconnect: what was published meanwhile is lost.
			for v := range sub.ChannelWithSubscriptions() {
				switch v := v.(type) {
				case *redis.Message:
					select {
					case msgs <- v:
					case <-stop:
						return
					}
				case *redis.Subscription:
					if v.Kind == "subscribe" {
						select {
						case again <- struct{}{}:
						default: // one is pending already
						}
					}
				}
			}
		}()
	}
	ls.started()
	close(up)
	idle := time.NewTicker(ls.idle / 4)
	defer idle.Stop()
	for {
		select {
		case msg := <-msgs:
			if ls.h.Message != nil {
				ls.h.Message(msg.Payload)
			}
		case <-again:
			ls.started()
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
			if ls.h.Stopped != nil {
				ls.h.Stopped()
			}
			return
		}
	}
}

// started records that the listener listens from now on, and tells the
// Started handler: at its start, before Ready, so that whoever waited
// for the listener finds what it was told to do once listening began;
// and again each time it listens again after its connection broke.
func (ls *Listener) started() {
	ls.mu.Lock()
	ls.upAt = time.Now()
	ls.mu.Unlock()
	if ls.h.Started != nil {
		ls.h.Started()
	}
}

// subscribe subscribes to the channel: on one connection, which
// hears every node of a Cluster (PUBLISH reaches them all), or on one per
// shard of a Ring, whose shards are Redis servers of their own.
func (ls *Listener) subscribe(s subscriber) []*redis.PubSub {
	ring, ok := s.(*redis.Ring)
	if !ok {
		return []*redis.PubSub{s.Subscribe(Untraced(), ls.channel)}
	}
	var mu sync.Mutex
	var subs []*redis.PubSub
	_ = ring.ForEachShard(Untraced(), func(ctx context.Context, shard *redis.Client) error {
		sub := shard.Subscribe(ctx, ls.channel)
		mu.Lock()
		subs = append(subs, sub)
		mu.Unlock()
		return nil
	})
	return subs
}
