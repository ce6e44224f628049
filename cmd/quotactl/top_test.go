package main

import (
	"context"
	"io"
	"slices"
	"strings"
	"testing"
	"time"

	tea "github.com/charmbracelet/bubbletea"
	"github.com/charmbracelet/lipgloss"

	"github.com/sharedquota/quota/status"
)

var t0 = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

// reading is a bucket of one layer of rate a second, read at, which
// granted grants in its last seconds, the latest last.
func reading(name string, at time.Time, rate float64, grants ...float64) status.Bucket {
	return status.Bucket{Name: name, Now: at, Layers: []status.Layer{{Rate: rate, Burst: 3 * rate, Tokens: rate, Granted: history(grants...)}}}
}

// history is a layer's Granted that ends with grants.
func history(grants ...float64) []float64 {
	return append(make([]float64, status.History-len(grants)), grants...)
}

// plainModel is a model whose view has no colors, on a screen of 160 by
// 40, with src as its source (nil: one that reads nothing).
func plainModel(src topSource) topModel {
	if src.names == nil {
		src.names = func(context.Context) ([]string, error) { return nil, nil }
		src.read = func(context.Context, string) (status.Bucket, error) { return status.Bucket{}, nil }
	}
	m := newTopModel(context.Background(), src, newTopStyles(lipgloss.NewRenderer(io.Discard)))
	m.title = "quotactl top"
	m.width, m.height = 160, 40
	return m
}

// feed gives the model what one fetch would have read: buckets, found by
// a scan.
func feed(t *testing.T, m topModel, buckets ...status.Bucket) topModel {
	t.Helper()
	msg := fetchedMsg{scanned: true, buckets: map[string]status.Bucket{}}
	for _, b := range buckets {
		msg.names = append(msg.names, b.Name)
		msg.buckets[b.Name] = b
	}
	slices.Sort(msg.names)
	next, _ := m.Update(msg)
	return next.(topModel)
}

// press gives the model a key, as tea reads it.
func press(m topModel, key string) (topModel, tea.Cmd) {
	var k tea.KeyMsg
	switch key {
	case "enter":
		k = tea.KeyMsg{Type: tea.KeyEnter}
	case "esc":
		k = tea.KeyMsg{Type: tea.KeyEsc}
	case "down":
		k = tea.KeyMsg{Type: tea.KeyDown}
	case "up":
		k = tea.KeyMsg{Type: tea.KeyUp}
	case "ctrl+c":
		k = tea.KeyMsg{Type: tea.KeyCtrlC}
	default:
		k = tea.KeyMsg{Type: tea.KeyRunes, Runes: []rune(key)}
	}
	next, cmd := m.Update(k)
	return next.(topModel), cmd
}

// rowOf returns the list's line of the bucket called name on the screen.
func rowOf(screen, name string) string {
	for _, l := range strings.Split(screen, "\n") {
		if f := strings.Fields(strings.TrimPrefix(l, ">")); len(f) > 0 && f[0] == name {
			return l
		}
	}
	return ""
}

// rowFields returns the words of the list's line of the bucket called
// name, the cursor's mark left out.
func rowFields(screen, name string) []string {
	return strings.Fields(strings.TrimPrefix(rowOf(screen, name), ">"))
}

// listed returns the buckets of the list on the screen, in its order.
func listedOn(screen string) []string {
	var names []string
	for _, l := range strings.Split(screen, "\n")[2:] {
		if f := strings.Fields(strings.TrimPrefix(l, ">")); len(f) > 1 && f[0] != "↑↓" {
			names = append(names, f[0])
		}
	}
	return names
}

// TestTopRate: a bucket's rate is what it granted a second over the
// last five seconds its layer tells, against its limit.
func TestTopRate(t *testing.T) {
	m := feed(t, plainModel(topSource{}), reading("api", t0, 50, 90, 45, 45, 45, 45, 45))
	f := rowFields(m.View(), "api")
	if len(f) < 4 || f[1] != "45.0" || f[2] != "50/s" || f[3] != "90%" {
		t.Errorf("after 45 grants a second the row reads %q; want 45.0 of 50/s, 90%%", f)
	}
}

