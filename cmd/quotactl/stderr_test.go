package main

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"testing"

	"github.com/sharedquota/quota/internal/redistest"
)

// TestOneLineError: a refusal of Redis is the one line of quotactl's own
// on stderr: the package's log says nothing beside it.
func TestOneLineError(t *testing.T) {
	srv := redistest.Start(t)
	if err := srv.Client(t).ConfigSet(context.Background(), "requirepass", "pw").Err(); err != nil {
		t.Fatal(err)
	}
	var logged bytes.Buffer
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(&logged, nil)))
	code, _, errOut := quotaRun(nil, "-redis", "redis://:wrong@"+srv.Addr(), "status", "x")
	if code != 1 || strings.Count(errOut, "\n") != 1 || logged.Len() > 0 {
		t.Errorf("quotactl status with a wrong password: exit %d, stderr %q, and logged %q; want exit 1 and one line", code, errOut, logged.String())
	}
}
