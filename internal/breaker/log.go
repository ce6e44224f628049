package breaker

import (
	"log/slog"
	"time"
)

// A Policy is what a Limiter does with requests while the breaker is
// open, as its logs name it.
type Policy struct {
	Name   string // the policy, as it prints
	Mode   string // the mode it grants in
	Local  bool   // each process grants from its local share
	Open   bool   // requests pass unlimited
	DryRun bool   // measured, not enforced
}

// Record returns the log record of c, a change of the breaker of a
// Limiter of client whose policy is p, idle being its probe's idle time:
// ERROR where the outage stops or unlimits traffic, WARN where the local
// shares keep it moving within the limit, INFO as it closes.
func Record(c Change, p Policy, client string, idle time.Duration) (slog.Level, string, []slog.Attr) {
	level, msg := slog.LevelError, "quota: Redis unavailable, "+p.says()
	if p.Local {
		level = slog.LevelWarn
	}
	attrs := []slog.Attr{slog.String("redis", client)}
	counts := []slog.Attr{slog.Int64("served", c.Served), slog.Int64("refused", c.Refused)}
	switch c.Event {
	case Tripped:
		attrs = append(attrs, slog.String("bucket", c.Bucket), slog.String("policy", p.Name),
			slog.String("mode", p.Mode), slog.String("cause", c.Cause.Error()))
	case Reminded:
		msg = "quota: Redis still unavailable, " + p.says()
		attrs = append(attrs, slog.String("policy", p.Name), slog.String("mode", p.Mode),
			slog.Duration("for", c.For.Round(time.Millisecond)))
		attrs = append(append(attrs, counts...), slog.String("cause", c.Cause.Error()))
	default:
		level, msg = slog.LevelInfo, "quota: Redis available again, the shared bucket resumed"
		if c.Event == Idled {
			level, msg = slog.LevelWarn, "quota: no request for "+idle.String()+"; the next one asks Redis again"
		}
		attrs = append(append(attrs, slog.Duration("after", c.For.Round(time.Millisecond))), counts...)
	}
	return level, msg, attrs
}

// says tells what the policy does to requests.
func (p Policy) says() string {
	s := "requests now fail"
	switch {
	case p.Local:
		s = "requests now use this process's local share of each limit"
	case p.Open:
		s = "requests now pass UNLIMITED"
	}
	if p.DryRun {
		s += " (dry run: measured, not enforced)"
	}
	return s
}
