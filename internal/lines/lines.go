// Package lines keeps a Limiter's callers that wait for their tenants'
// turns on a bucket shared between tenants, in line by bucket and tenant:
// only the first of each line asks Redis, so that a tenant's requests
// held in one process cost one call at a time.
package lines

import (
	"context"
	"sync"
	"time"

	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/store"
)

// Lines are the lines of a Limiter's callers. The zero Lines is empty.
type Lines struct {
	mu sync.Mutex
	m  map[key]*line
}

type key struct{ bucket, tenant string }

type line struct {
	turn  chan struct{} // holds a value while a caller is first
	wake  chan struct{} // a give-back on the bucket: the first, held, asks again at once
	users int           // callers in line or first, under Lines.mu
	next  time.Time     // when the first may ask: the bucket's queue has room for it, as far as the last grant told
}

// A Turn is a caller's place at the head of its line.
type Turn struct {
	ls   *Lines
	key  key
	ln   *line
	once sync.Once
}

// Join waits until the caller is first in the line of tenant on the
// bucket whose key is bucket, and returns its turn; it fails with ctx's
// error.
func (ls *Lines) Join(ctx context.Context, bucket, tenant string) (*Turn, error) {
	k := key{bucket, tenant}
	ls.mu.Lock()
	if ls.m == nil {
		ls.m = make(map[key]*line)
	}
	ln := ls.m[k]
	if ln == nil {
		ln = &line{turn: make(chan struct{}, 1), wake: make(chan struct{}, 1)}
		ls.m[k] = ln
	}
	ln.users++
	ls.mu.Unlock()
	t := &Turn{ls: ls, key: k, ln: ln}
	select {
	case ln.turn <- struct{}{}: // waiting senders are served in order
		return t, nil
	case <-ctx.Done():
		t.gone()
		return nil, ctx.Err()
	}
}

// Due returns when the caller first in line may ask.
func (t *Turn) Due() time.Time {
	t.ls.mu.Lock()
	defer t.ls.mu.Unlock()
	return t.ln.next
}

// Wake receives, while the caller is first, when a give-back on the
// bucket may have made it its tenant's turn (see GaveBack).
func (t *Turn) Wake() <-chan struct{} { return t.ln.wake }

// Leave lets the next caller in line be first, and ask from next on.
func (t *Turn) Leave(next time.Time) {
	t.once.Do(func() {
		t.ls.mu.Lock()
		t.ln.next = next
		t.ls.mu.Unlock()
		<-t.ln.turn
		t.gone()
	})
}

// GaveBack wakes the first caller of each line of the bucket whose key is
// bucket, held while it may not be its tenant's turn any longer: a settle
// gave tokens back, and its tenant's share with them.
func (ls *Lines) GaveBack(bucket string) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for k, ln := range ls.m {
		if k.bucket == bucket {
			select {
			case ln.wake <- struct{}{}:
			default:
			}
		}
	}
}

// gone counts the caller out of its line.
func (t *Turn) gone() {
	t.ls.mu.Lock()
	defer t.ls.mu.Unlock()
	if t.ln.users--; t.ln.users == 0 {
		delete(t.ls.m, t.key)
	}
}

// RoomAfter returns when a bucket's queue, which a grant with a wait of
// wait just joined, has room for the next take of cost, which costs its
// slowest layer d (see store.FairQueue).
func RoomAfter(wait, d time.Duration) time.Time {
	return time.Now().Add(wait + d - store.FairQueue)
}

// A Place is a take's place in its tenant's line across the times it
// asks Redis: first in the line from Join until its take is answered
// otherwise than held, and kept told of give-backs while it is held. The
// zero Place, and a nil one but for Join, is in no line.
type Place struct {
	turn   *Turn
	listen func() // set while its take is held: ends the announcements
}

// Join makes the caller first in the line of tenant on the bucket whose
// key is bucket, unless it is already, and then waits until the bucket's
// queue has room for it, as far as the grant of the caller before it
// told, or a give-back wakes it. It fails with ctx's error.
func (p *Place) Join(ctx context.Context, ls *Lines, bucket, tenant string) error {
	if p.turn != nil {
		return nil
	}
	t, err := ls.Join(ctx, bucket, tenant)
	if err != nil {
		return err
	}
	p.turn = t
	return control.Sleep(ctx, time.Until(t.Due()), t.Wake())
}

// Wake receives, while the caller is first, when a give-back on the
// bucket may have made it its tenant's turn; nil otherwise.
func (p *Place) Wake() <-chan struct{} {
	if p == nil || p.turn == nil {
		return nil
	}
	return p.turn.Wake()
}

// Held notes that the caller's take was held for its tenant's turn: it
// stays first, and hold (called once) keeps the give-backs announced
// until it leaves.
func (p *Place) Held(hold func() (done func())) {
	if p != nil && p.turn != nil && p.listen == nil {
		p.listen = hold()
	}
}

// Leave lets the next caller in line be first, and ask from next on
// (when next is not zero), if the caller is first.
func (p *Place) Leave(next time.Time) {
	if p == nil || p.turn == nil {
		return
	}
	p.turn.Leave(next)
	if p.listen != nil {
		p.listen()
	}
	p.turn, p.listen = nil, nil
}

// First reports whether the caller is first in its line.
func (p *Place) First() bool { return p != nil && p.turn != nil }
