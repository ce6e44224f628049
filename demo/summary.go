package main

import (
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/sharedquota/quota/demo/internal/provider"
)

// stampSlack widens the window the bound allows for, as the quota package's
// own tests do: a request is stamped at the provider when it arrives, a few
// milliseconds after its grant, so a window of arrivals can hold the grants
// of a slightly longer window.
const stampSlack = 25 * time.Millisecond

// A summary is the outcome of a run.
type summary struct {
	PerMinute    float64        `json:"rate_per_minute"`
	Burst        int            `json:"burst"`
	Workers      int            `json:"workers"`
	Goroutines   int            `json:"goroutines"`
	PhaseSeconds float64        `json:"phase_seconds"`
	LatencyMS    float64        `json:"latency_ms"`
	Phases       []phaseSummary `json:"phases"`
	PNG          string         `json:"png"`
	SVG          string         `json:"svg"`
	CSV          string         `json:"csv"`      // every request the provider received
	OK           bool           `json:"ok"`       // the shared phases stayed within their bounds
	Failures     []string       `json:"failures"` // why not
}

// A phaseSummary is one phase as the provider and the workers saw it.
type phaseSummary struct {
	Phase     int     `json:"phase"`
	Name      string  `json:"name"`
	Requests  int     `json:"requests"`   // received by the provider
	PerMinute float64 `json:"per_minute"` // received after the phase's first second
	XLimit    float64 `json:"x_limit"`    // PerMinute over the limit
	Max1s     int     `json:"max_1s"`     // most requests received in any 1-second window
	Bound1s   int     `json:"bound_1s"`   // the most the limit allows in 1 s (+ the local shares' bursts in phase 3)
	Checked   bool    `json:"checked"`    // whether Max1s must stay within Bound1s
	Refused   int     `json:"refused_429"`
	WaitP50MS float64 `json:"wait_p50_ms"` // how long requests waited for their limiter
	WaitP99MS float64 `json:"wait_p99_ms"`
	Failed    int     `json:"failed"` // requests the workers' limiters refused or lost

	RedisKilled   bool     `json:"redis_killed"`
	KilledAtS     float64  `json:"killed_at_s,omitempty"`
	RestartedAtS  float64  `json:"restarted_at_s,omitempty"`
	OutageLogs    int      `json:"outage_logs"`   // WARN "quota: Redis unavailable…" records from the workers
	RecoveryLogs  int      `json:"recovery_logs"` // INFO "quota: Redis available again…" records
	LocalServed   int      `json:"local_served"`  // requests the local shares granted during the outage, as the recovery records count them
	WorkersShared int      `json:"workers_shared_at_end"`
	AfterRestart  *busiest `json:"after_restart,omitempty"` // the busiest second from Redis's restart on, within burst + rate: the local shares start empty

	Pause *pauseSummary `json:"pause,omitempty"` // in the phase in which the provider asks for a pause
}

// pauseReach is how long after the 429 the pause may take to reach every
// worker and every grant already queued: the worker that receives the 429
// records the pause in Redis, which announces it to the others. Requests
// granted before the 429 and due within it go out.
const pauseReach = 50 * time.Millisecond

// A pauseSummary is what the provider received around the 429 with which
// it asked for a pause. The pause runs from the instant the 429 was sent
// for RetryAfterS.
type pauseSummary struct {
	RetryAfterS float64 `json:"retry_after_s"` // the pause asked for
	Sent        bool    `json:"sent"`          // whether the 429 went out
	SentAtS     float64 `json:"sent_at_s"`     // when, since the phase started
	Reaching    int     `json:"reaching"`      // requests that arrived in the first 50 ms after the 429, while the pause reached the fleet
	During      int     `json:"during"`        // requests that arrived from 50 ms after the 429 until the pause ended: none if the pause reached every grant
	LastMS      float64 `json:"last_ms"`       // how long after the 429 the last of those arrived; 0 if none did
	After       int     `json:"after"`         // requests that arrived after the pause, until the phase ended
	ResumedMS   float64 `json:"resumed_ms"`    // how long after the pause ended the first of those arrived; 0 if none did
	Busiest     busiest `json:"busiest_after"` // the busiest second after the pause
}

// A busiest is the busiest second of a phase from an instant on (the
// restart of Redis, the end of a pause) to the phase's end.
type busiest struct {
	Max1s   int     `json:"max_1s"`   // the most requests in any 1-second window from the instant on
	AtS     float64 `json:"at_s"`     // when the first such window begins, since the phase started
	Bound1s int     `json:"bound_1s"` // the most the limit allows in 1 s: burst + rate
}

// busiestFrom returns the busiest second of r's arrivals from its instant
// from on, against bound.
func busiestFrom(r phaseResult, from time.Duration, bound int) busiest {
	at := r.start.Add(from)
	i, _ := slices.BinarySearchFunc(r.arrivals, at, func(a provider.Arrival, t time.Time) int { return a.At.Compare(t) })
	n, first := maxInWindow(r.arrivals[i:], time.Second)
	b := busiest{Max1s: n, Bound1s: bound}
	if n > 0 {
		b.AtS = math.Round(first.Sub(r.start).Seconds()*1000) / 1000
	}
	return b
}