// TestTopBusiestFirst: the list is ordered by the share of its limit a
// bucket granted lately, the cursor stays on its bucket as the order
// changes, and ties go by name.
func TestTopBusiestFirst(t *testing.T) {
	m := plainModel(topSource{})
	at := t0
	step := func(a, b, c, d float64) { // a second each, for five seconds
		at = at.Add(time.Second)
		five := func(v float64) []float64 { return []float64{v, v, v, v, v} }
		m = feed(t, m, reading("idle", at, 10, five(d)...), reading("half", at, 100, five(a)...),
			reading("full", at, 2, five(b)...), reading("tenth", at, 1000, five(c)...))
	}
	step(50, 2, 100, 0) // 50%, 100%, 10%, 0%
	if got, want := listedOn(m.View()), []string{"full", "half", "tenth", "idle"}; !slices.Equal(got, want) {
		t.Fatalf("order %v; want %v, busiest (by share of the limit) first", got, want)
	}
	if m.selected != "full" {
		t.Errorf("cursor on %q; want the first bucket", m.selected)
	}
	m, _ = press(m, "down")
	m, _ = press(m, "down")
	if m.selected != "tenth" {
		t.Fatalf("two downs: cursor on %q; want tenth", m.selected)
	}
	// tenth becomes the busiest: the cursor goes with it.
	step(50, 2, 1100, 0)
	if got := listedOn(m.View())[0]; got != "tenth" || m.selected != "tenth" {
		t.Errorf("first %q, cursor on %q; want tenth both", got, m.selected)
	}
	if row := rowOf(m.View(), "tenth"); !strings.HasPrefix(row, "> ") {
		t.Errorf("tenth's row %q; want the cursor on it", row)
	}
}

func TestSparkline(t *testing.T) {
	blank := func(n int) string { return strings.Repeat(" ", n) }
	for _, tc := range []struct {
		rates []float64
		top   float64
		want  string
	}{
		{nil, 50, blank(30)},
		{[]float64{50}, 50, blank(29) + "█"},
		{[]float64{0, 0}, 50, blank(29) + "▁"},
		{[]float64{50, 50, 25, 25, 0, 0}, 50, blank(27) + "█▅▁"}, // 25 of 50: level 3.5, rounded to 4
		{[]float64{100, 100}, 50, blank(29) + "█"},               // above the limit: full
		{[]float64{0, 50, 50, 50}, 50, blank(28) + "▅█"},         // two rates a rune, the latest at the right
		{[]float64{1, 1, 2, 2}, 0, blank(28) + "▅█"},             // no limit: the highest rate is the top
		{slices.Repeat([]float64{7}, 90), 7, strings.Repeat("█", 30)},
	} {
		if got := sparkline(tc.rates, tc.top, 30); got != tc.want {
			t.Errorf("sparkline(%v, %v) = %q; want %q", tc.rates, tc.top, got, tc.want)
		}
	}
	// The list shows the first layer's rates against its limit.
	m := feed(t, plainModel(topSource{}), reading("api", t0, 50, 50, 50, 25, 25))
	if row := rowOf(m.View(), "api"); !strings.Contains(row, "▁█▅ ") {
		t.Errorf("row %q; want the sparkline █▅ for 50, 50, 25, 25 grants a second of 50", row)
	}
}

// TestTopPauseShown: a pause shows who set it and the time left, or that
// it lasts until resumed; the bucket's own view says since when.
func TestTopPauseShown(t *testing.T) {
	paused := reading("api", t0, 50, 0)
	paused.Paused, paused.PausedBy, paused.PausedSince, paused.PausedUntil = true, "operator", t0.Add(-time.Second), t0.Add(59*time.Second)
	forever := reading("geo", t0, 5, 0)
	forever.Paused, forever.PausedBy, forever.PausedSince = true, "provider", t0.Add(-time.Minute)
	resuming := reading("smtp", t0, 1, 0)
	resuming.ResumesAt = t0.Add(1500 * time.Millisecond)
	m := feed(t, plainModel(topSource{}), paused, forever, resuming, reading("free", t0, 1, 0))
	screen := m.View()
	for name, want := range map[string]string{
		"api":  "by operator, 59.0s left",
		"geo":  "by provider, until resumed",
		"smtp": "resuming in 1.5s",
	} {
		if row := rowOf(screen, name); !strings.Contains(row, want) {
			t.Errorf("row %q; want %q in it", row, want)
		}
	}
	if row := rowOf(screen, "free"); strings.Contains(row, "by ") || strings.Contains(row, "resum") {
		t.Errorf("row %q; want no pause", row)
	}
	m.detail = "api"
	if v := m.View(); !strings.Contains(v, "by operator, 59.0s left, since "+t0.Add(-time.Second).Local().Format("15:04:05")) {
		t.Errorf("the bucket's view:\n%s\nwant its pause, since when", v)
	}
}

