package quota

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of how the errors of Redis calls are classified (errors.go, and
// Limiter.classify in policy.go): which are outages for the policy, and
// which are the caller's (a cancelled context), a script's or a
// misconfiguration's, which no policy hides.

func TestScriptErrorDoesNotSwitchMode(t *testing.T) {
	mr, l, logs := degradedMini(t, FailOpen)
	mr.Set("quota:{k}", "not a number")
	mr.HSet("quota:{h}", "f", "v")
	for _, key := range []string{"k", "h"} {
		if err := l.Wait(context.Background(), key, PerSecond(1)); !errors.Is(err, ErrScript) {
			t.Errorf("%s: err = %v, want ErrScript", key, err)
		}
	}
	if l.Mode() != ModeShared || logs.Count(slog.LevelError, "") != 0 {
		t.Errorf("a script error switched the mode to %v:\n%s", l.Mode(), logs)
	}
}

func TestCallerCancelIsNotAnOutage(t *testing.T) {
	mr, l, logs := degradedMini(t, FailOpen)
	mr.SetTime(time.Now())
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := l.Wait(ctx, "k", PerSecond(1)); !errors.Is(err, context.Canceled) {
		t.Errorf("err = %v, want context.Canceled", err)
	}
	if l.Mode() != ModeShared || logs.Len() != 0 {
		t.Errorf("a cancelled caller switched the mode to %v", l.Mode())
	}
}

type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

func TestClassify(t *testing.T) {
	_, l, _ := degradedMini(t, FailClosed)
	ctx := context.Background()
	for _, tc := range []struct {
		err  error
		want error
	}{
		{replyError("LOADING Redis is loading the dataset in memory"), ErrUnavailable},
		{replyError("CLUSTERDOWN The cluster is down"), ErrUnavailable},
		{replyError("READONLY You can't write against a read only replica."), ErrUnavailable},
		{replyError("MASTERDOWN Link with MASTER is down"), ErrUnavailable},
		{replyError("TRYAGAIN Multiple keys request during rehashing of slot"), ErrUnavailable},
		{replyError("BUSY Redis is busy running a script"), ErrUnavailable},
		{redis.ErrPoolTimeout, ErrUnavailable},
		{redis.ErrClosed, ErrUnavailable},
		{errors.New("dial tcp 127.0.0.1:1: connect: connection refused"), ErrUnavailable},
		{replyError("ERR user_script:1: Script attempted to access nonexistent global variable"), ErrScript},
		{replyError("WRONGTYPE Operation against a key holding the wrong kind of value"), ErrScript},
		{replyError("NOPERM User quota has no permissions to run the 'evalsha' command"), ErrNoPermission},
	} {
		if got := l.classify(ctx, tc.err); !errors.Is(got, tc.want) {
			t.Errorf("classify(%v) = %v, want %v", tc.err, got, tc.want)
		}
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if got := l.classify(cancelled, context.Canceled); got != context.Canceled {
		t.Errorf("classify of the caller's cancellation = %v", got)
	}
	// The connection's deadline, taken from the context's, can fire a moment
	// before the context reports it: still the caller's deadline.
	expiring := pastDeadline{ctx}
	if got := l.classify(expiring, errors.New("read tcp: i/o timeout")); got != context.DeadlineExceeded {
		t.Errorf("classify of a timeout at the caller's deadline = %v, want context.DeadlineExceeded", got)
	}
}

// pastDeadline is a context whose deadline has passed but which does not
// report it yet.
type pastDeadline struct{ context.Context }

func (pastDeadline) Deadline() (time.Time, bool) { return time.Now().Add(-time.Millisecond), true }

func TestScriptErrorIsNotUnavailable(t *testing.T) {
	mr, rdb, _ := newMini(t)
	mr.HSet("quota:{k}", "tokens", "1") // a key of the wrong type under the prefix
	err := NewLimiter(rdb).Wait(context.Background(), "k", PerSecond(1))
	if !errors.Is(err, ErrScript) || errors.Is(err, ErrUnavailable) {
		t.Errorf("err = %v, want ErrScript and not ErrUnavailable", err)
	}
}

// A plain client pointed at one node of a Cluster is a mistake to report,
// not an outage for the policy to hide.
func TestClusterNodeWithPlainClient(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cl := redistest.StartCluster(t, 3, 0)
	node := cl.Nodes()[0]
	logs := &logRecorder{}
	rdb := node.Client(t)
	l := NewLimiter(rdb, WithPolicy(FailOpen), WithLogger(slog.New(logs)))
	ctx := context.Background()

	// A bucket whose slot another node serves.
	name := ""
	for i := 0; name == ""; i++ {
		n := fmt.Sprintf("bucket-%d", i)
		key, _ := bucketKey(l.cfg.prefix, n)
		if cl.MasterFor(key) != node {
			name = n
		}
	}
	err := l.Wait(ctx, name, PerSecond(10))
	if !errors.Is(err, ErrScript) || !strings.Contains(err.Error(), "ClusterClient") {
		t.Fatalf("Wait through a plain client on a Cluster node = %v, want ErrScript naming the ClusterClient", err)
	}
	if errors.Is(err, ErrUnavailable) || Permanent(err) != true {
		t.Errorf("%v: an outage, or not permanent", err)
	}
	if l.Mode() != ModeShared || logs.Count(slog.LevelError, "unavailable") != 0 {
		t.Errorf("mode %v, logs:\n%s\nwant shared and no outage", l.Mode(), logs)
	}

	// A ClusterClient follows the same reply itself.
	lc := NewLimiter(cl.Client(t), WithPolicy(FailOpen))
	if err := lc.Wait(ctx, name, PerSecond(10)); err != nil {
		t.Fatalf("Wait through a ClusterClient: %v", err)
	}
}