// summarizePause counts the arrivals around the 429 of r, which asked for a
// pause; bound is the most the limit allows in 1 s.
func summarizePause(r phaseResult, bound int) *pauseSummary {
	p := &pauseSummary{RetryAfterS: r.pause.Seconds(), Sent: r.pauseSent > 0}
	if !p.Sent {
		return p
	}
	p.SentAtS = math.Round(r.pauseSent.Seconds()*1000) / 1000
	sent := r.start.Add(r.pauseSent)
	reached, end := sent.Add(pauseReach), sent.Add(r.pause)
	for _, a := range r.arrivals {
		switch {
		case !a.At.After(sent):
		case a.At.Before(reached):
			p.Reaching++
		case a.At.Before(end):
			p.During++
			p.LastMS = float64(a.At.Sub(sent).Microseconds()) / 1000
		default:
			if p.After == 0 {
				p.ResumedMS = float64(a.At.Sub(end).Microseconds()) / 1000
			}
			p.After++
		}
	}
	p.Busiest = busiestFrom(r, r.pauseSent+r.pause, bound)
	return p
}

// summarize judges the phases of a run.
func summarize(c config, results []phaseResult) summary {
	s := summary{
		PerMinute:    c.perMinute,
		Burst:        c.burst,
		Workers:      c.workers,
		Goroutines:   c.goroutines,
		PhaseSeconds: c.duration.Seconds(),
		LatencyMS:    float64(c.latency.Microseconds()) / 1000,
		OK:           true,
		Failures:     []string{},
	}
	rate := c.ratePerSecond()
	bound := int(math.Floor(float64(c.burst) + rate*(time.Second+stampSlack).Seconds()))
	localBursts := c.workers * max(1, c.burst/c.workers) // FallbackLocal's shares of the burst
	for _, r := range results {
		p := phaseSummary{Phase: r.num, Name: r.name, Requests: len(r.arrivals), Bound1s: bound}
		steady := time.Second
		for _, a := range r.arrivals {
			if a.Refused {
				p.Refused++
			}
			if a.At.Sub(r.start) >= steady {
				p.PerMinute++
			}
		}
		p.PerMinute *= 60 / (r.end.Sub(r.start) - steady).Seconds()
		p.XLimit = p.PerMinute / c.perMinute
		p.Max1s, _ = maxInWindow(r.arrivals, time.Second)
		var waits []float64
		for _, w := range r.reports {
			waits = append(waits, w.WaitsMS...)
			p.Failed += w.Failed
			if w.Mode == "shared" {
				p.WorkersShared++
			}
		}
		p.WaitP50MS, p.WaitP99MS = percentile(waits, 50), percentile(waits, 99)
		p.OutageLogs, p.RecoveryLogs, p.LocalServed = r.outages, r.recoveries, r.served
		switch r.mode {
		case modeShared:
			p.Checked = true
			if r.pause > 0 {
				p.Pause = summarizePause(r, bound)
			}
		case modeFallback:
			p.Checked = true
			p.Bound1s += localBursts
			p.RedisKilled = r.killed > 0
			p.KilledAtS, p.RestartedAtS = round1(r.killed.Seconds()), round1(r.restarted.Seconds())
			if r.restarted > 0 {
				// The local shares start empty, and the fleet settles the
				// shared bucket when it leaves them: no burst of their own.
				b := busiestFrom(r, r.restarted, bound)
				p.AfterRestart = &b
			}
		}
		if p.Checked && p.Max1s > p.Bound1s {
			s.OK = false
			s.Failures = append(s.Failures, fmt.Sprintf("phase %d (%s): the provider received %d requests in one second, more than the %d the limit allows",
				p.Phase, p.Name, p.Max1s, p.Bound1s))
		}
		if b := p.AfterRestart; b != nil && b.Max1s > b.Bound1s {
			s.OK = false
			s.Failures = append(s.Failures, fmt.Sprintf("phase %d (%s): the provider received %d requests in one second from %.1fs, after the restart, more than the %d the limit allows",
				p.Phase, p.Name, b.Max1s, b.AtS, b.Bound1s))
		}
		s.Phases = append(s.Phases, p)
	}
	return s
}

