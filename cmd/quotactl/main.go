// Command quotactl reads and changes, at runtime, the buckets that the
// Limiters of package github.com/sharedquota/quota share in Redis. It is
// named as control tools are (systemctl, kubectl) so as not to clash with
// quota(1), the disk quota tool that Linux distributions install as quota.
//
// Usage:
//
//	quotactl [flags] status NAME
//	quotactl [flags] limit NAME RATE [BURST]
//	quotactl [flags] limit NAME off
//	quotactl [flags] pause NAME DURATION|forever
//	quotactl [flags] resume NAME
//	quotactl [flags] list
//
// status shows the bucket called NAME: the Limit in force and the override,
// if any; the tokens it holds and its queue as a duration; its pause; and
// the Limiters that used it in the last few seconds.
//
// limit replaces the Limit of the bucket's first layer for every Limiter
// that shares the Redis and the prefix, within a second; further layers
// keep their own. RATE is a number per second, or a number per unit: 10/s,
// 300/min, 20/h, 10000/day; the units are s, sec, second, m, min, minute,
// h, hr, hour, d and day. BURST defaults to three seconds of RATE and at
// least one token, as it does in the package. The bucket must fill from
// empty within 366 days. "limit NAME off" removes the override: the
// callers' Limits apply again.
//
// pause stops every grant from the bucket, in every process, grants already
// queued included, for DURATION (a Go duration: 30s, 5m, 1h30m) or until
// resume when it is "forever". resume ends a pause early.
//
// list prints the buckets that have a key under the prefix, one name a
// line, quoted for a POSIX shell where it needs it, or with -json an array
// of objects such as {"name":"api.example.com"}. A name longer than 200
// bytes is kept in Redis shortened to its first bytes and a digest; list
// prints that form, marked "(shortened: ...)" or "shortened":true. It reads
// the keys with SCAN, a thousand at a time, on every master of a Cluster,
// so that Redis serves its other clients meanwhile; the Redis user needs
// +scan for it, which the other subcommands do without. A bucket idle for a few seconds,
// with neither an override nor a pause, has no keys: list does not show it.
//
// status, limit, pause and resume warn on stderr when Redis holds no key
// of the bucket called NAME (its own, its control record or those of its
// concurrency slots), in case NAME or -prefix is mistyped, and go on: a
// bucket unused for a few seconds, without an override and without a
// pause, has no keys either.
//
// The flags may come before the subcommand, after it, or among its
// arguments: "quotactl status api -json" is "quotactl -json status api".
// A "--" ends them, so that a NAME beginning with "-" can follow it:
// "quotactl status -- -api".
//
//	-redis ADDR   the Redis server, host:port; a comma-separated list means
//	              the nodes of a Redis Cluster; a redis:// or rediss:// URL
//	              gives a password and TLS too. Without -redis, the
//	              environment variable REDIS_URL, else localhost:6379.
//	-prefix P     the prefix of the keys, as given to quota.WithPrefix
//	              (default "quota:").
//	-json         print one JSON object instead of text; list prints an
//	              array of them.
//
// Exit status: 0 on success, 1 when Redis fails or refuses (the message
// names the address, never the password), 2 on bad usage, with a one-line
// reason on stderr.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
)

const usage = `usage:
  quotactl [flags] status NAME
  quotactl [flags] limit NAME RATE [BURST]  RATE as 10/s, 300/min, 20/hour, 10000/day, or a number per second
  quotactl [flags] limit NAME off           remove the override
  quotactl [flags] pause NAME DURATION|forever
  quotactl [flags] resume NAME
  quotactl [flags] list                     the buckets that have keys, one a line

flags, before or after the subcommand and its arguments ("--" ends them):
  -redis ADDR[,ADDR...]  Redis host:port, a Cluster's nodes comma-separated,
                         or a redis:// or rediss:// URL
                         (default $REDIS_URL, else localhost:6379)
  -prefix P              the keys' prefix, as quota.WithPrefix (default "quota:")
  -json                  print one JSON object (list: an array)

A warning on stderr tells when Redis holds no key of the bucket NAME (a typo
in NAME or -prefix?); the subcommand goes on.

exit status: 0 done, 1 Redis failed, 2 bad usage
`

