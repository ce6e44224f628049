package control

import (
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// The kinds of announcement on the control channel.
const (
	Malformed = iota // none of the others: ignored
	Changed          // a bucket's control record changed
	Handed           // concurrency slots handed to waiters
	GaveBack         // settles moved a bucket's queues back
	Pushed           // takes of higher classes pushed a bucket's lower classes
)

// An Announcement is a message on the control channel, read (see Parse).
type Announcement struct {
	Kind int
	Key  string // the bucket's first key
	Body string // what the kind says of it
}

// Parse reads a message on the control channel: a bucket's key, whose
// control record changed; "s <id>[=<grant>]...", a newline and a bucket's
// key: the concurrency slots of that bucket handed to those waiters, with
// the grants of their tokens (the body: the ids and grants); "b" and each
// layer's "<suffix>=<µs>", a newline and a bucket's key: how far settles
// have moved its layers' queues back (see Controls.GaveBack); or "p",
// when, and each class's "<class>:<suffix>=<µs>", a newline and a
// bucket's key: how far takes of higher classes have pushed its lower
// classes' queues (see Controls.Pushed).
func Parse(payload string) Announcement {
	var kind int
	switch {
	case strings.HasPrefix(payload, "s "):
		kind = Handed
	case strings.HasPrefix(payload, "b "):
		kind = GaveBack
	case strings.HasPrefix(payload, "p "):
		kind = Pushed
	default:
		return Announcement{Kind: Changed, Key: payload}
	}
	body, key, ok := strings.Cut(payload[2:], "\n")
	if !ok {
		return Announcement{}
	}
	return Announcement{Kind: kind, Key: key, Body: body}
}

// Announced reads again the record of the bucket whose first key is key,
// announced on the control channel.
func (c *Controls) Announced(key string) {
	if e := c.Lookup(key); e != nil {
		go c.refresh(e)
	}
}

// GaveBack takes in an announcement of the give-backs of the bucket whose
// first key is key: the timeline's count after them, and the layers'
// anchors, as a record read replies them. When the entry's state is the
// one just before, the anchors replace its own, so that its callers asleep
// in the queue go sooner without a read; when it missed a move before,
// the record is read again.
func (c *Controls) GaveBack(key, payload string) {
	e := c.Lookup(key)
	if e == nil {
		return
	}
	count, rest, _ := strings.Cut(payload, " ")
	ev, err := strconv.ParseInt(count, 10, 64)
	anchors, err2 := store.ParseAnchors(rest)
	if err != nil || err2 != nil {
		return
	}
	for {
		st := e.state.Load()
		switch {
		case st.readAt.IsZero() || ev <= st.ev:
			return // never read, or told already
		case ev > st.ev+1:
			go c.refresh(e)
			return
		}
		next := *st
		next.ev, next.anchors, next.replaced = ev, anchors, make(chan struct{})
		if e.state.CompareAndSwap(st, &next) {
			close(st.replaced)
			return
		}
	}
}

// Pushed takes in an announcement of the pushes of the bucket whose first
// key is key: when, on the server's clock, then each class's push counts
// in each layer, "<class>:<suffix>=<µs>" separated by spaces. The state
// they raise replaces the entry's, so that its callers asleep in the
// lower classes go later without a read.
func (c *Controls) Pushed(key, pushes string) {
	e := c.Lookup(key)
	if e == nil {
		return
	}
	when, rest, _ := strings.Cut(pushes, " ")
	at, err := strconv.ParseInt(when, 10, 64)
	if err != nil {
		return
	}
	suffixes := append([]string{""}, strings.Fields(e.layers)...)
	k := len(suffixes)
	told := map[int]int64{} // by class*k + layer
	for part := range strings.FieldsSeq(rest) {
		cs, v, ok := strings.Cut(part, "=")
		class, suffix, ok2 := strings.Cut(cs, ":")
		cl, err1 := strconv.Atoi(class)
		n, err2 := strconv.ParseInt(v, 10, 64)
		if !ok || !ok2 || err1 != nil || err2 != nil || cl < 0 || cl > 7 {
			return
		}
		for i, s := range suffixes {
			if s == suffix {
				told[cl*k+i] = n
			}
		}
	}
	for {
		st := e.state.Load()
		if st.readAt.IsZero() {
			return // never read: its first read tells
		}
		size := len(st.pushes)
		for i := range told {
			size = max(size, (i/k+1)*k)
		}
		pushes := make([]int64, size)
		copy(pushes, st.pushes)
		raised := false
		for i, n := range told {
			if n > pushes[i] {
				pushes[i], raised = n, true
			}
		}
		if !raised {
			return
		}
		next := *st
		next.pushes, next.replaced = pushes, make(chan struct{})
		next.pushAt = st.readAt.Add(time.Duration(at-st.serverAt) * time.Microsecond)
		if e.state.CompareAndSwap(st, &next) {
			close(st.replaced)
			return
		}
	}
}

// stateOf turns the record r into a Limiter's state, its times moved to
// the local clock as of sent, when the read was sent.