// writeTable prints the summary for people.
func (s summary) writeTable(w io.Writer) {
	// Numbers align right; the phases' names are padded to align left.
	names, width := []string{"phase"}, len("phase")
	for _, p := range s.Phases {
		names = append(names, fmt.Sprintf("%d %s", p.Phase, p.Name))
		width = max(width, len(names[len(names)-1]))
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "%-*s\trequests\trate/min\tx limit\tmax in 1 s\t429s\twait p50\twait p99\t\n", width, names[0])
	for i, p := range s.Phases {
		fmt.Fprintf(tw, "%-*s\t%d\t%.0f\t%.2f\t%d / %d\t%d\t%s\t%s\t\n", width, names[i+1], p.Requests, p.PerMinute, p.XLimit,
			p.Max1s, p.Bound1s, p.Refused, ms(p.WaitP50MS), ms(p.WaitP99MS))
	}
	tw.Flush()
	fmt.Fprintf(w, "\nLimit %s, burst %d; %d workers x %d goroutines; %gs a phase.\n",
		perMinute(s.PerMinute), s.Burst, s.Workers, s.Goroutines, s.PhaseSeconds)
	fmt.Fprintln(w, "rate/min: what the provider received after each phase's first second (which holds the burst).")
	fmt.Fprintln(w, "max in 1 s: the most requests in any 1-second window / the most the limit allows (burst + rate,")
	fmt.Fprintln(w, "  in phase 3 plus the workers' local shares of the burst).")
	fmt.Fprintln(w, "wait: how long requests waited for their limiter before they were sent.")
	for _, p := range s.Phases {
		if p.RedisKilled {
			fmt.Fprintf(w, "Phase 3: Redis killed at %.1fs and restarted at %.1fs; %d of %d workers logged the outage (WARN),\n  %d the recovery (INFO); the local shares granted %s meanwhile; %d ended on the shared bucket.\n",
				p.KilledAtS, p.RestartedAtS, p.OutageLogs, s.Workers, p.RecoveryLogs, requests(p.LocalServed), p.WorkersShared)
			if b := p.AfterRestart; b != nil {
				fmt.Fprintf(w, "  From the restart on, max in 1 s %d / %d (from %.1fs): burst + rate, the local shares start empty.\n",
					b.Max1s, b.Bound1s, b.AtS)
			}
		}
		if p.Pause != nil {
			s.writePause(w, p)
		}
		if p.Failed > 0 {
			fmt.Fprintf(w, "Phase %d: %d requests failed in the workers without reaching the provider.\n", p.Phase, p.Failed)
		}
	}
	fmt.Fprintf(w, "Picture: %s and %s; every request: %s\n", s.PNG, s.SVG, s.CSV)
	if s.OK {
		fmt.Fprintln(w, "OK: with the shared bucket the provider never saw more than the limit allows.")
		return
	}
	fmt.Fprintln(w, "FAIL: "+strings.Join(s.Failures, "\nFAIL: "))
}

// writePause says what the provider received around the 429 of phase p,
// which asked for a pause: in the first milliseconds, while the pause
// reached the fleet, then until the pause ended (nothing, when it reached
// every grant already queued), and after it.
func (s summary) writePause(w io.Writer, p phaseSummary) {
	ps := p.Pause
	if !ps.Sent {
		fmt.Fprintf(w, "Phase %d: no request reached the provider to be answered with 429 and Retry-After: %.0f.\n", p.Phase, ps.RetryAfterS)
		return
	}
	fmt.Fprintf(w, "Phase %d: 429 with Retry-After: %.0f sent at %.1fs, a pause until %.1fs; %s arrived in the\n  first %d ms",
		p.Phase, ps.RetryAfterS, ps.SentAtS, ps.SentAtS+ps.RetryAfterS, requests(ps.Reaching), pauseReach.Milliseconds())
	if ps.Reaching > 0 {
		fmt.Fprint(w, ", due before the pause reached them,")
	}
	fmt.Fprintf(w, " and %d from then until the pause ended", ps.During)
	if ps.During > 0 {
		fmt.Fprintf(w, ",\n  the last %.0f ms after the 429: the pause did not reach every grant already queued", ps.LastMS)
	}
	fmt.Fprintln(w, ".")
	b := ps.Busiest
	switch {
	case ps.After == 0:
		fmt.Fprintln(w, "  No request arrived after the pause.")
	case ps.During == 0:
		fmt.Fprintf(w, "  The traffic resumed %.0f ms after the pause ended: %s, max in 1 s %d / %d (from %.1fs).\n",
			ps.ResumedMS, requests(ps.After), b.Max1s, b.Bound1s, b.AtS)
	default:
		fmt.Fprintf(w, "  After the pause, %s, the first %.0f ms after its end; max in 1 s %d / %d (from %.1fs).\n",
			requests(ps.After), ps.ResumedMS, b.Max1s, b.Bound1s, b.AtS)
	}
}

// requests counts requests in words: "1 request", "2 requests".
func requests(n int) string {
	if n == 1 {
		return "1 request"
	}
	return fmt.Sprintf("%d requests", n)
}

// maxInWindow returns the most arrivals in any window of length w, closed
// at both ends, and the first arrival of the first such window.
func maxInWindow(arrivals []provider.Arrival, w time.Duration) (int, time.Time) {
	best, j := 0, 0
	var from time.Time
	for i := range arrivals {
		for j < len(arrivals) && arrivals[j].At.Sub(arrivals[i].At) <= w {
			j++
		}
		if j-i > best {
			best, from = j-i, arrivals[i].At
		}
	}
	return best, from
}

// percentile returns the p-th percentile of xs by nearest rank, 0 for none.
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

// ms formats milliseconds for the table.
func ms(v float64) string {
	if v >= 999.5 { // what %.0fms would show as 1000ms
		return fmt.Sprintf("%.2fs", v/1000)
	}
	return fmt.Sprintf("%.0fms", v)
}

func round1(f float64) float64 { return math.Round(f*10) / 10 }
