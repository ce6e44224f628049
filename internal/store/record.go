package store

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/redisx"
)

// A RecordOp is an operation of the control record's script (record.lua).
type RecordOp struct {
	Op     string        // "read", "limit", "clear", "hold" or "resume"
	ID     string        // read: the Limiter's, among the bucket's users
	Limit  Limit         // read: the first layer's Limit the Limiter's callers pass; limit: the override
	Layers string        // read: the further layers' key suffixes, separated by spaces
	Hold   time.Duration // hold: how long, a microsecond or more; Forever for until a resume
	Grants string        // read: the Limiter's callers' grants by second (see record.lua's tally)
	Meter  string        // read: what the first layer meters, when each layer meters its own
	Linger int           // read: the slots the Limiter holds lingering
}

// Forever is a hold's duration until a resume.
const Forever time.Duration = math.MaxInt64

// The record's ARGV (record.lua), by name.
const (
	recordOp      = iota // the operation
	recordNow            // now in µs, or "" for the server's clock
	recordUses           // "plain"
	recordChannel        // limit, clear, hold, resume: announces the change
	recordID             // read: the Limiter's id
	recordRate           // read: the Limit passed; limit: the override
	recordBurst          //
	recordLayers         // read: the further layers' suffixes
	recordHold           // hold: how long, µs, or "forever"
	recordGrants         // read: the grants by second
	recordMeter          // read: the first layer's meter, or ""
	recordLinger         // read: the slots held lingering
	recordArgs
)

// Record runs op on the control record of the bucket whose layers' keys
// are keys, the first the bucket's own: read, hold and resume move every
// layer named; the others need the first alone.
func (s *Store) Record(ctx context.Context, keys []string, op RecordOp) (Record, error) {
	args := make([]any, recordArgs, recordArgs+2*len(keys))
	args[recordOp], args[recordNow], args[recordUses], args[recordChannel], args[recordID] = op.Op, s.Now(), usesPlain, s.channel, op.ID
	args[recordRate], args[recordBurst], args[recordLayers], args[recordHold], args[recordGrants], args[recordMeter] = "", "", op.Layers, "", op.Grants, op.Meter
	args[recordLinger] = op.Linger
	if op.Limit != (Limit{}) { // a daily Limit's rate is its key's name (daily.Key), which no rate is
		args[recordRate], args[recordBurst] = op.Limit.name(), redisx.Num(op.Limit.Burst)
	}
	switch {
	case op.Op != "hold":
	case op.Hold == Forever:
		args[recordHold] = "forever"
	default:
		args[recordHold] = op.Hold.Microseconds()
	}
	for range keys {
		args = append(args, "", "") // the Limits, which the record and the keys tell
	}
	call := make([]string, 0, len(keys)+1)
	call = append(append(call, keys...), keys[0]+ControlSuffix)
	cmd, _ := s.recordScript.Run(ctx, call, args...)
	return ParseRecord(cmd)
}

// A Record is a control record as the record's script replies it.
type Record struct {
	Now          int64 // µs, the server's clock
	Override     *Limit
	Since, Until int64 // µs; Until is -1 for a pause with no end
	Seen         *Limit
	Source       string // who set the pause's end
	// Ev counts the moves of the bucket's timeline; Anchors are its
	// layers' (see Anchor), the first layer's first.
	Ev      int64
	Anchors []Anchor
	// Pushes is how far takes of higher priority classes have pushed each
	// class's queue in each layer, in positions, class 0's layers first;
	// PushAt, when the latest push was. Nil and 0 on a bucket no class
	// above 0 took from.
	Pushes []int64
	PushAt int64
	// Learned is the rate the fleet learned for each layer (see
	// learn.lua), 0 for a layer that learns none; nil when none does.
	Learned []float64
}

// ParseRecord reads the reply of a record op. A Limit in it must have a
// finite rate and burst above zero: Limiters write only Limits they
// validated.
func ParseRecord(cmd *redis.Cmd) (Record, error) {
	vals, err := cmd.StringSlice()
	if err != nil {
		return Record{}, err
	}
	if len(vals) != 11 {
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
	if rate, burst, ok := strings.Cut(vals[5], " "); ok && !strings.HasPrefix(rate, "d") { // a daily Limit's is no rate
		r.Seen = limit(rate, burst)
	}
	r.Source = vals[6]
	r.Ev = integer(vals[7])
	if vals[8] != "" {
		anchors, err := ParseAnchors(vals[8])
		r.Anchors = anchors
		errs = append(errs, err)
	}
	if at, pushes, ok := strings.Cut(vals[9], " "); ok {
		r.PushAt = integer(at)
		for p := range strings.FieldsSeq(pushes) {
			r.Pushes = append(r.Pushes, integer(p))
		}
	}
	if strings.TrimSpace(vals[10]) != "" {
		for v := range strings.SplitSeq(vals[10], " ") {
			l, err := 0.0, error(nil)
			if v != "" {
				l, err = strconv.ParseFloat(v, 64)
			}
			r.Learned = append(r.Learned, l)
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return Record{}, fmt.Errorf("%w: an unreadable control record: %w", redisx.ErrReply, err)
	}
	return r, nil
}

// An Anchor is a layer's timeline, as the scripts keep it (see
// timeline.lua): the grant at position Pos of the layer's queue falls due
// at At (µs, the server's clock), and one at a later position p at At +
// (p - Pos) x Scale; none falls due before At. Every pause, change of the
// Limit in force and give-back moves the anchor, never a position, so
// that a grant taken at any earlier instant finds when it falls due from
// the anchor read last. The zero Anchor is the scripts' absent one: Scale
// 0 counts as 1.
type Anchor struct {
	At    int64
	Pos   float64
	Scale float64
}

// Due returns when the grant at position pos falls due, µs on the
// server's clock, rounded up.
func (a Anchor) Due(pos float64) int64 {
	scale := a.Scale
	if scale == 0 {
		scale = 1
	}
	return a.At + int64(math.Ceil(max(pos-a.Pos, 0)*scale))
}

// Position returns the position of a grant due at t, µs on the server's
// clock, as the take's script computes it (rounded down).
func (a Anchor) Position(t int64) float64 {
	scale := a.Scale
	if scale == 0 {
		scale = 1
	}
	return math.Floor(a.Pos + float64(max(t-a.At, 0))/scale)
}

// ParseAnchors reads the layers' anchors as the scripts reply and announce
// them: "<at> <pos> <scale>" each, joined with ",".
func ParseAnchors(s string) ([]Anchor, error) {
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
