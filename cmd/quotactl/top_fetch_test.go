package main

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	tea "github.com/charmbracelet/bubbletea"

	"github.com/sharedquota/quota/status"
)

// TestTopFetch: a fetch scans when asked, reads every bucket found and the
// one shown whole, and keeps what it read of the others when one read
// fails; a failed scan keeps the names known.
func TestTopFetch(t *testing.T) {
	var mu sync.Mutex
	var read []string
	src := topSource{
		names: func(context.Context) ([]string, error) { return []string{"a", "b", "c"}, nil },
		read: func(_ context.Context, name string) (status.Bucket, error) {
			mu.Lock()
			read = append(read, name)
			mu.Unlock()
			if name == "b" {
				return status.Bucket{}, errors.New("b: refused")
			}
			return reading(name, t0, 1, 0), nil
		},
	}
	msg := fetch(context.Background(), src, true, nil, "d")
	slices.Sort(read)
	if !msg.scanned || !slices.Equal(msg.names, []string{"a", "b", "c"}) || !slices.Equal(read, []string{"a", "b", "c", "d"}) ||
		len(msg.buckets) != 3 || msg.readErr == nil || msg.buckets["d"].Name != "d" {
		t.Errorf("fetch: %+v, read %v; want a, b, c found, each and d read, b's error", msg, read)
	}
	m := plainModel(src)
	next, _ := m.Update(msg)
	if v := next.(topModel).View(); !strings.Contains(v, "read: b: refused") || rowOf(v, "a") == "" || rowOf(v, "c") == "" {
		t.Errorf("after a failed read:\n%s\nwant the error, and the buckets read listed", v)
	}
	read = nil
	src.names = func(context.Context) ([]string, error) { return nil, errors.New("NOPERM scan") }
	msg = fetch(context.Background(), src, true, []string{"a"}, "")
	if msg.scanned || msg.scanErr == nil || !slices.Equal(read, []string{"a"}) {
		t.Errorf("a failed scan: %+v, read %v; want the names known read, and the error", msg, read)
	}
	m = feed(t, plainModel(src), reading("a", t0, 1, 0))
	next, _ = m.Update(msg)
	if v := next.(topModel).View(); !strings.Contains(v, "scan: NOPERM scan") || rowOf(v, "a") == "" {
		t.Errorf("after a failed scan:\n%s\nwant the error and the bucket still listed", v)
	}
}

// TestTopScansWhileListing: the first tick scans; later ticks read the
// buckets known, and scan again once rescan has passed; the bucket's own
// view does not scan.
func TestTopScansWhileListing(t *testing.T) {
	scans := 0
	src := topSource{
		names: func(context.Context) ([]string, error) { scans++; return []string{"a"}, nil },
		read:  func(_ context.Context, name string) (status.Bucket, error) { return reading(name, t0, 1, 0), nil },
	}
	m := plainModel(src)
	now := t0
	m.now = func() time.Time { return now }
	run := func() {
		t.Helper()
		next, cmd := m.Update(tickMsg{})
		m = next.(topModel)
		for _, msg := range batch(cmd) {
			if f, ok := msg.(fetchedMsg); ok {
				next, _ = m.Update(f)
				m = next.(topModel)
			}
		}
	}
	run()
	now = now.Add(time.Second)
	run()
	if scans != 1 {
		t.Errorf("%d scans in two ticks a second apart; want 1", scans)
	}
	now = now.Add(rescan)
	run()
	if scans != 2 {
		t.Errorf("%d scans after rescan; want 2", scans)
	}
	m.detail = "a"
	now = now.Add(rescan)
	run()
	if scans != 2 {
		t.Errorf("%d scans showing a bucket; want still 2", scans)
	}
}

// batch runs the commands of cmd, a tea.Batch or one, but its ticks.
func batch(cmd tea.Cmd) []tea.Msg {
	if cmd == nil {
		return nil
	}
	done := make(chan tea.Msg, 1)
	go func() { done <- cmd() }()
	select {
	case msg := <-done:
		if b, ok := msg.(tea.BatchMsg); ok {
			var out []tea.Msg
			for _, c := range b {
				out = append(out, batch(c)...)
			}
			return out
		}
		return []tea.Msg{msg}
	case <-time.After(100 * time.Millisecond):
		return nil // a tick
	}
}
