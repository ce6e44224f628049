package quota

import (
	"context"
	"errors"
	"log/slog"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/store"
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

// TestRefusedAnnouncements: for a user that may not publish on the
// package's channel, a call whose announcement is known before it writes
// (the operator's pause, resume and limits) fails and changes nothing;
// one whose announcement is known only once written (a provider's pause,
// a take that pushes lower classes back, a settle that gives tokens back)
// is applied and succeeds, unannounced.
func TestRefusedAnnouncements(t *testing.T) {
	t.Parallel()
	a := newACLServer(t)
	rdb := a.user("nochannel", withoutRule("&quota:*"), "limiter-secret")
	ctx := context.Background()
	l := NewLimiter(rdb, WithPolicy(FailClosed), WithLogger(slogOf(&logRecorder{})))
	lim := Limit{Rate: 10, Burst: 1}
	if err := l.Wait(ctx, "ops", lim); err != nil {
		t.Fatal(err)
	}
	for what, op := range map[string]func() error{
		"Pause":    func() error { return l.Pause(ctx, "ops", 3*time.Second) },
		"SetLimit": func() error { return l.SetLimit(ctx, "ops", PerSecond(1)) },
	} {
		if err := op(); !errors.Is(err, ErrNoPermission) {
			t.Errorf("%s without the channel: %v, want ErrNoPermission", what, err)
		}
	}
	if st, err := l.Status(ctx, "ops"); err != nil || st.Paused || st.Override != nil {
		t.Errorf("Status after a Pause and a SetLimit that failed: %+v, %v; want neither in force", st, err)
	}

	b, err := l.bucket("provider", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.store.Pause(ctx, b.Bucket, time.Second); err != nil {
		t.Errorf("a provider's pause without the channel: %v", err)
	}
	if st, err := l.Status(ctx, "provider"); err != nil || !st.Paused || st.PausedBy != PausedByProvider {
		t.Errorf("Status after a provider's pause: %+v, %v; want it paused", st, err)
	}

	b, err = l.bucket("pushed", []Limit{lim})
	if err != nil {
		t.Fatal(err)
	}
	for range 4 { // class 0's grants, due up to 300 ms from now
		if _, err := l.store.Take(ctx, b.Bucket, store.Tokens(1), time.Second); err != nil {
			t.Fatal(err)
		}
	}
	g, err := l.store.Take(ctx, b.Bucket, store.Cost{N: 1, Class: 3}, time.Second)
	if err != nil || !g.Granted() {
		t.Errorf("a take of class 3 ahead of class 0's grants, without the channel: %+v, %v", g, err)
	}
	if err := l.store.Adjust(ctx, b.Bucket, store.Tokens(-2), ""); err != nil {
		t.Errorf("a give-back without the channel: %v", err)
	}
}
