package local

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/store"
)

// A day is this process's local share of a daily layer (a Limit with a
// Zone): its count divided by the workers, at least 1, a day. The count
// runs over every outage of the day, not each afresh, so that the fleet's
// outages of one day grant at most the day's count beside what the
// shared day counted; a take that today's share has no room for counts
// against the next day's, and waits for it. At a resume, the tokens the
// share granted and has not yet handed over are taken from the shared
// day (see SettleDays), so that it counts them too.
type day struct {
	name, first string // the bucket's name and key
	lim         Limit
	share       float64   // tokens a day
	ends        time.Time // when today ends
	today, next float64   // granted today, and counted against the next day
	handed      float64   // of today's, taken from the shared day
}

// maxDays bounds the daily layers whose counts a process keeps.
const maxDays = maxLocalBuckets

// dayOf returns the share of the daily layer under key at now, made or
// moved on to the day now falls in. ls.mu is held.
func (ls *Shares) dayOf(name, first, key string, lim Limit, workers int, now time.Time) (*day, error) {
	d, ok := ls.days[key]
	if !ok || d.lim != lim {
		if ls.days == nil {
			ls.days = map[string]*day{}
		}
		if len(ls.days) >= maxDays {
			for k, d := range ls.days {
				if !now.Before(d.ends.Add(24 * time.Hour)) {
					delete(ls.days, k) // its day and the next are over
				}
			}
			if len(ls.days) >= maxDays {
				return nil, fmt.Errorf("%w: %d daily layers already counted in this process", ErrFull, len(ls.days))
			}
		}
		d = &day{name: name, first: first, lim: lim}
		ls.days[key] = d
	}
	d.share = math.Max(1, math.Floor(lim.Burst/float64(workers)))
	for !now.Before(d.ends) {
		if d.ends.IsZero() || !now.Before(d.ends.Add(24*time.Hour)) {
			d.today, d.next = 0, 0 // a day or more past: nothing counted
		} else {
			d.today, d.next = d.next, 0
		}
		d.handed = 0
		for _, r := range daily.Resets(now, lim.Reset, lim.Zone) {
			if r.After(now) {
				d.ends = r
				break
			}
		}
	}
	return d, nil
}

// reserveDay counts tokens against this process's share of the daily
// layer under key: today's when it has room, else the next day's, with a
// delay until it begins. It fails when tokens exceed the share.
func (ls *Shares) reserveDay(name, first, key string, lim Limit, tokens float64, workers int, now time.Time) (dayTake, time.Duration, error) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	d, err := ls.dayOf(name, first, key, lim, workers, now)
	if err != nil {
		return dayTake{}, 0, err
	}
	switch {
	case tokens > d.share:
		return dayTake{}, 0, fmt.Errorf("%v tokens exceed this worker's local share of the day, %v", tokens, d.share)
	case d.next == 0 && d.today+tokens <= d.share:
		d.today += tokens
		return dayTake{d: d, n: tokens, ends: d.ends}, 0, nil
	case d.next+tokens <= d.share:
		d.next += tokens
		return dayTake{d: d, n: tokens, ends: d.ends, next: true}, d.ends.Sub(now), nil
	}
	// Both days spent: a wait no caller waits, asked again later.
	return dayTake{}, d.ends.Sub(now) + 24*time.Hour, nil
}

// A dayTake is what one reservation counted against a day's share.
type dayTake struct {
	d    *day
	n    float64
	ends time.Time // the day it was counted in ended then
	next bool      // counted against the day after
}

// undo takes t's tokens off the count they are in, unless its day has
// gone by: the request they were for was not sent.
func (ls *Shares) undo(t dayTake) {
	if t.d == nil {
		return
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	switch d := t.d; {
	case t.next && d.ends.Equal(t.ends):
		d.next = math.Max(d.next-t.n, 0)
	case t.next && d.ends.After(t.ends) && !d.ends.After(t.ends.Add(25*time.Hour)): // the next day is today now
		d.today = math.Max(d.today-t.n, 0)
	case !t.next && d.ends.Equal(t.ends):
		d.today = math.Max(d.today-t.n, 0)
	}
}

// SettleDays takes from each shared daily layer what this process's share
// granted of today and has not handed over yet; what a failed call did
// not hand over, the next resume does. Each layer takes one call; failed
// is told of each that fails, as Settle's is.
func (ls *Shares) SettleDays(s *store.Store, failed func(error) (stop bool)) error {
	type hand struct {
		key  string
		d    *day
		b    store.Bucket
		ends time.Time
		n    float64
	}
	var hands []hand
	now := time.Now()
	ls.mu.Lock()
	for key, d := range ls.days {
		if now.Before(d.ends) && d.today > d.handed {
			b := store.Bucket{Name: d.name, Keys: []string{key}, Lims: []store.Limit{d.lim}, Call: []string{key, d.first + store.ControlSuffix}}
			hands = append(hands, hand{key, d, b, d.ends, d.today - d.handed})
		}
	}
	ls.mu.Unlock()
	for _, h := range hands {
		ctx, cancel := context.WithTimeout(context.Background(), callTimeout)
		err := s.Adjust(ctx, h.b, store.Tokens(h.n), "")
		cancel()
		if err == nil {
			ls.mu.Lock()
			if h.d.ends.Equal(h.ends) { // still its day
				h.d.handed += h.n
			}
			ls.mu.Unlock()
		} else if failed(err) {
			return err
		}
	}
	return nil
}
