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
//	quotactl [flags] top [NAME]
//
// status shows the bucket called NAME whole: the Limit in force and the
// override, if any; the tokens it holds, its queue as a duration and what
// it granted a second lately, with a chart of its last minute; its pause
// and its resume after an outage; the Limiters that used it in the last
// few seconds; its slots; and when it has them, each layer and meter, the
// priority classes and the tenants (docs/operating.md tells each field).
//
// limit replaces the Limit of the bucket's first layer for every Limiter
// that shares the Redis and the prefix, within a second; further layers
// keep their own. RATE is a number per second, or a number per unit: 10/s,
// 300/min, 20/h, 10000/day; the units are s, sec, second, m, min, minute,
// h, hr, hour, d and day. BURST left out is the default burst of a
// quota.Limit, three seconds of RATE and at least one token, on a metered
// bucket too; a note on stderr tells when that lowers a burst the bucket
// held above its own default, with the command that keeps as many seconds
// of RATE. Given, BURST is at least 1. The bucket must fill from empty
// within 366 days. "limit NAME off" removes the override: the
// callers' Limits apply again.
//
// pause stops every grant from the bucket, in every process, grants already
// queued included, for DURATION (a Go duration: 30s, 5m, 1h30m) or until
// resume when it is "forever". resume ends a pause early.
//
// list prints the buckets that have a key under the prefix, one name a
// line, or with -json an array of objects such as
// {"name":"api.example.com"}. It reads the keys with SCAN, a thousand at a
// time, on every master of a Cluster, so that Redis serves its other
// clients meanwhile; the Redis user needs +scan for it, which the other
// subcommands do without. A bucket idle for a few seconds, with neither an
// override nor a pause, has no keys: list does not show it.
//
// top is a live view of the buckets under the prefix, on the terminal,
// refreshed every second, as top(1) shows processes: one line a bucket,
// busiest first (by the share of its limit it granted over the last five
// seconds), with its grants a second against its limit and a sparkline of
// the last minute's, its queue, its pause (who set it, and the time left)
// and its concurrency slots held and waited for. The arrow keys (or j and
// k) move the cursor, enter shows the bucket whole: each layer's meter,
// limit, tokens, queue and rate, its priority classes, its tenants, its
// slots and the Limiters that used it lately; esc goes back. "top NAME"
// opens on the bucket called NAME. q or Ctrl-C ends it, exit status 0,
// the terminal as it was. top finds the buckets as list does, with SCAN
// on every master of a Cluster, again every five seconds while the list
// shows, and reads each bucket every second with pipelined reads, no
// script (package status); a bucket whose name list prints shortened is
// left out. It needs a terminal on stdin and stdout (exit 2 without one),
// and does not take -json. A Redis that fails meanwhile is named at the
// foot of the screen, and top goes on.
//
// Names. list, status and the other subcommands print a name as one shell
// word, on one line, that bash, zsh and ksh read back as the name: bare
// when it has only letters, digits and - _ . / : @ % + = , in it
// (api.example.com); else in single quotes when every character is
// printable ('my bucket'); else in $'...', with \n, \t, \r,
// \\, \' and, for the other bytes of control characters, invisible runes
// and invalid UTF-8, \ooo in octal ($'line\nbreak'). NAME may be given as
// the name itself or in that printed form, as a script that reads list's
// lines passes it: an argument that begins with ' or $' and is one whole
// quoted word is read as the name it quotes; a bucket whose own name is
// such a word is reached by its printed form, passed as it is (quoted once
// more in a shell). In -json a name is a JSON string, in which bytes that
// are not UTF-8 read as U+FFFD.
//
// A name longer than 200 bytes is kept in Redis shortened to its first
// bytes, "~" and a digest, and cannot be read back whole: list prints that
// form, marked "(shortened: ...)" or "shortened":true. status, limit,
// pause and resume refuse it (exit 2) rather than reach another bucket:
// they take the whole name, which they shorten as the package does.
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
//	              One node of a Redis Cluster, as redis-cli -c takes it,
//	              is the Cluster: quotactl asks the server INFO (or, from
//	              a user who may not run INFO, HELLO) whether it is one,
//	              then reaches every bucket from that node, and list
//	              scans every master. A Cluster client needs +cluster|slots
//	              beside the user's other commands, and database 0.
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
	"os"
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
  quotactl [flags] top [NAME]               a live view of the buckets, busiest first;
                                            arrows and enter: a bucket whole, esc: back, q: quit

flags, before or after the subcommand and its arguments ("--" ends them):
  -redis ADDR[,ADDR...]  Redis host:port, a Cluster's nodes comma-separated,
                         or a redis:// or rediss:// URL
                         (default $REDIS_URL, else localhost:6379); one node
                         of a Cluster is the whole Cluster, as with redis-cli -c
  -prefix P              the keys' prefix, as quota.WithPrefix (default "quota:")
  -json                  print one JSON object (list: an array)

NAME: as list prints it, or the name itself. list prints a name bare when it
has only letters, digits and -_./:@%+=, else as one shell word on one line:
'my bucket', 'it'\''s', $'line\nbreak' (\n \t \r \\ \' and \ooo bytes).
A name over 200 bytes is kept in Redis as its first bytes and a digest; list
prints that form marked "(shortened: ...)", which the other subcommands refuse:
give them the whole name. A NAME that begins with "-" goes after "--".

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
	if cmd.op == "top" && (!isTerminal(stdout) || !isTerminal(os.Stdin)) {
		fmt.Fprintf(stderr, "quotactl: top: needs a terminal on stdin and stdout; status and list read without one\n%s\n", hint)
		return 2
	}
	t, err := parseTarget(cmd.redis, getenv)
	if err != nil {
		fmt.Fprintf(stderr, "quotactl: %v\n%s\n", err, hint)
		return 2
	}
	ctx := context.Background()
	rdb, err := connect(ctx, t)
	if errors.As(err, new(usageError)) {
		fmt.Fprintf(stderr, "quotactl: %v\n%s\n", err, hint)
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "quotactl: redis at %s: %v\n", t.addr, oneLine(err))
		return 1
	}
	defer rdb.Close()
	if cmd.op == "top" {
		if err := runTop(ctx, rdb, cmd, t.addr, os.Stdin, stdout); err != nil {
			fmt.Fprintf(stderr, "quotactl: top: %v\n", oneLine(err))
			return 1
		}
		return 0
	}
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
		fmt.Fprintf(stderr, "quotactl: redis at %s: %v\n", t.addr, oneLine(err))
		return 1
	}
	if out.none {
		fmt.Fprintf(stderr, "quotactl: warning: no bucket under prefix %q in Redis (another -prefix?)\n", cmd.prefix)
	}
	if out.unknown {
		fmt.Fprintf(stderr, "quotactl: warning: no bucket %q under prefix %q in Redis (a typo?); "+
			"a bucket unused lately, with no override and no pause, has no keys either\n", cmd.name, cmd.prefix)
	}
	if out.note != "" {
		fmt.Fprintf(stderr, "quotactl: note: %s\n", out.note)
	}
	if cmd.json {
		b, _ := json.Marshal(out.json)
		fmt.Fprintf(stdout, "%s\n", b)
	} else {
		fmt.Fprint(stdout, out.text)
	}
	return 0
}
