package main

import (
	"cmp"
	"context"
	"slices"
	"strings"
	"time"

	tea "github.com/charmbracelet/bubbletea"

	"github.com/sharedquota/quota/status"
)

// busyOver is how many of the latest rates the order of the list reads:
// busiest first, by the share of its limit that a bucket granted over
// them, so that the order does not jump with each second's jitter.
const busyOver = 5

// topModel is top's state, which the program's loop alone changes
// (Update); reads run in tea.Cmds and come back as fetchedMsgs.
type topModel struct {
	ctx    context.Context
	src    topSource
	styles topStyles
	title  string

	buckets  map[string]*tracked
	names    []string  // the buckets found by the last scan
	scanned  bool      // a scan has found names
	lastScan time.Time // when the last scan started, on the local clock
	order    []string  // the list's order, busiest first
	selected string    // the bucket under the cursor
	offset   int       // the first row shown
	detail   string    // the bucket shown whole; "" for the list
	fixed    bool      // started on one bucket: quotactl top NAME
	fetching bool
	scanErr  error
	readErr  error

	width, height int
	now           func() time.Time // the local clock
}

// tracked is one bucket as top follows it: its last reading.
type tracked struct {
	b       status.Bucket
	missing bool // the last read failed: b is older
}

func newTopModel(ctx context.Context, src topSource, st topStyles) topModel {
	return topModel{ctx: ctx, src: src, styles: st, buckets: map[string]*tracked{}, now: time.Now}
}

type tickMsg struct{}

func tick() tea.Cmd { return tea.Tick(refresh, func(time.Time) tea.Msg { return tickMsg{} }) }

// Init ticks at once: each tick starts a fetch, unless one is under way,
// and the next tick.
func (m topModel) Init() tea.Cmd { return func() tea.Msg { return tickMsg{} } }

// startFetch returns the command that reads the buckets, scanning first
// when the list shows and the last scan is rescan old, or none while a
// read is under way.
func (m topModel) startFetch() (topModel, tea.Cmd) {
	if m.fetching {
		return m, nil
	}
	now := m.now()
	scan := m.detail == "" && (!m.scanned || now.Sub(m.lastScan) >= rescan)
	if scan {
		m.lastScan = now
	}
	m.fetching = true
	ctx, src, names, also := m.ctx, m.src, slices.Clone(m.names), m.detail
	return m, func() tea.Msg { return fetch(ctx, src, scan, names, also) }
}

func (m topModel) Update(msg tea.Msg) (tea.Model, tea.Cmd) {
	switch msg := msg.(type) {
	case tea.WindowSizeMsg:
		m.width, m.height = msg.Width, msg.Height
		m.scroll()
	case tickMsg:
		m, cmd := m.startFetch()
		return m, tea.Batch(cmd, tick())
	case fetchedMsg:
		m.fetching = false
		m.apply(msg)
	case tea.KeyMsg:
		return m.key(msg)
	}
	return m, nil
}

// key handles a key: q and Ctrl-C quit; in the list, the arrows move the
// cursor and enter shows its bucket; in a bucket's view, esc goes back.
func (m topModel) key(k tea.KeyMsg) (tea.Model, tea.Cmd) {
	switch k.String() {
	case "q", "Q", "ctrl+c":
		return m, tea.Quit
	}
	if m.detail != "" {
		switch k.String() {
		case "esc", "backspace", "left", "h":
			m.detail, m.fixed = "", false
			if !m.scanned {
				m.lastScan = time.Time{}
				return m.startFetch()
			}
		}
		return m, nil
	}
	i := slices.Index(m.order, m.selected)
	switch k.String() {
	case "up", "k":
		i--
	case "down", "j":
		i++
	case "pgup":
		i -= m.rows()
	case "pgdown", " ":
		i += m.rows()
	case "home", "g":
		i = 0
	case "end", "G":
		i = len(m.order) - 1
	case "enter", "right", "l":
		if m.selected != "" {
			m.detail = m.selected
		}
		return m, nil
	default:
		return m, nil
	}
	if len(m.order) > 0 {
		m.selected = m.order[max(0, min(i, len(m.order)-1))]
	}
	m.scroll()
	return m, nil
}

// apply takes in what a fetch read.
func (m *topModel) apply(msg fetchedMsg) {
	m.readErr = msg.readErr
	if msg.scanned {
		m.names, m.scanned, m.scanErr = msg.names, true, nil
		keep := map[string]bool{m.detail: true}
		for _, n := range msg.names {
			keep[n] = true
		}
		for n := range m.buckets {
			if !keep[n] {
				delete(m.buckets, n) // no key left: idle, or gone
			}
		}
	} else if msg.scanErr != nil {
		m.scanErr = msg.scanErr
	}
	for n, t := range m.buckets {
		_, read := msg.buckets[n]
		t.missing = !read
	}
	for n, b := range msg.buckets {
		t := m.buckets[n]
		if t == nil {
			t = &tracked{}
			m.buckets[n] = t
		}
		t.observe(b)
	}
	m.sort()
}

// observe takes in a new reading of the bucket, whose layers tell what
// they granted in each of the last seconds (status.Layer.Granted).
func (t *tracked) observe(b status.Bucket) { t.b = b }

// rate returns what the first layer granted a second over the last
// busyOver seconds, and whether the bucket has a first layer.
func (t *tracked) rate() (float64, bool) {
	if len(t.b.Layers) == 0 {
		return 0, false
	}
	return t.b.Layers[0].PerSecond(busyOver), true
}

// busy returns the share of its first layer's limit that the bucket
// granted over the last busyOver seconds.
func (t *tracked) busy() float64 {
	r, ok := t.rate()
	if !ok || t.b.Layers[0].Rate <= 0 {
		return 0
	}
	return r / t.b.Layers[0].Rate
}

// sort orders the list busiest first, then by name, and keeps the cursor
// on its bucket.
func (m *topModel) sort() {
	m.order = m.order[:0]
	for n := range m.buckets {
		if n == m.detail && m.scanned && !slices.Contains(m.names, n) {
			continue // shown whole, not found by the scan
		}
		m.order = append(m.order, n)
	}
	slices.SortFunc(m.order, func(a, b string) int {
		return cmp.Or(cmp.Compare(m.buckets[b].busy(), m.buckets[a].busy()), strings.Compare(a, b))
	})
	if len(m.order) > 0 && !slices.Contains(m.order, m.selected) {
		m.selected = m.order[0]
	}
	m.scroll()
}

// rows returns how many buckets the list shows at once.
func (m *topModel) rows() int {
	if m.height <= 0 {
		return max(1, len(m.order))
	}
	return max(1, m.height-listChrome)
}

// scroll keeps the cursor's row on the screen.
func (m *topModel) scroll() {
	i := max(0, slices.Index(m.order, m.selected))
	n := m.rows()
	m.offset = min(m.offset, i)
	if i >= m.offset+n {
		m.offset = i - n + 1
	}
	m.offset = max(0, min(m.offset, len(m.order)-n))
}