// TestTopKeys: q and Ctrl-C quit, enter shows the bucket under the
// cursor whole, esc goes back.
func TestTopKeys(t *testing.T) {
	for _, key := range []string{"q", "ctrl+c"} {
		m := plainModel(topSource{})
		_, cmd := press(m, key)
		if cmd == nil {
			t.Fatalf("%s: no command; want tea.Quit", key)
		}
		if _, ok := cmd().(tea.QuitMsg); !ok {
			t.Errorf("%s: the command gives %T; want tea.QuitMsg", key, cmd())
		}
	}
	m := feed(t, plainModel(topSource{}), reading("a", t0, 1, 0), reading("b", t0, 1, 0))
	if _, cmd := press(m, "x"); cmd != nil {
		t.Errorf("x: a command; want none")
	}
	m, _ = press(m, "down")
	m, _ = press(m, "enter")
	if m.detail != "b" || !strings.Contains(m.View(), "bucket b") || !strings.Contains(m.View(), "LAYER") {
		t.Fatalf("enter on b: detail %q, view\n%s", m.detail, m.View())
	}
	m, _ = press(m, "down") // nothing to move in a bucket's view
	m, _ = press(m, "esc")
	if m.detail != "" || m.selected != "b" || rowOf(m.View(), "b") == "" {
		t.Errorf("esc: detail %q, cursor on %q; want the list, the cursor on b", m.detail, m.selected)
	}
	m, _ = press(m, "up")
	m, _ = press(m, "up") // stays on the first
	if m.selected != "a" {
		t.Errorf("cursor on %q; want a", m.selected)
	}
}

// TestTopDetail: a bucket's view shows its layers, classes, tenants,
// slots and Limiters.
func TestTopDetail(t *testing.T) {
	b := status.Bucket{
		Name: "llm",
		Now:  t0,
		Layers: []status.Layer{
			{Meter: "requests", Rate: 5, Burst: 15, Override: true, Tokens: 3.25, Queue: 1200 * time.Millisecond, Granted: history(4, 4, 4, 4, 4)},
			{Meter: "tokens", Rate: 1000, Burst: 30000, Tokens: 29000, Granted: history(2000, 2000, 2000, 2000, 2000),
				Learned: &status.Learned{Floor: 100, Ceiling: 2000}},
		},
		Classes:  []status.Class{{Priority: 2, Queue: 300 * time.Millisecond, Pushed: 2 * time.Second}},
		Tenants:  []status.Tenant{{Name: "alice", Weight: 2, Waiting: true, Granted: 42}},
		Slots:    status.Slots{Held: 3, Waiting: 1},
		Limiters: []string{"worker-1", "worker-2"},
	}
	m := plainModel(topSource{})
	m.detail = "llm"
	m = feed(t, m, b)
	v := m.View()
	for _, want := range []string{
		"bucket llm", "3 held, 1 waiting", "2 in the last five seconds", "worker-1", "worker-2",
		"requests", "5/s, burst 15 (override)", "3.3 of 15", "1.2s", "4.0",
		"tokens", "1000/s, burst 30000 (learned)", "29000 of 30000", "2000 ",
		"PRIORITY", "300ms", "2.0s",
		"alice", "yes", "42",
	} {
		if !strings.Contains(v, want) {
			t.Errorf("the bucket's view lacks %q:\n%s", want, v)
		}
	}
	m = feed(t, plainModel(topSource{}), status.Bucket{Name: "new", Now: t0})
	m.detail = "new"
	if v := m.View(); !strings.Contains(v, "no layers") {
		t.Errorf("a bucket with no layers:\n%s", v)
	}
}

// A bucket's limit is marked * for an override, ~ for a rate the fleet
// learned below its Limit (WithAdaptive).
func TestTopMarksTheLimit(t *testing.T) {
	learned, override := reading("geo", t0, 45, 0), reading("api", t0, 20, 0)
	learned.Layers[0].Learned = &status.Learned{Floor: 2.5, Ceiling: 50}
	override.Layers[0].Override = true
	screen := feed(t, plainModel(topSource{}), learned, override, reading("free", t0, 5, 0)).View()
	for name, want := range map[string]string{"geo": "45/s~", "api": "20/s*"} {
		if row := rowOf(screen, name); !strings.Contains(row, want) {
			t.Errorf("row %q; want %q in it", row, want)
		}
	}
	if row := rowOf(screen, "free"); strings.Contains(row, "5/s~") || strings.Contains(row, "5/s*") {
		t.Errorf("row %q; want its limit unmarked", row)
	}
}
