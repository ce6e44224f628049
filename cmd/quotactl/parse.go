package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/ratelimit"
	"github.com/sharedquota/quota/internal/store"
)

// usageError is bad usage: exit 2 with its message and the hint.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func badUsage(format string, args ...any) error {
	return usageError{fmt.Sprintf(format, args...)}
}

// command is a parsed command line.
type command struct {
	redis  string
	prefix string
	json   bool
	op     string // status, limit, clear, pause, resume, list, top
	name   string
	limit  quota.Limit
	rate   string        // limit's RATE as given
	burst  bool          // limit's BURST was given
	pause  time.Duration // quota.Forever for forever
}

// parse parses the command line.
func parse(args []string) (command, error) {
	var cmd command
	fs := flag.NewFlagSet("quotactl", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&cmd.redis, "redis", "", "")
	fs.StringVar(&cmd.prefix, "prefix", quota.DefaultPrefix, "")
	fs.BoolVar(&cmd.json, "json", false, "")
	rest, err := parseFlags(fs, args)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return cmd, err
		}
		msg := err.Error()
		if strings.HasPrefix(msg, "flag provided but not defined: ") {
			msg += `; an argument that begins with "-", such as a NAME, goes after "--"`
		}
		return cmd, usageError{msg}
	}
	if len(rest) == 0 {
		return cmd, badUsage("no subcommand: want status, limit, pause, resume, list or top")
	}
	cmd.op, rest = rest[0], rest[1:]
	want := func(min, max int, what string) error {
		if len(rest) < min {
			return badUsage("%s: missing arguments: want %s", cmd.op, what)
		}
		if len(rest) > max {
			return badUsage("%s: unexpected argument %q: want %s", cmd.op, rest[max], what)
		}
		cmd.name = unquoteName(rest[0])
		if cmd.name == "" {
			return badUsage("%s: the bucket's name is empty", cmd.op)
		}
		if isShortened(cmd.name) {
			return badUsage("%s: the name is one that list prints shortened: Redis keeps a name over %d bytes as its first bytes "+
				"and a digest, and quotactl reaches its bucket by the whole name only", cmd.op, store.MaxNameLen)
		}
		return nil
	}
	switch cmd.op {
	case "help":
		return cmd, flag.ErrHelp
	case "list":
		if len(rest) > 0 {
			return cmd, badUsage("list: unexpected argument %q: want none", rest[0])
		}
	case "top":
		if cmd.json {
			return cmd, badUsage("top: -json does not apply: top is a live view; status -json reads one bucket")
		}
		if len(rest) > 0 {
			if err := want(1, 1, "[NAME]"); err != nil {
				return cmd, err
			}
		}
	case "status", "resume":
		if err := want(1, 1, "NAME"); err != nil {
			return cmd, err
		}
	case "limit":
		if err := want(2, 3, "NAME RATE [BURST] or NAME off"); err != nil {
			return cmd, err
		}
		if rest[1] == "off" {
			if len(rest) > 2 {
				return cmd, badUsage("limit: unexpected argument %q after off", rest[2])
			}
			cmd.op = "clear"
			break
		}
		lim, err := parseLimit(rest[1:])
		if err != nil {
			return cmd, err
		}
		cmd.limit, cmd.rate, cmd.burst = lim, rest[1], len(rest) > 2
	case "pause":
		if err := want(2, 2, "NAME DURATION|forever"); err != nil {
			return cmd, err
		}
		d, err := parsePause(rest[1])
		if err != nil {
			return cmd, err
		}
		cmd.pause = d
	default:
		return cmd, badUsage("unknown subcommand %q: want status, limit, pause, resume, list or top", cmd.op)
	}
	return cmd, nil
}

// parseFlags parses the flags of fs wherever they stand in args, before the
// subcommand or among its arguments, and returns the other arguments in
// their order. A "--" ends the flags: every argument after it is one of the
// others, so that a name may begin with "-".
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var rest []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--" {
			return append(rest, args[i+1:]...), nil
		}
		// "-" and a negative number are arguments: no flag's name begins
		// with a digit.
		if len(a) < 2 || a[0] != '-' || '0' <= a[1] && a[1] <= '9' {
			rest = append(rest, a)
			continue
		}
		// One flag, and the argument after it when that is its value.
		n := 1
		name, _, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
		if f := fs.Lookup(name); f != nil && !hasValue && !isBool(f) && i+1 < len(args) {
			n = 2
		}
		if err := fs.Parse(args[i : i+n]); err != nil {
			return nil, err
		}
		i += n - 1
	}
	return rest, nil
}

func isBool(f *flag.Flag) bool {
	b, ok := f.Value.(interface{ IsBoolFlag() bool })
	return ok && b.IsBoolFlag()
}

// rateUnits are the units of a rate, in seconds; rateUnitNames lists them
// for messages.
var rateUnits = map[string]float64{
	"s": 1, "sec": 1, "second": 1,
	"m": 60, "min": 60, "minute": 60,
	"h": 3600, "hr": 3600, "hour": 3600,
	"d": 86400, "day": 86400,
}

const rateUnitNames = "s, sec, second, m, min, minute, h, hr, hour, d, day"

// parseRate parses a number per unit, such as 10/s, 300/min or 10000/day,
// or a number per second.
func parseRate(s string) (float64, error) {
	num, unit, per := strings.Cut(s, "/")
	secs := 1.0
	if per {
		var ok bool
		if secs, ok = rateUnits[unit]; !ok {
			return 0, badUsage("bad rate %q: the unit after / must be one of %s", s, rateUnitNames)
		}
	}
	n, err := strconv.ParseFloat(num, 64)
	if err != nil {
		return 0, badUsage("bad rate %q: want a number per second, or per unit as in 10/s, 300/min, 10000/day", s)
	}
	return n / secs, nil
}

// parseLimit parses RATE [BURST] into a Limit that the package accepts,
// with a zero burst resolved as the package resolves it.
func parseLimit(args []string) (quota.Limit, error) {
	rate, err := parseRate(args[0])
	if err != nil {
		return quota.Limit{}, err
	}
	lim := quota.Limit{Rate: rate}
	if len(args) > 1 {
		if lim.Burst, err = strconv.ParseFloat(args[1], 64); err != nil {
			return quota.Limit{}, badUsage("bad burst %q: want a number of tokens", args[1])
		}
	}
	if err := lim.Validate(); err != nil {
		why := strings.TrimPrefix(err.Error(), quota.ErrInvalidLimit.Error()+": ")
		return quota.Limit{}, badUsage("bad limit %q: %s", strings.Join(args, " "), why)
	}
	if len(args) > 1 && lim.Burst < 1 {
		// An explicit 0 is the package's default, which BURST left out
		// means: given, it is more likely a mistake.
		return quota.Limit{}, badUsage("bad burst %q: want 1 token or more, the cost of one request", args[1])
	}
	if lim.Burst == 0 {
		lim.Burst = ratelimit.DefaultBurst(lim.Rate) // for the messages
	}
	return lim, nil
}

// parsePause parses a Go duration of a microsecond or more, or "forever".
func parsePause(s string) (time.Duration, error) {
	if s == "forever" {
		return quota.Forever, nil
	}
	d, err := time.ParseDuration(s)
	if err != nil {
		return 0, badUsage("bad duration %q: want forever or a duration such as 30s, 5m, 1h30m", s)
	}
	if d < time.Microsecond {
		return 0, badUsage("bad duration %q: a pause lasts a microsecond or more", s)
	}
	return d, nil
}
