// Package daily computes the reset instants of a daily quota: a count of
// tokens that refills all at once at a time of day in a time zone, as
// many APIs' requests a day do (at midnight Pacific time, at midnight
// UTC). The scripts know no zones: the callers compute the instants here
// and pass them (see internal/store's daily.lua).
package daily

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/ratelimit"
)

// MaxCount bounds a day's count: a token stands for a whole number of
// microseconds of half a day in the layer's key (see Unit).
const MaxCount = 1e10

// Check tells why a daily quota of n tokens a day, reset at the time of
// day at in loc, is invalid, or "": a rate given with it, a count that is
// not a number from 1 to MaxCount, a time of day outside [0, 24h), or no
// zone.
func Check(rate, n float64, at time.Duration, loc *time.Location) string {
	switch {
	case loc == nil:
		return "a daily Limit's Zone is nil (time.UTC for UTC)"
	case rate != 0:
		return fmt.Sprintf("a daily Limit has a count, not a rate: Rate %v with a Zone, want 0", rate)
	case !(n >= 1 && n <= MaxCount):
		return fmt.Sprintf("a daily Limit's count (its Burst) is %v, want 1 to %g", n, float64(MaxCount))
	case at < 0 || at >= 24*time.Hour:
		return fmt.Sprintf("a daily Limit's Reset is %v, want a time of day in [0, 24h)", at)
	}
	return ""
}

// Resets returns four successive reset instants at the time of day at in
// loc, the first the last at or before an hour before t: the script finds
// its own now (the server's clock) between the first and the third
// however the clocks differ by up to a day. A time of day that a
// daylight-saving change skips or repeats on some day is read as
// time.Date reads it; a day is 23, 24 or 25 hours as the zone says.
func Resets(t time.Time, at time.Duration, loc *time.Location) [4]time.Time {
	from := t.Add(-time.Hour)
	local := from.In(loc)
	y, m, d := local.Date()
	var r [4]time.Time
	day := -1 // the day before from's, whose reset may be the latest at or before it
	next := func() time.Time {
		at := time.Date(y, m, d+day, 0, 0, 0, int(at), loc)
		day++
		return at
	}
	r[0] = next()
	for {
		n := next()
		if n.After(from) {
			r[1] = n
			break
		}
		r[0] = n
	}
	r[2], r[3] = next(), next()
	return r
}

// Unit returns the microseconds a token stands for in a daily layer's key
// of n tokens a day: the largest power of two at most half a day / n, so
// that n tokens fit in a day however short its zone makes it, and a whole
// number of tokens is a whole number of microseconds.
func Unit(n float64) int64 {
	w := int64(1)
	for float64(2*w)*n <= float64(12*time.Hour/time.Microsecond) {
		w *= 2
	}
	return w
}

// Spec returns the rate ARGV of a daily layer (see daily.lua): "d", the
// four reset instants around now in µs (see Resets) and the unit (see
// Unit), separated by commas.
func Spec(now time.Time, n float64, at time.Duration, loc *time.Location) string {
	r := Resets(now, at, loc)
	b := make([]byte, 0, 80)
	b = append(b, 'd')
	for _, t := range r {
		b = strconv.AppendInt(b, t.UnixMicro(), 10)
		b = append(b, ',')
	}
	return string(strconv.AppendInt(b, Unit(n), 10))
}

// Key returns what names a daily quota in its layer's key: "d", the time
// of day and the zone, "d0000@America.Los_Angeles", with none of ':', '/'
// and '}', which the keys keep for themselves.
func Key(at time.Duration, loc *time.Location) string {
	zone := strings.NewReplacer("/", ".", ":", ".", "}", ")", "{", "(", " ", "_").Replace(loc.String())
	return "d" + strings.ReplaceAll(Clock(at), ":", "") + "@" + zone
}

