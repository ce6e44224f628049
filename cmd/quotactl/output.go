package main

import (
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
	unknown bool   // Redis held nothing of the bucket
	none    bool   // list found no bucket
	note    string // for stderr: something the command did that may surprise
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

// actionJSON is what limit, pause and resume did, in JSON.
type actionJSON struct {
	Name     string     `json:"name"`
	Action   string     `json:"action"` // limit, limit_off, pause, resume
	Override *jsonLimit `json:"override,omitempty"`
	Seconds  *float64   `json:"pause_seconds,omitempty"`
	Forever  bool       `json:"forever,omitempty"`
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
