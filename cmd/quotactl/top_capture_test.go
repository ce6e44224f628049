package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// TestTopCapture writes what top shows of a fleet of three buckets, one
// of them paused and one holding its slots, to the directory that
// QUOTA_TOP_CAPTURE names: the list in top.txt, the busiest bucket whole
// in top-bucket.txt. It runs only when asked (it makes docs/top*.txt):
//
//	QUOTA_TOP_CAPTURE=$PWD/docs go test -run TestTopCapture ./cmd/quotactl
func TestTopCapture(t *testing.T) {
	dir := os.Getenv("QUOTA_TOP_CAPTURE")
	if dir == "" {
		t.Skip("QUOTA_TOP_CAPTURE names no directory")
	}
	tmux := needTmux(t)
	srv := redistest.Start(t)
	bin := buildQuotactl(t)
	f := startFleet(t, srv.Client(t))
	f.take("api.example.com", 4, quota.Limit{Rate: 50, Burst: 5}, 0, 0)
	f.take("geocoder", 3, quota.PerMinute(300), 2, 300*time.Millisecond)
	f.take("smtp-relay", 1, quota.Limit{Rate: 2, Burst: 1}, 0, 0)
	p := startPane(t, tmux, bin, "-redis", srv.Addr(), "top")
	time.Sleep(40 * time.Second) // a sparkline of most of a minute
	if err := f.l.Pause(context.Background(), "smtp-relay", 10*time.Minute); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	list := p.screen(false)
	p.keys("Enter") // the busiest bucket, whole
	time.Sleep(2 * time.Second)
	for name, s := range map[string]string{"top.txt": list, "top-bucket.txt": p.screen(false)} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(strings.TrimRight(s, "\n")+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	p.keys("q")
	if code := p.exited(2 * time.Second); code != 0 {
		t.Errorf("exit %d", code)
	}
}
