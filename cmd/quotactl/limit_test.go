package main

import (
	"context"
	"strings"
	"testing"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// TestLimitNotesALowerDefaultBurst: "limit NAME RATE" sets the default
// burst, as a Limit's zero Burst holds everywhere; on a bucket that held
// a burst above its own default (a metered bucket's minute of requests),
// quotactl says so on stderr with the command that keeps as many seconds
// of the new rate. A BURST given, or a bucket that held its default, is
// no note.
func TestLimitNotesALowerDefaultBurst(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	l := quota.NewLimiter(srv.Client(t))
	const name = "api.anthropic.com"
	if err := l.Wait(ctx, name, quota.Limit{Rate: 100.0 / 60, Burst: 100}); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := quotaRun(nil, "-redis", srv.Addr(), "limit", name, "100/min")
	if code != 0 || !strings.Contains(out, "limited to 100/m, burst 5,") {
		t.Fatalf("quotactl limit %s 100/min: exit %d, stdout %q, stderr %q", name, code, out, errOut)
	}
	want := "quotactl: note: BURST left out is the default burst, three seconds of RATE: 5, where the bucket held 100, 60s of its rate; " +
		"to hold 60s of RATE: quotactl limit api.anthropic.com 100/min 100\n"
	if errOut != want {
		t.Errorf("quotactl limit %s 100/min: stderr %q, want %q", name, errOut, want)
	}
	if got, err := l.Status(ctx, name); err != nil || got.Override == nil || *got.Override != (quota.Limit{Rate: 100.0 / 60, Burst: 5}) {
		t.Errorf("Status after quotactl limit 100/min: %+v, %v", got, err)
	}
	for _, args := range [][]string{{"100/min"}, {"50/min", "50"}, {"100/min", "100"}} { // no burst above its default lowered
		mustRun(t, nil, append([]string{"-redis", srv.Addr(), "limit", name}, args...)...)
	}
	// A minute of 100/min, lowered to the default of 30/min: the note keeps
	// the minute, at the new rate.
	if code, _, errOut := quotaRun(nil, "-redis", srv.Addr(), "limit", name, "30/min"); code != 0 ||
		!strings.HasSuffix(errOut, "where the bucket held 100, 60s of its rate; to hold 60s of RATE: quotactl limit api.anthropic.com 30/min 30\n") {
		t.Errorf("quotactl limit %s 30/min: exit %d, stderr %q", name, code, errOut)
	}
}