const hint = "run 'quotactl -h' for usage"

// Timeouts of the Redis client, and of the whole command but list, whose
// scan takes as many calls as the keys need.
const (
	dialTimeout = 2 * time.Second
	ioTimeout   = 3 * time.Second
	overall     = 5 * time.Second
)

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr, os.Getenv))
}

type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

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
	op     string // status, limit, clear, pause, resume, list
	name   string
	limit  quota.Limit
	pause  time.Duration // quota.Forever for forever
}

// run runs the command line args and returns the exit status.
func run(args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	redis.SetLogger(quiet{}) // the one-line error says it all
	cmd, err := parse(args)
	if errors.Is(err, flag.ErrHelp) {
		fmt.Fprint(stdout, usage)
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "quotactl: %v\n%s\n", err, hint)
		return 2
	}
	rdb, addr, err := client(cmd.redis, getenv)
	if err != nil {
		fmt.Fprintf(stderr, "quotactl: %v\n%s\n", err, hint)
		return 2
	}
	defer rdb.Close()
	ctx := context.Background()
	if cmd.op != "list" {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, overall)
		defer cancel()
	}
	out, err := execute(ctx, rdb, cmd)
	if err != nil {
		if errors.Is(err, quota.ErrInvalidLimit) {
			fmt.Fprintf(stderr, "quotactl: %v\n%s\n", err, hint)
			return 2
		}
		fmt.Fprintf(stderr, "quotactl: redis at %s: %v\n", addr, oneLine(err))
		return 1
	}
	if out.none {
		fmt.Fprintf(stderr, "quotactl: warning: no bucket under prefix %q in Redis (another -prefix?)\n", cmd.prefix)
	}
	if out.unknown {
		fmt.Fprintf(stderr, "quotactl: warning: no bucket %q under prefix %q in Redis (a typo?); "+
			"a bucket unused lately, with no override and no pause, has no keys either\n", cmd.name, cmd.prefix)
	}
	if cmd.json {
		b, _ := json.Marshal(out.json)
		fmt.Fprintf(stdout, "%s\n", b)
	} else {
		fmt.Fprint(stdout, out.text)
	}
	return 0
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
		return cmd, usageError{err.Error()}
	}
	if len(rest) == 0 {
		return cmd, badUsage("no subcommand: want status, limit, pause, resume or list")
	}
	cmd.op, rest = rest[0], rest[1:]
	want := func(min, max int, what string) error {
		if len(rest) < min {
			return badUsage("%s: missing arguments: want %s", cmd.op, what)
		}
		if len(rest) > max {
			return badUsage("%s: unexpected argument %q: want %s", cmd.op, rest[max], what)
		}
		if rest[0] == "" {
			return badUsage("%s: the bucket's name is empty", cmd.op)
		}
		cmd.name = rest[0]
		return nil
	}
	switch cmd.op {
	case "help":
		return cmd, flag.ErrHelp
	case "list":
		if len(rest) > 0 {
			return cmd, badUsage("list: unexpected argument %q: want none", rest[0])
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
		cmd.limit = lim
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
		return cmd, badUsage("unknown subcommand %q: want status, limit, pause, resume or list", cmd.op)
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
		// The package takes it, but a bucket that never holds a whole
		// token refuses every request of one, fleet-wide.
		return quota.Limit{}, badUsage("bad burst %q: want 1 token or more, the cost of one request", args[1])
	}
	if lim.Burst == 0 {
		lim.Burst = max(1, 3*lim.Rate) // the package's default, for the messages
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

// client returns the Redis client that spec (the -redis flag) or the
// environment names, and its address for messages, without a password.
func client(spec string, getenv func(string) string) (redis.UniversalClient, string, error) {
	src := "-redis"
	if spec == "" {
		if u := getenv("REDIS_URL"); u != "" {
			src, spec = "REDIS_URL", u
		} else {
			spec = "localhost:6379"
		}
	}
	switch {
	case strings.HasPrefix(spec, "redis://") || strings.HasPrefix(spec, "rediss://"):
		o, err := redis.ParseURL(spec)
		if err != nil {
			var uerr *url.Error
			if errors.As(err, &uerr) {
				err = uerr.Err // url.Error quotes the URL, password and all
			}
			return nil, "", badUsage("bad %s: %v", src, err)
		}
		timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
		return redis.NewClient(o), o.Addr, nil
	case src == "REDIS_URL":
		return nil, "", badUsage("bad REDIS_URL: want a redis:// or rediss:// URL")
	case strings.Contains(spec, "://"):
		return nil, "", badUsage("bad -redis: want host:port, a comma-separated list of them, or a redis:// or rediss:// URL")
	case strings.Contains(spec, ","):
		addrs := strings.Split(spec, ",")
		for _, a := range addrs {
			if err := checkAddr(a); err != nil {
				return nil, "", err
			}
		}
		o := &redis.ClusterOptions{Addrs: addrs}
		timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
		return redis.NewClusterClient(o), spec, nil
	}
	if err := checkAddr(spec); err != nil {
		return nil, "", err
	}
	o := &redis.Options{Addr: spec}
	timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
	return redis.NewClient(o), spec, nil
}

func timeouts(dial, read, write *time.Duration, ctxTimeout *bool) {
	*dial, *read, *write, *ctxTimeout = dialTimeout, ioTimeout, ioTimeout, true
}

// checkAddr checks that a is host:port.
func checkAddr(a string) error {
	i := strings.LastIndex(a, ":")
	if i <= 0 {
		return badUsage("bad -redis address %q: want host:port", a)
	}
	if p, err := strconv.Atoi(a[i+1:]); err != nil || p <= 0 || p > 65535 {
		return badUsage("bad -redis address %q: want host:port", a)
	}
	return nil
}

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

// execute runs cmd against rdb.
func execute(ctx context.Context, rdb redis.UniversalClient, cmd command) (output, error) {
	if cmd.op == "list" {
		return listBuckets(ctx, rdb, cmd.prefix)
	}
	l := quota.NewLimiter(rdb, quota.WithPrefix(cmd.prefix))
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
	switch cmd.op {
	case "status":
		now := time.Now()
		return output{text: statusText(st, now), json: statusObject(st, now)}, nil
	case "limit":
		if err := l.SetLimit(ctx, cmd.name, cmd.limit); err != nil {
			return output{}, err
		}
		return output{
			text: fmt.Sprintf("%s: limited to %s, burst %s, until %s\n", cmd.name, fmtRate(cmd.limit.Rate), fmtNum(cmd.limit.Burst), shellLine("quotactl", "limit", cmd.name, "off")),
			json: actionJSON{Name: cmd.name, Action: "limit", Override: limitJSON(&cmd.limit)},
		}, nil
	case "clear":
		if err := l.ClearLimit(ctx, cmd.name); err != nil {
			return output{}, err
		}
		return output{
			text: fmt.Sprintf("%s: no override; the callers' Limit applies\n", cmd.name),
			json: actionJSON{Name: cmd.name, Action: "limit_off"},
		}, nil
	case "pause":
		if err := l.Pause(ctx, cmd.name, cmd.pause); err != nil {
			return output{}, err
		}
		a := actionJSON{Name: cmd.name, Action: "pause"}
		text := fmt.Sprintf("%s: paused until %s\n", cmd.name, shellLine("quotactl", "resume", cmd.name))
		if cmd.pause == quota.Forever {
			a.Forever = true
		} else {
			s := cmd.pause.Seconds()
			a.Seconds = &s
			text = fmt.Sprintf("%s: paused for %v (a longer pause in force stays)\n", cmd.name, cmd.pause)
		}
		return output{text: text, json: a}, nil
	case "resume":
		if err := l.Resume(ctx, cmd.name); err != nil {
			return output{}, err
		}
		return output{
			text: fmt.Sprintf("%s: not paused\n", cmd.name),
			json: actionJSON{Name: cmd.name, Action: "resume"},
		}, nil
	}
	return output{}, fmt.Errorf("unknown operation %q", cmd.op)
}

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
		b.WriteString(shellLine(l.Name))
		if l.Shortened {
			b.WriteString("  (shortened: the name's first bytes and a digest of it)")
		}
		b.WriteString("\n")
	}
	return output{text: b.String(), json: buckets, none: len(buckets) == 0}, nil
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
