package main

import (
	"context"
	"fmt"
	"time"

	"github.com/sharedquota/quota/demo/internal/live"
	"github.com/sharedquota/quota/demo/internal/provider"
)

// startDelay is the time the worker processes are given to start before a
// phase begins, so that they all begin together.
const startDelay = 400 * time.Millisecond

// When Redis is killed and restarted in the outage phase, as fractions of
// the phase.
const (
	killAt    = 0.35
	restartAt = 0.65
)

// When the provider asks for a pause in the pause phase, as a fraction of
// the phase.
const pauseAt = 0.4

// A phase is one way of limiting the fleet.
type phase struct {
	num    int
	name   string        // for the table and the bars
	mode   string        // the workers' modeLocal, modeShared or modeFallback
	outage bool          // Redis is killed and restarted during the phase
	pause  time.Duration // the provider answers one request with 429 and Retry-After: pause; 0 if not
}

// plan returns the phases of a run. The third kills Redis only if the demo
// started it. A fourth, in which the provider asks for pause, follows when
// pause is above 0.
func plan(canKill bool, pause time.Duration) []phase {
	third := phase{num: 3, name: "shared, Redis killed", mode: modeFallback, outage: true}
	if !canKill {
		third.name, third.outage = "shared, no outage", false
	}
	phases := []phase{
		{num: 1, name: "local limiters", mode: modeLocal},
		{num: 2, name: "shared bucket", mode: modeShared},
		third,
	}
	if pause > 0 {
		phases = append(phases, phase{num: 4, name: "shared, provider asks for a pause", mode: modeShared, pause: pause})
	}
	return phases
}

// label names the phase on the display.
func (ph phase) label() string { return fmt.Sprintf("%d %s", ph.num, ph.name) }

// describe explains the phase in a sentence.
func (ph phase) describe(c config) string {
	switch ph.mode {
	case modeLocal:
		return fmt.Sprintf("each of the %d workers has its own rate.Limiter at %s", c.workers, perMinute(c.perMinute))
	case modeShared:
		s := fmt.Sprintf("the %d workers share one quota bucket in Redis at %s", c.workers, perMinute(c.perMinute))
		if ph.pause > 0 {
			s += fmt.Sprintf("; from %.1fs the provider answers the next request with 429 and Retry-After: %.0f",
				pauseAt*c.duration.Seconds(), ph.pause.Seconds())
		}
		return s
	}
	if !ph.outage {
		return fmt.Sprintf("the shared bucket with quota.FallbackLocal(%d); the demo did not start the Redis at %s, so it does not kill it and this phase has no outage",
			c.workers, c.redis)
	}
	return fmt.Sprintf("the shared bucket with quota.FallbackLocal(%d); Redis is killed at %.0fs and restarted at %.0fs",
		c.workers, killAt*c.duration.Seconds(), restartAt*c.duration.Seconds())
}

// A phaseResult is what happened in one phase.
type phaseResult struct {
	phase
	start, end time.Time
	arrivals   []provider.Arrival // at the provider
	reports    []workerReport
	outages    int           // workers' records of Redis becoming unavailable
	recoveries int           // and of it being available again
	served     int           // requests the workers' policy served during the outage, as their recovery records say
	killed     time.Duration // when Redis was killed, since start; 0 if it was not
	restarted  time.Duration // when it was started again
	pauseSent  time.Duration // when the provider sent the 429 asking for a pause, since start; 0 if it did not
}