// ParseKey reads what Key wrote: the time of day and the zone. A zone
// whose name Key changed other than its '/' (none of the IANA names) is
// not found, and neither is one this machine's time zone database lacks.
func ParseKey(s string) (time.Duration, *time.Location, error) {
	clock, zone, ok := strings.Cut(s, "@")
	if !ok || len(clock) < 5 || clock[0] != 'd' {
		return 0, nil, fmt.Errorf("daily: %q is no daily key", s)
	}
	h, err1 := strconv.Atoi(clock[1:3])
	m, err2 := strconv.Atoi(clock[3:5])
	at := time.Duration(h)*time.Hour + time.Duration(m)*time.Minute
	if rest := clock[5:]; rest != "" {
		secs, err := time.ParseDuration(rest + "s")
		if err != nil {
			return 0, nil, fmt.Errorf("daily: %q is no daily key", s)
		}
		at += secs
	}
	if err := errors.Join(err1, err2); err != nil || at < 0 || at >= 24*time.Hour {
		return 0, nil, fmt.Errorf("daily: %q is no daily key", s)
	}
	loc, err := time.LoadLocation(strings.ReplaceAll(zone, ".", "/"))
	return at, loc, err
}

// Count reads a daily layer's key, v (see daily.lua: e + u x w, the day
// that ends at the reset e counted u tokens of w µs), at now, for n tokens
// a day reset at at in loc: what today counted, what tomorrow did (takes
// that found today spent), and when today ends.
func Count(v float64, now time.Time, n float64, at time.Duration, loc *time.Location) (today, tomorrow float64, ends time.Time) {
	r := Resets(now, at, loc)
	end, next := r[1], r[2]
	if !now.Before(r[1]) {
		end, next = r[2], r[3]
	}
	w := float64(Unit(n))
	switch e1, e2 := float64(end.UnixMicro()), float64(next.UnixMicro()); {
	case v >= e2:
		return n, (v - e2) / w, end
	case v >= e1:
		return (v - e1) / w, 0, end
	}
	return 0, 0, end // a day that has ended: its key tells nothing
}

// Clock returns the time of day at as "15:04", with seconds and a
// fraction when it has them.
func Clock(at time.Duration) string {
	h, m := at/time.Hour, at%time.Hour/time.Minute
	s := fmt.Sprintf("%02d:%02d", h, m)
	if rest := at % time.Minute; rest != 0 {
		s += fmt.Sprintf(":%02d", rest/time.Second)
		if frac := rest % time.Second; frac != 0 {
			s += strings.TrimRight(fmt.Sprintf(".%09d", frac), "0")
		}
	}
	return s
}

// Rate returns the average rate, tokens a second, of n tokens a day: what
// the callers that compute with a rate (a local share in an outage, a
// take's cost in time) read for a daily quota.
func Rate(n float64) float64 { return n / 86400 }

// String describes a Limit of rate and burst, "5/s burst 15", or a daily
// Limit (loc set) of burst tokens a day reset at at in loc, "1500 a day
// from 00:00 America/Los_Angeles".
func String(rate, burst float64, at time.Duration, loc *time.Location) string {
	if loc == nil {
		return strconv.FormatFloat(rate, 'g', -1, 64) + "/s burst " + strconv.FormatFloat(burst, 'g', -1, 64)
	}
	return strconv.FormatFloat(burst, 'g', -1, 64) + " a day from " + Clock(at) + " " + loc.String()
}

// Zone returns loc, and panics if it is nil, as time.Date does: Daily's
// check.
func Zone(loc *time.Location) *time.Location {
	if loc == nil {
		panic("quota: Daily: nil *time.Location (time.UTC for UTC)")
	}
	return loc
}

// Resolve validates a Limit of rate and burst, daily when loc is set or at
// is not 0, and returns its rate and burst resolved, or why it is invalid:
// a rate Limit's as ratelimit.Check resolves it (maxFill its longest fill
// from empty); a daily Limit's count as its burst, and its average rate.
func Resolve(rate, burst float64, at time.Duration, loc *time.Location, maxFill time.Duration) (float64, float64, string) {
	if loc == nil && at == 0 {
		burst, why := ratelimit.Check(rate, burst, maxFill)
		return rate, burst, why
	}
	if why := Check(rate, burst, at, loc); why != "" {
		return 0, 0, why
	}
	return Rate(burst), burst, ""
}
