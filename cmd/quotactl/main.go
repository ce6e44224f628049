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
