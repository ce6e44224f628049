package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/ratelimit"
)

// execute runs cmd against rdb.
func execute(ctx context.Context, rdb redis.UniversalClient, cmd command) (output, error) {
	if cmd.op == "list" {
		return listBuckets(ctx, rdb, cmd.prefix)
	}
	// The Limiter's log would repeat, on stderr, the error that quotactl
	// prints in its one line.
	l := quota.NewLimiter(rdb, quota.WithPrefix(cmd.prefix), quota.WithLogger(slog.New(slog.DiscardHandler)))
	// The bucket as it stands, read before any change. A bucket that a
	// Limiter used lately, or that has an override or a pause, shows in its
	// Status. One that shows nothing may still have keys, its slots' or a
	// first layer's that outlived its control record: missing looks.
	st, err := l.Status(ctx, cmd.name)
	if err != nil {
		return output{}, err
	}
	unknown := st.Limit.Rate == 0 && !st.Paused && st.Workers == 0 && missing(ctx, rdb, cmd.prefix, cmd.name)
	out, err := apply(ctx, l, cmd, st)
	out.unknown = unknown
	return out, err
}

// apply runs the operation of cmd with l; st is the
// bucket's Status before it.
func apply(ctx context.Context, l *quota.Limiter, cmd command, st quota.Status) (output, error) {
	name := quoteName(cmd.name) // as list prints it
	switch cmd.op {
	case "status":
		now := time.Now()
		return output{text: statusText(st, now), json: statusObject(st, now)}, nil
	case "limit":
		if err := l.SetLimit(ctx, cmd.name, cmd.limit); err != nil {
			return output{}, err
		}
		out := output{
			text: fmt.Sprintf("%s: limited to %s, burst %s, until %s\n", name, fmtRate(cmd.limit.Rate), fmtNum(cmd.limit.Burst), hintLine("limit", cmd.name, "off")),
			json: actionJSON{Name: cmd.name, Action: "limit", Override: limitJSON(&cmd.limit)},
		}
		if span := st.Limit.Burst / st.Limit.Rate; !cmd.burst && cmd.limit.Burst < st.Limit.Burst &&
			st.Limit.Burst > ratelimit.DefaultBurst(st.Limit.Rate) {
			// The bucket held a burst of its own, which the default lowers.
			keep := max(1, span*cmd.limit.Rate)
			out.note = fmt.Sprintf("BURST left out is the default burst, three seconds of RATE: %s, where the bucket held %s, %ss of its rate; "+
				"to hold %ss of RATE: %s", fmtNum(cmd.limit.Burst), fmtNum(st.Limit.Burst), fmtNum(span), fmtNum(span),
				hintLine("limit", cmd.name, cmd.rate, fmtNum(keep)))
		}
		return out, nil
	case "clear":
		if err := l.ClearLimit(ctx, cmd.name); err != nil {
			return output{}, err
		}
		return output{
			text: fmt.Sprintf("%s: no override; the callers' Limit applies\n", name),
			json: actionJSON{Name: cmd.name, Action: "limit_off"},
		}, nil
	case "pause":
		if err := l.Pause(ctx, cmd.name, cmd.pause); err != nil {
			return output{}, err
		}
		a := actionJSON{Name: cmd.name, Action: "pause"}
		text := fmt.Sprintf("%s: paused until %s\n", name, hintLine("resume", cmd.name))
		if cmd.pause == quota.Forever {
			a.Forever = true
		} else {
			s := cmd.pause.Seconds()
			a.Seconds = &s
			text = fmt.Sprintf("%s: paused for %v (a longer pause in force stays)\n", name, cmd.pause)
		}
		return output{text: text, json: a}, nil
	case "resume":
		if err := l.Resume(ctx, cmd.name); err != nil {
			return output{}, err
		}
		return output{
			text: fmt.Sprintf("%s: not paused\n", name),
			json: actionJSON{Name: cmd.name, Action: "resume"},
		}, nil
	}
	return output{}, fmt.Errorf("unknown operation %q", cmd.op)
}

// hintLine returns the command line of quotactl op on the bucket called
// name, with args, for a shell: "--" before a name that begins with "-".
func hintLine(op, name string, args ...string) string {
	line := []string{"quotactl", op, name}
	if strings.HasPrefix(name, "-") {
		line = []string{"quotactl", op, "--", name}
	}
	return shellLine(append(line, args...)...)
}

// shortenedNote follows a shortened name in list's text.
const shortenedNote = "  (shortened: its first bytes and a digest; status, limit, pause and resume need the whole name)"

// listBuckets lists the buckets under prefix.
func listBuckets(ctx context.Context, rdb redis.UniversalClient, prefix string) (output, error) {
	buckets, err := list(ctx, rdb, prefix)
	if err != nil {
		if !errors.As(err, new(redis.Error)) { // no reply: worded as the package words it
			err = fmt.Errorf("%w: %w", quota.ErrUnavailable, err)
		}
		return output{}, err
	}
	var b strings.Builder
	for _, l := range buckets {
		b.WriteString(quoteName(l.Name))
		if l.Shortened {
			b.WriteString(shortenedNote)
		}
		b.WriteString("\n")
	}
	return output{text: b.String(), json: buckets, none: len(buckets) == 0}, nil
}
