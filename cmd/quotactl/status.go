package main

import (
	"cmp"
	"fmt"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/status"
)

// statusJSON is a bucket's status in JSON, the schema docs/operating.md
// documents: the first layer's fields as they always were, then the whole
// bucket.
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

	Now          string       `json:"now"`
	ResumesAt    *string      `json:"resumes_at"`
	Layers       []layerJSON  `json:"layers"`
	GrantedUntil string       `json:"granted_until"`
	Classes      []classJSON  `json:"classes"`
	Tenants      []tenantJSON `json:"tenants"`
	Slots        slotsJSON    `json:"slots"`
	Limiters     []string     `json:"limiters"`
}

type layerJSON struct {
	Meter        string       `json:"meter"`
	Rate         float64      `json:"rate"`
	Burst        float64      `json:"burst"`
	Override     bool         `json:"override"`
	Tokens       float64      `json:"tokens"`
	QueueSeconds float64      `json:"queue_seconds"`
	PerSecond    float64      `json:"granted_per_second"`
	Granted      []float64    `json:"granted"`
	Learned      *learnedJSON `json:"learned"`
	Daily        *dailyJSON   `json:"daily"`
}

// dailyJSON is a daily layer's status.Daily.
type dailyJSON struct {
	Reset    string  `json:"reset"`
	Zone     string  `json:"zone"`
	Used     float64 `json:"used"`
	Tomorrow float64 `json:"tomorrow"`
	Ends     *string `json:"ends"`
}

// learnedJSON is a layer's status.Learned.
type learnedJSON struct {
	Floor   float64 `json:"floor"`
	Ceiling float64 `json:"ceiling"`
	CutAt   string  `json:"cut_at"`
	CutFrom float64 `json:"cut_from"`
	Why     string  `json:"why"`
}

type slotsJSON struct {
	Held      int `json:"held"`
	Lingering int `json:"lingering"`
	Waiting   int `json:"waiting"`
}

type classJSON struct {
	Priority      int     `json:"priority"`
	QueueSeconds  float64 `json:"queue_seconds"`
	PushedSeconds float64 `json:"pushed_seconds"`
}

type tenantJSON struct {
	Name    string  `json:"name"`
	Weight  float64 `json:"weight"`
	Waiting bool    `json:"waiting"`
	Granted float64 `json:"granted"`
	Share   float64 `json:"share"`
}

// rateWindow is the seconds over which status and top tell a layer's
// rate.
const rateWindow = 5

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
		Now:           fmtTime(st.Now),
		Layers:        []layerJSON{},
		Classes:       []classJSON{},
		Tenants:       []tenantJSON{},
		Slots:         slotsJSON{Held: st.Slots.Held, Lingering: st.Slots.Lingering, Waiting: st.Slots.Waiting},
		Limiters:      append([]string{}, st.Limiters...),
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
	if !st.ResumesAt.IsZero() {
		at := fmtTime(st.ResumesAt)
		j.ResumesAt = &at
	}
	for _, l := range st.Layers {
		g := make([]float64, len(l.Granted))
		for i, v := range l.Granted {
			g[i] = round(v, 3)
		}
		j.Layers = append(j.Layers, layerJSON{Meter: l.Meter, Rate: l.Rate, Burst: l.Burst, Override: l.Override,
			Tokens: round(l.Tokens, 3), QueueSeconds: round(l.Queue.Seconds(), 6), PerSecond: round(l.PerSecond(rateWindow), 3), Granted: g})
		if ln := l.Learned; ln != nil {
			lj := &learnedJSON{Floor: round(ln.Floor, 3), Ceiling: round(ln.Ceiling, 3), CutFrom: round(ln.CutFrom, 3), Why: ln.Why}
			if !ln.CutAt.IsZero() {
				lj.CutAt = fmtTime(ln.CutAt)
			}
			j.Layers[len(j.Layers)-1].Learned = lj
		}
		if d := l.Daily; d != nil {
			dj := &dailyJSON{Reset: daily.Clock(d.Reset), Zone: d.Zone, Used: round(d.Used, 3), Tomorrow: round(d.Tomorrow, 3)}
			if !d.Ends.IsZero() {
				ends := fmtTime(d.Ends)
				dj.Ends = &ends
			}
			j.Layers[len(j.Layers)-1].Daily = dj
		}
		j.GrantedUntil = fmtTime(l.GrantedUntil)
	}
	for _, c := range st.Classes {
		j.Classes = append(j.Classes, classJSON{Priority: c.Priority, QueueSeconds: round(c.Queue.Seconds(), 6), PushedSeconds: round(c.Pushed.Seconds(), 6)})
	}
	for _, t := range st.Tenants {
		j.Tenants = append(j.Tenants, tenantJSON{Name: t.Name, Weight: t.Weight, Waiting: t.Waiting, Granted: round(t.Granted, 3), Share: round(t.Share, 4)})
	}
	return j
}