// runPhase runs one phase with a fresh fleet of worker processes.
func (d *demo) runPhase(ctx context.Context, ph phase) (phaseResult, error) {
	d.prov.Reset()
	start := time.Now().Add(startDelay)
	end := start.Add(d.cfg.duration)
	res := phaseResult{phase: ph, start: start, end: end}
	fmt.Fprintf(d.display, "\nPhase %d: %s.\n", ph.num, ph.describe(d.cfg))

	logs := &logRelay{w: d.display, start: start}
	f, err := startFleet(ctx, d.specs(ph, start, end), logs)
	if err != nil {
		return res, err
	}
	bar := d.display.Phase(ph.label(), start, d.cfg.duration, func() live.Sample { return d.sample(start, end) })
	var outageErr error
	switch {
	case ph.outage:
		outageErr = d.outage(ctx, &res, logs)
	case ph.pause > 0:
		d.askPause(ctx, &res, logs)
	}
	reports, err := f.wait()
	bar.Done()
	if err == nil {
		err = outageErr
	}
	if err == nil {
		err = ctx.Err()
	}
	res.reports = reports
	res.arrivals = d.prov.Between(start, end.Add(50*time.Millisecond))
	res.outages, res.recoveries, res.served = logs.counts()
	return res, err
}

// specs returns the specs of a phase's workers. Each phase has a bucket of
// its own in Redis, so that it does not start behind the queue the previous
// phase left: the waits cancelled at a phase's end hand back only the tokens
// no later caller was queued behind.
func (d *demo) specs(ph phase, start, end time.Time) []workerSpec {
	var specs []workerSpec
	for i := 1; i <= d.cfg.workers; i++ {
		specs = append(specs, workerSpec{
			ID:         i,
			Mode:       ph.mode,
			URL:        d.prov.URL(),
			Redis:      d.redisAddr,
			Prefix:     fmt.Sprintf("quota-demo:phase%d:", ph.num),
			Rate:       d.cfg.ratePerSecond(),
			Burst:      d.cfg.burst,
			Workers:    d.cfg.workers,
			Goroutines: d.cfg.goroutines,
			Start:      start,
			End:        end,
		})
	}
	return specs
}

// sample returns what the provider sees now, or saw at end once the phase
// is over, for the live display.
func (d *demo) sample(start, end time.Time) live.Sample {
	now := time.Now()
	if now.After(end) {
		now = end
	}
	arrived, _ := d.prov.Count(now.Add(-time.Second), now)
	_, refused := d.prov.Count(start, now)
	return live.Sample{PerMinute: float64(arrived) * 60, Limit: d.cfg.perMinute, Refused: refused}
}

// outage kills Redis with SIGKILL during the phase and starts it again on
// the same port.
func (d *demo) outage(ctx context.Context, res *phaseResult, logs *logRelay) error {
	if !sleepUntil(ctx, res.start.Add(time.Duration(killAt*float64(d.cfg.duration)))) {
		return nil
	}
	if err := d.redis.Kill(); err != nil {
		return fmt.Errorf("killing redis-server: %w", err)
	}
	res.killed = time.Since(res.start)
	logs.printf("demo     | redis-server killed with SIGKILL")
	if !sleepUntil(ctx, res.start.Add(time.Duration(restartAt*float64(d.cfg.duration)))) {
		return nil
	}
	if err := d.redis.Restart(); err != nil {
		return fmt.Errorf("restarting redis-server: %w", err)
	}
	res.restarted = time.Since(res.start)
	logs.printf("demo     | redis-server restarted on %s, empty", d.redisAddr)
	return nil
}

// askPause has the provider answer one request with 429 and Retry-After
// during the phase, and notes when that answer was sent.
func (d *demo) askPause(ctx context.Context, res *phaseResult, logs *logRelay) {
	if !sleepUntil(ctx, res.start.Add(time.Duration(pauseAt*float64(d.cfg.duration)))) {
		return
	}
	sent := d.prov.AskPause(res.pause)
	timer := time.NewTimer(time.Until(res.end))
	defer timer.Stop()
	select {
	case at := <-sent:
		res.pauseSent = at.Sub(res.start)
		logs.printf("demo     | the provider answered 429 with Retry-After: %.0f", res.pause.Seconds())
	case <-timer.C:
		logs.printf("demo     | no request reached the provider to answer with 429")
	case <-ctx.Done():
	}
}

// sleepUntil sleeps until t and reports whether ctx is still live.
func sleepUntil(ctx context.Context, t time.Time) bool {
	timer := time.NewTimer(time.Until(t))
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-ctx.Done():
		return false
	}
}
