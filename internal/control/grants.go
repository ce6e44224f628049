package control

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
)

// What a Limiter's callers were granted goes to the bucket's record with
// the Limiter's next read of it, by second: each layer's record keeps the
// tokens its callers were granted in each of the last seconds
// (record.lua's tally), so that an operator reads the fleet's rate from
// Redis without a dashboard. A grant counts when its caller goes, not when
// it was taken: a grant given up before it fell due costs the provider
// nothing. The take's script counts nothing, and so costs nothing more.

// maxTally bounds the seconds a Limiter keeps untold, as the record keeps
// no more of them (record.lua's histLen).
const maxTally = 64

// tally is what an Entry's callers were granted and the record was not
// told yet, by second.
type tally struct {
	mu   sync.Mutex
	secs []second
}

// second is what was granted of each layer in one second.
type second struct {
	at int64 // unix seconds
	n  []float64
}

// Count adds what a caller of e was granted at now, of each of the
// bucket's layers: each[i] of layer i, or n of every layer when each is
// nil. Amounts below zero take back what settled lower. The record is told
// with the Limiter's next read of it, which a Limiter that uses the bucket
// makes every Refresh, or by the reporter a Refresh later when none came:
// no more reads than a busy bucket costs.
func (c *Controls) Count(e *Entry, now time.Time, n float64, each []float64) {
	at := now.Unix()
	t := &e.tally
	t.mu.Lock()
	first := len(t.secs) == 0
	if first || t.secs[len(t.secs)-1].at != at {
		if len(t.secs) == maxTally {
			t.secs = append(t.secs[:0], t.secs[1:]...)
		}
		t.secs = append(t.secs, second{at: at, n: make([]float64, e.k)})
	}
	s := t.secs[len(t.secs)-1].n
	for i := range s {
		if each == nil {
			s[i] += n
		} else if i < len(each) {
			s[i] += each[i]
		}
	}
	t.mu.Unlock()
	if first {
		c.untell(e)
	}
}

// Tell has the record of the bucket whose first key is key read within
// Refresh, if the Limiter keeps its entry: what the read tells it (the
// slots held lingering) has changed.
func (c *Controls) Tell(key string) {
	if e := c.Lookup(key); e != nil {
		e.news.Store(true)
		c.untell(e)
	}
}

// untell hands e to the reporter, unless it was evicted meanwhile.
func (c *Controls) untell(e *Entry) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m[e.key] != e {
		return
	}
	if c.untold == nil {
		c.untold = make(map[*Entry]bool)
	}
	c.untold[e] = true
	if !c.reporting {
		c.reporting = true
		go c.reporter()
	}
}

// reporter runs while entries hold grants their records were not told of:
// every Refresh, it reads the records of those not read for as long, and
// so tells them, and forgets those told.
func (c *Controls) reporter() {
	for {
		time.Sleep(Refresh)
		c.mu.Lock()
		var due []*Entry
		for e := range c.untold {
			switch {
			case !e.tally.pending() && !e.news.Load():
				delete(c.untold, e)
			case time.Since(time.Unix(0, e.read.Load())) >= Refresh:
				due = append(due, e)
			}
		}
		if len(c.untold) == 0 {
			c.reporting = false
			c.mu.Unlock()
			return
		}
		c.mu.Unlock()
		if c.shared != nil && !c.shared() {
			continue // told once Redis serves again
		}
		for _, e := range due {
			if c.report(e) != nil {
				break // Redis is unavailable: the next round tries again
			}
		}
	}
}

// take returns the tally in the form the record's read takes it, "<second>
// <layer 1's> ... <layer k's>" joined with ",", or "" for none, and the
// seconds it holds, for give to put back should the read fail.
func (t *tally) take() (string, []second) {
	t.mu.Lock()
	secs := t.secs
	t.secs = nil
	t.mu.Unlock()
	var b strings.Builder
	for i, s := range secs {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(s.at, 10))
		for _, n := range s.n {
			b.WriteByte(' ')
			b.WriteString(strconv.FormatFloat(n, 'g', -1, 64))
		}
	}
	return b.String(), secs
}

// give puts back secs, taken for a read that failed, before what was
// counted since.
func (t *tally) give(secs []second) {
	if len(secs) == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	for _, s := range t.secs {
		if last := &secs[len(secs)-1]; last.at == s.at {
			for i := range last.n {
				last.n[i] += s.n[i]
			}
		} else {
			secs = append(secs, s)
		}
	}
	t.secs = secs[max(0, len(secs)-maxTally):]
}

// pending reports whether t holds grants the record was not told of.
func (t *tally) pending() bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return len(t.secs) > 0
}

// report reads e's record, which tells it e's grants. A failure keeps
// them for the reporter's next round, and is returned but not told: the
// callers' own calls tell of an outage, and a Limiter whose client was
// closed has none.
func (c *Controls) report(e *Entry) error {
	ctx, cancel := context.WithTimeout(redisx.Untraced(), readFor)
	defer cancel()
	_, err := c.ReadNow(ctx, e)
	return err
}

// Report tells the records the grants they were not told of, and returns
// ctx's error, if it ends first. Once a record cannot be told, which keeps
// its grants for the next read as in report, it tells no more.
func (c *Controls) Report(ctx context.Context) error {
	if c.shared != nil && !c.shared() {
		return ctx.Err()
	}
	c.mu.RLock()
	var es []*Entry
	for _, e := range c.m {
		if e.tally.pending() {
			es = append(es, e)
		}
	}
	c.mu.RUnlock()
	for _, e := range es {
		if _, err := c.ReadNow(ctx, e); err != nil {
			break // Redis is unavailable: the reporter tries again
		}
	}
	return ctx.Err()
}