func statusText(st quota.Status, now time.Time) string {
	var b strings.Builder
	fmt.Fprintf(&b, "bucket   %s\n", quoteName(st.Name))
	switch {
	case st.Override != nil:
		fmt.Fprintf(&b, "limit    %s, burst %s (override)\n", fmtRate(st.Override.Rate), fmtNum(st.Override.Burst))
	case len(st.Layers) > 0 && st.Layers[0].Learned != nil:
		fmt.Fprintf(&b, "limit    %s, burst %s (learned; see below)\n", fmtRate(round(st.Limit.Rate, 2)), fmtNum(round(st.Limit.Burst, 2)))
	case st.Limit.Rate > 0:
		fmt.Fprintf(&b, "limit    %s, burst %s (the callers'; no override)\n", fmtRate(st.Limit.Rate), fmtNum(st.Limit.Burst))
	default:
		fmt.Fprintf(&b, "limit    unknown: no override, and no Limiter used the bucket lately\n")
	}
	if st.Limit.Rate > 0 {
		fmt.Fprintf(&b, "tokens   %s of %s\n", fmtNum(round(st.Tokens, 2)), fmtNum(st.Limit.Burst))
		fmt.Fprintf(&b, "queue    %v\n", st.Queue.Round(time.Millisecond))
		first := st.Layers[0]
		fmt.Fprintf(&b, "granted  %s a second over the last %d s, %s over the minute  %s\n",
			fmtNum(round(first.PerSecond(rateWindow), 2)), rateWindow, fmtNum(round(first.PerSecond(status.History), 2)), sparkline(first.Granted, first.Rate, sparkWidth))
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
	if !st.ResumesAt.IsZero() {
		fmt.Fprintf(&b, "resumes  %s (%v from now), after an outage: the fleet grants from its local shares until then\n",
			fmtTime(st.ResumesAt), st.ResumesAt.Sub(st.Now).Round(time.Millisecond))
	}
	fmt.Fprintf(&b, "workers  %d on this bucket", st.Workers)
	if st.FleetWorkers > 0 {
		fmt.Fprintf(&b, ", %d in the fleet", st.FleetWorkers)
	}
	b.WriteString("\n")
	for _, l := range st.Layers {
		if ln := l.Learned; ln != nil {
			fmt.Fprintf(&b, "learned  %s %s (ceiling %s, floor %s)", cmp.Or(l.Meter, "rate"), fmtRate(round(l.Rate, 2)),
				fmtRate(round(ln.Ceiling, 2)), fmtRate(round(ln.Floor, 2)))
			if ln.Why != "" {
				fmt.Fprintf(&b, ", cut from %s at %s by a %s", fmtRate(round(ln.CutFrom, 2)), ln.CutAt.Format(time.TimeOnly), ln.Why)
			}
			b.WriteString("\n")
		}
	}
	if st.Slots != (status.Slots{}) {
		fmt.Fprintf(&b, "slots    %d held (%d lingering), %d waiting\n", st.Slots.Held, st.Slots.Lingering, st.Slots.Waiting)
	}
	if len(st.Layers) > 1 {
		b.WriteString("\nlayers\n")
		w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		fmt.Fprintf(w, "  METER\tLIMIT\tTOKENS\tQUEUE\tGRANTED/S (%d s)\t\n", rateWindow)
		for _, l := range st.Layers {
			lim := fmtRate(l.Rate) + ", burst " + fmtNum(l.Burst)
			if l.Override {
				lim += " (override)"
			}
			if d := l.Daily; d != nil {
				lim = fmtNum(l.Burst) + " a day from " + daily.Clock(d.Reset) + " " + d.Zone
				if !d.Ends.IsZero() {
					lim += fmt.Sprintf(", %s used, refills in %v", fmtNum(round(d.Used, 2)), d.Ends.Sub(st.Now).Round(time.Second))
				}
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\t%v\t%s\t\n", cmp.Or(l.Meter, "-"), lim, fmtNum(round(l.Tokens, 2)),
				l.Queue.Round(time.Millisecond), fmtNum(round(l.PerSecond(rateWindow), 2)))
		}
		w.Flush()
	}
	if len(st.Classes) > 0 {
		b.WriteString("\npriority classes\n")
		w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		fmt.Fprintf(w, "  CLASS\tQUEUE\tPUSHED BACK\t\n")
		for _, c := range st.Classes {
			fmt.Fprintf(w, "  %d\t%v\t%v\t\n", c.Priority, c.Queue.Round(time.Millisecond), c.Pushed.Round(time.Millisecond))
		}
		w.Flush()
	}
	if len(st.Tenants) > 0 {
		b.WriteString("\ntenants\n")
		w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
		fmt.Fprintf(w, "  TENANT\tWEIGHT\tWAITING\tGRANTED\tSHARE\t\n")
		for _, t := range st.Tenants {
			waiting := "no"
			if t.Waiting {
				waiting = "yes"
			}
			name := quoteName(t.Name)
			if t.Name == "" {
				name = "(others)"
			}
			fmt.Fprintf(w, "  %s\t%s\t%s\t%s\t%.0f%%\t\n", name, fmtNum(t.Weight), waiting, fmtNum(round(t.Granted, 2)), 100*t.Share)
		}
		w.Flush()
	}
	if len(st.Limiters) > 0 {
		fmt.Fprintf(&b, "\nlimiters %s\n", strings.Join(st.Limiters, " "))
	}
	return b.String()
}
