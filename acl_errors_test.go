package quota

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"
)

// TestPermissionFailures: a wrong password and a command the ACL refuses
// inside a script are ErrNoPermission, permanent, not an outage: the
// Limiter stays in shared mode whatever its policy, and logs the failure
// once, however many calls meet it.
func TestPermissionFailures(t *testing.T) {
	t.Parallel()
	a := newACLServer(t)
	ctx := context.Background()
	for _, tc := range []struct {
		name, user, rule, pass string
	}{
		{"a wrong password", "wrongpass", aclLimiter, "not-the-secret"},
		{"a command refused inside the script", "nohset", withoutRule("+hset"), "limiter-secret"},
	} {
		rdb := a.user(tc.user, tc.rule, tc.pass)
		logs := &logRecorder{}
		l := NewLimiter(rdb, WithPolicy(FailOpen), WithLogger(slogOf(logs)))
		for range 3 {
			err := l.Wait(ctx, "denied", PerSecond(100))
			if !errors.Is(err, ErrNoPermission) || errors.Is(err, ErrScript) || errors.Is(err, ErrUnavailable) || !Permanent(err) {
				t.Errorf("%s: Wait = %v, want ErrNoPermission alone", tc.name, err)
			}
		}
		time.Sleep(50 * time.Millisecond) // what runs in the background after a call
		if l.Mode() != ModeShared {
			t.Errorf("%s switched the Limiter to %v", tc.name, l.Mode())
		}
		if n := logs.Count(slog.LevelError, "permission"); n != 1 || logs.Len() != 1 {
			t.Errorf("%s: %d records of the missing permission, want 1 alone:\n%s", tc.name, n, logs)
		}
	}
}
