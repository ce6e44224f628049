package main

import (
	"fmt"
	"time"

	"github.com/sharedquota/quota/demo/internal/chart"
	"github.com/sharedquota/quota/demo/internal/provider"
)

// step is the spacing of the picture's points.
const step = 100 * time.Millisecond

// figure draws what the provider received in each phase.
func figure(c config, results []phaseResult, sum summary) chart.Figure {
	f := chart.Figure{
		Title: fmt.Sprintf("What the provider received: %d workers x %d goroutines, limit %s (burst %d)",
			c.workers, c.goroutines, perMinute(c.perMinute), c.burst),
		Limit:   c.perMinute,
		Allowed: (float64(c.burst) + c.ratePerSecond()) * 60,
		Seconds: c.duration.Seconds(),
	}
	for i, r := range results {
		p := chart.Panel{Title: panelTitle(c, r, sum.Phases[i])}
		p.T, p.Received, p.Refused = perSecond(r.arrivals, r.start, c.duration)
		if r.killed > 0 {
			p.Marks = append(p.Marks, chart.Mark{At: r.killed.Seconds(), Label: "Redis killed"})
		}
		if r.restarted > 0 {
			p.Marks = append(p.Marks, chart.Mark{At: r.restarted.Seconds(), Label: "Redis restarted"})
		}
		if r.pauseSent > 0 {
			p.Marks = append(p.Marks,
				chart.Mark{At: r.pauseSent.Seconds(), Label: fmt.Sprintf("429, Retry-After: %.0f", r.pause.Seconds())},
				chart.Mark{At: (r.pauseSent + r.pause).Seconds(), Label: "pause ends"})
		}
		f.Panels = append(f.Panels, p)
	}
	return f
}

// panelTitle sums a phase up in a line.
func panelTitle(c config, r phaseResult, p phaseSummary) string {
	outcome := fmt.Sprintf("the provider received %.2fx the limit and refused %d (429)", p.XLimit, p.Refused)
	switch {
	case r.mode == modeLocal:
		return fmt.Sprintf("%d. A local limiter in each worker, each at %s: %s", r.num, perMinute(c.perMinute), outcome)
	case r.mode == modeShared && r.pause > 0:
		return fmt.Sprintf("%d. The shared bucket, the provider asks for a %.0f s pause: %s", r.num, r.pause.Seconds(), outcome)
	case r.mode == modeShared:
		return fmt.Sprintf("%d. One shared quota bucket in Redis at %s: %s", r.num, perMinute(c.perMinute), outcome)
	case r.outage:
		return fmt.Sprintf("%d. The shared bucket with FallbackLocal(%d), Redis killed and restarted: %s", r.num, c.workers, outcome)
	}
	return fmt.Sprintf("%d. The shared bucket with FallbackLocal(%d), no outage: %s", r.num, c.workers, outcome)
}

// perSecond returns, every step from the phase's start, the requests
// received in the preceding second and those refused, both per minute.
func perSecond(arrivals []provider.Arrival, start time.Time, d time.Duration) (t, received, refused []float64) {
	lo, hi, refusedIn := 0, 0, 0
	for at := step; at <= d; at += step {
		now := start.Add(at)
		for hi < len(arrivals) && !arrivals[hi].At.After(now) {
			if arrivals[hi].Refused {
				refusedIn++
			}
			hi++
		}
		for lo < hi && !arrivals[lo].At.After(now.Add(-time.Second)) {
			if arrivals[lo].Refused {
				refusedIn--
			}
			lo++
		}
		t = append(t, at.Seconds())
		received = append(received, float64(hi-lo)*60)
		refused = append(refused, float64(refusedIn)*60)
	}
	return t, received, refused
}
