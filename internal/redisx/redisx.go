package redisx

import (
	"context"
	"crypto/rand"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.opentelemetry.io/otel/trace"
)

// ErrReply reports a reply that does not have the shape its script
// promises: a bug, or a key that something else wrote.
var ErrReply = errors.New("unexpected reply")

// A Class is what an error of a Redis call says about the call.
type Class int

const (
	Unavailable  Class = iota // the server cannot serve now
	Ended                     // the caller's context ended
	Deadline                  // the caller's deadline passed
	Rejected                  // the server rejected the call as wrong
	NoPermission              // the user may not run it, or did not log in (see isPermission)
	NotCluster                // a Cluster node redirected a client that does not follow
	BadReply                  // the reply did not have its shape (ErrReply)
)

// Classify tells what err, the error of a call made in ctx, says. cluster
// tells whether the client follows a Cluster's redirections itself, in
// which case one that still fails is an outage.
func Classify(ctx context.Context, err error, cluster bool) Class {
	if ctx.Err() != nil {
		return Ended
	}
	if d, ok := ctx.Deadline(); ok && !time.Now().Before(d) {
		// The connection's deadline, taken from ctx, fired a moment before
		// ctx itself ended: the caller's deadline, not an outage.
		return Deadline
	}
	switch {
	case errors.Is(err, ErrReply):
		return BadReply
	case isPermission(err):
		return NoPermission
	case !cluster && (redis.HasErrorPrefix(err, "MOVED") || redis.HasErrorPrefix(err, "ASK")):
		return NotCluster
	}
	var rerr redis.Error
	if errors.As(err, &rerr) && !isOutageReply(err) {
		return Rejected
	}
	return Unavailable
}

// Outage returns err, the error of a call made in ctx, when it says that
// Redis is unavailable, and nil for any other (the caller's context, a
// script error) and for nil.
func Outage(ctx context.Context, err error, cluster bool) error {
	if err != nil && Classify(ctx, err, cluster) == Unavailable {
		return err
	}
	return nil
}

// outageReplies are the error replies that say the server cannot serve now
// (loading, failing over, a replica, a cluster without quorum, a slot
// moving) rather than that the call is wrong.
var outageReplies = []string{"LOADING", "CLUSTERDOWN", "READONLY", "MASTERDOWN", "TRYAGAIN", "BUSY", "NOREPLICAS", "MOVED", "ASK", "FAILOVER", "UNBLOCKED"}

func isOutageReply(err error) bool {
	for _, p := range outageReplies {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	return false
}

// permissionReplies are the error replies of a user who did not log in
// or may not run a command.
var permissionReplies = []string{"NOPERM", "WRONGPASS", "NOAUTH"}

// scriptPermission are what Redis answers, after ERR and perhaps the
// script's location, when the ACL refuses a command a script calls:
// "The user executing the script can't run this command or subcommand",
// "... can't access at least one of the keys ...", "... can't publish to
// the channel ..." (Redis 6 and 7.0); "ACL failure in script: ..." (7.2
// and later).
var scriptPermission = []string{"The user executing the script can't ", "ACL failure in script: "}

// isPermission reports whether err is an error reply that says the user
// did not log in or may not run the call, or a command the call's script
// runs. An error the scripts make themselves, "quota: ...", may quote the
// caller's arguments, and is never one.
func isPermission(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return false
	}
	for _, p := range permissionReplies {
		if redis.HasErrorPrefix(err, p) {
			return true
		}
	}
	msg := rerr.Error()
	if strings.HasPrefix(msg, "quota: ") {
		return false
	}
	for _, s := range scriptPermission {
		if strings.Contains(msg, s) {
			return true
		}
	}
	return false
}

// IsCluster reports whether rdb is a Cluster client, which follows
// redirections itself.
func IsCluster(rdb redis.Scripter) bool {
	_, ok := rdb.(*redis.ClusterClient)
	return ok
}

// ReloadCluster makes a Cluster client learn of a failover now, without
// waiting for its periodic reload; it does nothing for other clients.
func ReloadCluster(ctx context.Context, rdb redis.Scripter) {
	if cc, ok := rdb.(*redis.ClusterClient); ok {
		cc.ReloadState(ctx)
	}
}

// Describe names the Redis servers of rdb for the logs.
func Describe(rdb redis.Scripter) string {
	switch c := rdb.(type) {
	case *redis.Client:
		return c.Options().Addr
	case *redis.ClusterClient:
		return strings.Join(c.Options().Addrs, ",")
	case *redis.Ring:
		return "ring"
	}
	return "redis"
}

// Num formats x for a script: plain digits where they are short, which
// every Lua reads, and the exponent form for the extremes.
func Num(x float64) string {
	if a := math.Abs(x); a == 0 || (a >= 1e-6 && a < 1e21) {
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
	return strconv.FormatFloat(x, 'g', -1, 64)
}

// Now returns the now ARGV of a script, which the prelude's clock reads:
// clock's now in microseconds, or "" for the server's TIME when clock is
// nil. Every call of a Limiter given a clock passes it, so that its
// scripts never call TIME, which a Redis user may lack.
func Now(clock func() time.Time) string {
	if clock == nil {
		return ""
	}
	return strconv.FormatInt(clock().UnixMicro(), 10)
}

// Touch records now in t unless t holds a time less than a second older:
// a use recorded on every call need not write on most.
func Touch(t *atomic.Int64, now int64) {
	if now-t.Load() > int64(time.Second) {
		t.Store(now)
	}
}

// Untraced returns the context of the library's own calls to Redis that
// serve no one request: background reads and subscriptions. Its parent
// span is one that is not sampled, so that a tracing hook that samples by
// the parent (the OpenTelemetry SDK's default) records none of them,
// rather than a trace of its own for each background read.
func Untraced() context.Context {
	var tid trace.TraceID
	var sid trace.SpanID
	_, _ = rand.Read(tid[:])
	_, _ = rand.Read(sid[:])
	return trace.ContextWithRemoteSpanContext(context.Background(),
		trace.NewSpanContext(trace.SpanContextConfig{TraceID: tid, SpanID: sid, Remote: true}))
}
