package control

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redisx"
)

// A Record is a control record as the script replies it.
type Record struct {
	Now          int64 // µs, the server's clock
	Override     *Limit
	Since, Until int64 // µs; Until is -1 for a pause with no end
	Seen         *Limit
	Users        int    // status only
	Tat          int64  // status only; 0 when absent
	Source       string // who set the pause's end
	// Ev counts the moves of the bucket's timeline; Anchors are its
	// layers' (see Anchor), the first layer's first.
	Ev      int64
	Anchors []Anchor
	// Pushes is how far takes of higher priority classes have pushed each
	// class's queue in each layer, in positions, class 0's layers first;
	// PushAt, when
	// the latest push was. Nil and 0 on a bucket no class above 0 took
	// from.
	Pushes []int64
	PushAt int64
}

// Parse reads the reply of a record op. A Limit in it must have a finite
// rate and burst above zero: Limiters write only Limits they validated.
func Parse(cmd *redis.Cmd) (Record, error) {
	vals, err := cmd.StringSlice()
	if err != nil {
		return Record{}, err
	}
	if len(vals) != 12 {
		return Record{}, fmt.Errorf("%w: a control reply of %d fields", redisx.ErrReply, len(vals))
	}
	var r Record
	var errs []error
	integer := func(s string) int64 {
		if s == "" {
			return 0
		}
		v, err := strconv.ParseInt(s, 10, 64)
		errs = append(errs, err)
		return v
	}
	limit := func(rate, burst string) *Limit {
		if rate == "" || burst == "" {
			return nil
		}
		r, err1 := strconv.ParseFloat(rate, 64)
		b, err2 := strconv.ParseFloat(burst, 64)
		errs = append(errs, err1, err2)
		if !(r > 0 && b > 0) || math.IsInf(r, 0) || math.IsInf(b, 0) {
			errs = append(errs, fmt.Errorf("a Limit of %s/s burst %s", rate, burst))
		}
		return &Limit{Rate: r, Burst: b}
	}
	r.Now = integer(vals[0])
	r.Override = limit(vals[1], vals[2])
	r.Since = integer(vals[3])
	if vals[4] == "forever" {
		r.Until = -1
	} else {
		r.Until = integer(vals[4])
	}
	if rate, burst, ok := strings.Cut(vals[5], " "); ok {
		r.Seen = limit(rate, burst)
	}
	r.Users = int(integer(vals[6]))
	if vals[7] != "" {
		tat, err := strconv.ParseFloat(vals[7], 64)
		r.Tat = int64(tat)
		errs = append(errs, err)
	}
	r.Source = vals[8]
	r.Ev = integer(vals[9])
	if vals[10] != "" {
		anchors, err := parseAnchors(vals[10])
		r.Anchors = anchors
		errs = append(errs, err)
	}
	if at, pushes, ok := strings.Cut(vals[11], " "); ok {
		r.PushAt = integer(at)
		for p := range strings.FieldsSeq(pushes) {
			r.Pushes = append(r.Pushes, integer(p))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return Record{}, fmt.Errorf("%w: an unreadable control record: %w", redisx.ErrReply, err)
	}
	return r, nil
}

// parseAnchors reads the layers' anchors as the script replies them:
// "<at> <pos> <scale>" each, joined with ",".
func parseAnchors(s string) ([]Anchor, error) {
	var anchors []Anchor
	for part := range strings.SplitSeq(s, ",") {
		f := strings.Fields(part)
		if len(f) != 3 {
			return nil, fmt.Errorf("an anchor %q", part)
		}
		at, err1 := strconv.ParseFloat(f[0], 64)
		pos, err2 := strconv.ParseFloat(f[1], 64)
		scale, err3 := strconv.ParseFloat(f[2], 64)
		if err := errors.Join(err1, err2, err3); err != nil {
			return nil, err
		}
		if !(scale > 0) || math.IsInf(scale, 0) || math.IsNaN(at) || math.IsInf(at, 0) || math.IsNaN(pos) || math.IsInf(pos, 0) {
			return nil, fmt.Errorf("an anchor %q", part)
		}
		anchors = append(anchors, Anchor{At: int64(at), Pos: pos, Scale: scale})
	}
	return anchors, nil
}

// state turns the record into a Limiter's state, its times moved to the
// local clock as of sent, when the read was sent.
func (r Record) state(sent time.Time) *State {
	st := &State{replaced: make(chan struct{}), readAt: sent, serverAt: r.Now, source: r.Source,
		ev: r.Ev, anchors: r.Anchors, pushes: r.Pushes}
	if r.Override != nil {
		st.override, st.hasOverride = *r.Override, true
	}
	local := st.Local
	if r.PushAt != 0 {
		st.pushAt = local(r.PushAt)
	}
	if r.Since != 0 {
		st.since, st.sinceUS = local(r.Since), r.Since
		if r.Until >= 0 {
			st.until = local(r.Until)
		}
	}
	return st
}
