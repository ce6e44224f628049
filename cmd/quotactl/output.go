package main

import (
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota"
)

// output is what a command prints: text, or with -json one object.
type output struct {
	text    string
	json    any
	unknown bool // Redis held nothing of the bucket
	none    bool // list found no bucket
}

// jsonLimit is a Limit in JSON.
type jsonLimit struct {
	Rate  float64 `json:"rate"`
	Burst float64 `json:"burst"`
}

func limitJSON(l *quota.Limit) *jsonLimit {
	if l == nil || l.Rate == 0 {
		return nil
	}
	return &jsonLimit{Rate: l.Rate, Burst: l.Burst}
}

// statusJSON is a bucket's status in JSON.
type statusJSON struct {
	Name             string     `json:"name"`
	Limit            *jsonLimit `json:"limit"`
	Override         *jsonLimit `json:"override"`
	Tokens           float64    `json:"tokens"`
	QueueSeconds     float64    `json:"queue_seconds"`
	Paused           bool       `json:"paused"`
	PausedForever    bool       `json:"paused_forever"`
	PausedBy         string     `json:"paused_by,omitempty"`
	PausedSince      *string    `json:"paused_since"`
	PausedUntil      *string    `json:"paused_until"`
	PauseLeftSeconds *float64   `json:"pause_left_seconds"`
	Workers          int        `json:"workers"`
	FleetWorkers     int        `json:"fleet_workers"`
}

// actionJSON is what limit, pause and resume did, in JSON.
type actionJSON struct {
	Name     string     `json:"name"`
	Action   string     `json:"action"` // limit, limit_off, pause, resume
	Override *jsonLimit `json:"override,omitempty"`
	Seconds  *float64   `json:"pause_seconds,omitempty"`
	Forever  bool       `json:"forever,omitempty"`
}

func statusObject(st quota.Status, now time.Time) statusJSON {
	j := statusJSON{
		Name:          st.Name,
		Limit:         limitJSON(&st.Limit),
		Override:      limitJSON(st.Override),
		Tokens:        round(st.Tokens, 3),
		QueueSeconds:  round(st.Queue.Seconds(), 6),
		Paused:        st.Paused,
		PausedForever: st.Paused && st.PausedUntil.IsZero(),
		PausedBy:      st.PausedBy,
		Workers:       st.Workers,
		FleetWorkers:  st.FleetWorkers,
	}
	if st.Paused {
		since := fmtTime(st.PausedSince)
		j.PausedSince = &since
		if !j.PausedForever {
			until := fmtTime(st.PausedUntil)
			left := round(max(0, st.PausedUntil.Sub(now).Seconds()), 3)
			j.PausedUntil, j.PauseLeftSeconds = &until, &left
		}
	} else {
		zero := 0.0
		j.PauseLeftSeconds = &zero
	}
	return j
}

func statusText(st quota.Status, now time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "bucket   %s\n", st.Name)
	switch {
	case st.Override != nil:
		fmt.Fprintf(&b, "limit    %s, burst %s (override)\n", fmtRate(st.Override.Rate), fmtNum(st.Override.Burst))
	case st.Limit.Rate > 0:
		fmt.Fprintf(&b, "limit    %s, burst %s (the callers'; no override)\n", fmtRate(st.Limit.Rate), fmtNum(st.Limit.Burst))
	default:
		fmt.Fprintf(&b, "limit    unknown: no override, and no Limiter used the bucket lately\n")
	}
	if st.Limit.Rate > 0 {
		fmt.Fprintf(&b, "tokens   %s of %s\n", fmtNum(round(st.Tokens, 2)), fmtNum(st.Limit.Burst))
		fmt.Fprintf(&b, "queue    %v\n", st.Queue.Round(time.Millisecond))
	}
	switch {
	case !st.Paused:
		fmt.Fprintf(&b, "paused   no\n")
	case st.PausedUntil.IsZero():
		fmt.Fprintf(&b, "paused   until resumed, since %s, by the %s\n", fmtTime(st.PausedSince), st.PausedBy)
	default:
		fmt.Fprintf(&b, "paused   until %s (%v left), since %s, by the %s\n", fmtTime(st.PausedUntil),
			max(0, st.PausedUntil.Sub(now)).Round(time.Millisecond), fmtTime(st.PausedSince), st.PausedBy)
	}
	fmt.Fprintf(&b, "workers  %d on this bucket", st.Workers)
	if st.FleetWorkers > 0 {
		fmt.Fprintf(&b, ", %d in the fleet", st.FleetWorkers)
	}
	b.WriteString("\n")
	return b.String()
}

// shellLine writes a command line a POSIX shell reads back as args, each
// quoted that needs it.
func shellLine(args ...string) string {
	quoted := make([]string, len(args))
	for i, a := range args {
		quoted[i] = a
		if a == "" || strings.ContainsFunc(a, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./:@%+=,", r))
		}) {
			quoted[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
	}
	return strings.Join(quoted, " ")
}

func fmtTime(t time.Time) string { return t.UTC().Format("2006-01-02T15:04:05.000Z07:00") }

func fmtNum(f float64) string { return strconv.FormatFloat(f, 'g', 6, 64) }

// fmtRate writes a rate per second in the first of s, m, h and d in which
// it is a whole number, else per second.
func fmtRate(r float64) string {
	for _, u := range []struct {
		name string
		secs float64
	}{{"s", 1}, {"m", 60}, {"h", 3600}, {"d", 86400}} {
		n := r * u.secs
		if n >= 1 && math.Abs(n-math.Round(n)) < 1e-9*n {
			return strconv.FormatFloat(math.Round(n), 'f', -1, 64) + "/" + u.name
		}
	}
	return fmtNum(r) + "/s"
}

func round(f float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(f*p) / p
}

// oneLine keeps the first line of err's message.
func oneLine(err error) string {
	s, _, _ := strings.Cut(err.Error(), "\n")
	return strings.TrimPrefix(s, "quota: ")
}
