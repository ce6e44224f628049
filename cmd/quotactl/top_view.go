package main

import (
	"cmp"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/charmbracelet/lipgloss"
	"github.com/charmbracelet/x/ansi"

	"github.com/sharedquota/quota/status"
)

// listChrome is the lines of the list that are not its rows: the title,
// the columns' heads and the footer.
const listChrome = 3

// sparkWidth is the runes of a sparkline: a minute of rates, two seconds a
// rune.
const sparkWidth = 30

// sparks are a sparkline's levels, from none to the limit.
var sparks = []rune("▁▂▃▄▅▆▇█")

// topStyles are the looks of top's parts; a renderer on no terminal
// makes them plain.
type topStyles struct {
	title, head, selected, spark, hot, paused, faint, err lipgloss.Style
}

func newTopStyles(r *lipgloss.Renderer) topStyles {
	return topStyles{
		title:    r.NewStyle().Bold(true),
		head:     r.NewStyle().Bold(true).Reverse(true),
		selected: r.NewStyle().Reverse(true),
		spark:    r.NewStyle().Foreground(lipgloss.Color("2")),
		hot:      r.NewStyle().Foreground(lipgloss.Color("3")).Bold(true),
		paused:   r.NewStyle().Foreground(lipgloss.Color("1")).Bold(true),
		faint:    r.NewStyle().Faint(true),
		err:      r.NewStyle().Foreground(lipgloss.Color("1")),
	}
}

// cell is one column of a row: its text, the width it is padded or cut
// to (right-aligned when right), and its look.
type cell struct {
	text  string
	width int
	right bool
	style *lipgloss.Style
}

// listColumns are the list's columns, as its head reads them.
var listColumns = []cell{
	{text: "  BUCKET", width: 26}, {text: "GRANTS/S", width: 9, right: true}, {text: "LIMIT", width: 9, right: true},
	{text: "USE", width: 5, right: true}, {text: "LAST MINUTE", width: sparkWidth}, {text: "QUEUE", width: 7, right: true},
	{text: "PAUSE", width: 26}, {text: "SLOTS", width: 20},
}

func (m topModel) View() string {
	var lines []string
	if m.detail != "" {
		lines = m.detailView()
	} else {
		lines = m.listView()
	}
	if m.height > 0 && len(lines) > m.height {
		lines = lines[:m.height]
	}
	if m.width > 0 {
		for i, l := range lines {
			lines[i] = ansi.Truncate(l, m.width, "")
		}
	}
	return strings.Join(lines, "\n")
}

// header is the first line: what top shows, and when it was read.
func (m topModel) header(what string) string {
	var last time.Time
	for _, t := range m.buckets {
		if t.b.Now.After(last) {
			last = t.b.Now
		}
	}
	h := m.title + "   " + what
	if !last.IsZero() {
		h += "   " + last.Local().Format("15:04:05")
	}
	return m.styles.title.Render(h)
}

// footer is the last line: the keys, and what failed last.
func (m topModel) footer(keys string) string {
	f := m.styles.faint.Render(keys)
	var errs []string
	if m.scanErr != nil {
		errs = append(errs, "scan: "+oneLine(m.scanErr))
	}
	if m.readErr != nil {
		errs = append(errs, "read: "+oneLine(m.readErr))
	}
	if len(errs) > 0 {
		f += "   " + m.styles.err.Render(strings.Join(errs, "; "))
	}
	return f
}

func (m topModel) listView() []string {
	n := fmt.Sprintf("%d buckets", len(m.order))
	if len(m.order) == 1 {
		n = "1 bucket"
	}
	lines := []string{m.header(n), m.row(listColumns, &m.styles.head)}
	if len(m.order) == 0 {
		what := "looking for buckets..."
		if m.scanned {
			what = "no bucket: no key under the prefix (a bucket idle a few seconds has none)"
		}
		lines = append(lines, "  "+m.styles.faint.Render(what))
	}
	end := min(len(m.order), m.offset+m.rows())
	for _, name := range m.order[m.offset:end] {
		cells := m.bucketCells(name, m.buckets[name])
		if name == m.selected {
			cells[0].text = "> " + strings.TrimPrefix(cells[0].text, "  ")
			lines = append(lines, m.row(cells, &m.styles.selected))
		} else {
			lines = append(lines, m.row(cells, nil))
		}
	}
	return append(lines, m.footer("↑↓ select  enter: the bucket whole  q quit   * an override  ~ learned"))
}

// bucketCells are the list's row of the bucket.
func (m topModel) bucketCells(name string, t *tracked) []cell {
	c := make([]cell, len(listColumns))
	for i := range c {
		c[i] = cell{width: listColumns[i].width, right: listColumns[i].right, text: "-"}
	}
	c[0].text = "  " + quoteName(name)
	b := t.b
	if len(b.Layers) > 0 {
		l := b.Layers[0]
		r, ok := t.rate()
		c[1].text = fmtGrants(r, ok)
		c[2].text = fmtRate(l.Rate)
		if l.Override {
			c[2].text += "*"
		} else if l.Learned != nil {
			c[2].text += "~"
		}
		if ok {
			use := t.busy()
			c[3].text = strconv.Itoa(int(math.Round(use*100))) + "%"
			if use >= 0.9 {
				c[3].style = &m.styles.hot
			}
		}
		c[4].text, c[4].style = sparkline(l.Granted, l.Rate, sparkWidth), &m.styles.spark
		c[5].text = fmtDur(l.Queue)
	}
	c[6].text = pauseText(b)
	if b.Paused {
		c[6].style = &m.styles.paused
	}
	c[7].text = slotsText(b.Slots)
	if t.missing {
		c[6].text, c[6].style = "(not read: see below)", &m.styles.err
	}
	return c
}

// row lays out cells on one line, each in its look, or the whole line in
// style when it is not nil.
func (m topModel) row(cells []cell, style *lipgloss.Style) string {
	var plain, styled strings.Builder
	for i, c := range cells {
		if i > 0 {
			plain.WriteString(" ")
			styled.WriteString(" ")
		}
		t := fit(c.text, c.width, c.right)
		plain.WriteString(t)
		if c.style != nil {
			t = c.style.Render(t)
		}
		styled.WriteString(t)
	}
	if style != nil {
		return style.Render(plain.String())
	}
	return styled.String()
}

// fit pads s to width w, or cuts it with an ellipsis.
func fit(s string, w int, right bool) string {
	if ansi.StringWidth(s) > w {
		s = ansi.Truncate(s, w, "…")
	}
	pad := strings.Repeat(" ", w-ansi.StringWidth(s))
	if right {
		return pad + s
	}
	return s + pad
}

func (m topModel) detailView() []string {
	name := m.detail
	t := m.buckets[name]
	lines := []string{m.header("bucket " + quoteName(name))}
	keys := "esc: the list  q quit"
	if t == nil {
		return append(lines, "", "  "+m.styles.faint.Render("reading..."), "", m.footer(keys))
	}
	b := t.b
	kv := func(k, v string) { lines = append(lines, "  "+fit(k, 10, false)+v) }
	lines = append(lines, "")
	p := pauseText(b)
	if b.Paused {
		p = m.styles.paused.Render(p) + fmt.Sprintf(", since %s", b.PausedSince.Local().Format("15:04:05"))
	}
	kv("paused", p)
	if !b.ResumesAt.IsZero() {
		kv("resumes", fmt.Sprintf("in %s: the fleet leaves its local shares at %s", fmtDur(b.ResumesAt.Sub(b.Now)), b.ResumesAt.Local().Format("15:04:05")))
	}
	kv("slots", slotsText(b.Slots))
	kv("limiters", strconv.Itoa(len(b.Limiters))+" in the last five seconds")
	for _, id := range b.Limiters {
		lines = append(lines, "            "+id)
	}

	lines = append(lines, "")
	if len(b.Layers) == 0 {
		lines = append(lines, "  "+m.styles.faint.Render("no layers: no Limiter used the bucket lately, and it has no override"))
	} else {
		cols := []cell{{text: "  LAYER", width: 7}, {text: "METER", width: 10}, {text: "LIMIT", width: 30},
			{text: "TOKENS", width: 18, right: true}, {text: "QUEUE", width: 7, right: true},
			{text: "GRANTS/S", width: 9, right: true}, {text: "LAST MINUTE", width: sparkWidth}}
		lines = append(lines, m.row(cols, &m.styles.head))
		for i, l := range b.Layers {
			c := cloneCells(cols)
			c[0].text = "  " + strconv.Itoa(i+1)
			c[1].text = cmp.Or(l.Meter, "-")
			c[2].text = fmtRate(l.Rate) + ", burst " + fmtNum(l.Burst)
			if l.Override {
				c[2].text += " (override)"
			} else if l.Learned != nil {
				c[2].text += " (learned)"
			}
			c[3].text = fmtNum(round(l.Tokens, 1)) + " of " + fmtNum(l.Burst)
			c[4].text = fmtDur(l.Queue)
			c[5].text = fmtGrants(l.PerSecond(busyOver), true)
			c[6].text, c[6].style = sparkline(l.Granted, l.Rate, sparkWidth), &m.styles.spark
			lines = append(lines, m.row(c, nil))
		}
	}
	if len(b.Classes) > 0 {
		cols := []cell{{text: "  PRIORITY", width: 10}, {text: "QUEUE", width: 9, right: true}, {text: "PUSHED BACK", width: 12, right: true}}
		lines = append(lines, "", m.row(cols, &m.styles.head))
		for _, cl := range b.Classes {
			c := cloneCells(cols)
			c[0].text, c[1].text, c[2].text = "  "+strconv.Itoa(cl.Priority), fmtDur(cl.Queue), fmtDur(cl.Pushed)
			lines = append(lines, m.row(c, nil))
		}
	}
	if len(b.Tenants) > 0 {
		cols := []cell{{text: "  TENANT", width: 26}, {text: "WEIGHT", width: 7, right: true},
			{text: "WAITING", width: 8, right: true}, {text: "GRANTED", width: 12, right: true}}
		lines = append(lines, "", m.row(cols, &m.styles.head))
		for _, tn := range b.Tenants {
			c := cloneCells(cols)
			c[0].text, c[1].text, c[3].text = "  "+quoteName(tn.Name), fmtNum(tn.Weight), fmtNum(round(tn.Granted, 1))
			c[2].text = map[bool]string{true: "yes", false: "no"}[tn.Waiting]
			lines = append(lines, m.row(c, nil))
		}
	}
	return append(lines, "", m.footer(keys))
}

func cloneCells(c []cell) []cell {
	out := make([]cell, len(c))
	for i := range c {
		out[i] = cell{width: c[i].width, right: c[i].right}
	}
	return out
}

// sparkline draws rates, the latest last, on width runes, the latest at
// the right: each rune the mean of status.History/width rates, from ▁ for none
// to █ for top or more (top 0: the highest of the rates); a rune with no
// rate yet is blank.
func sparkline(rates []float64, top float64, width int) string {
	per := max(1, status.History/width)
	if top <= 0 {
		for _, r := range rates {
			top = max(top, r)
		}
	}
	out := []rune(strings.Repeat(" ", width))
	for i, end := width-1, len(rates); i >= 0 && end > 0; i, end = i-1, end-per {
		bin := rates[max(0, end-per):end]
		sum := 0.0
		for _, r := range bin {
			sum += r
		}
		level := 0
		if top > 0 {
			level = int(math.Round(sum / float64(len(bin)) / top * float64(len(sparks)-1)))
		}
		out[i] = sparks[max(0, min(level, len(sparks)-1))]
	}
	return string(out)
}

// fmtGrants writes a rate of grants, "-" when there is none yet.
func fmtGrants(r float64, ok bool) string {
	switch {
	case !ok:
		return "-"
	case r < 1000:
		return strconv.FormatFloat(r, 'f', 1, 64)
	}
	return strconv.FormatFloat(r, 'f', 0, 64)
}

// fmtDur writes a queue or a time left, short.
func fmtDur(d time.Duration) string {
	switch {
	case d <= 0:
		return "0"
	case d < time.Millisecond:
		return "<1ms"
	case d < time.Second:
		return strconv.Itoa(int(d/time.Millisecond)) + "ms"
	case d < time.Minute:
		return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + "s"
	}
	return d.Round(time.Second).String()
}

// pauseText tells who paused the bucket and for how long, or when its
// fleet resumes after an outage, or "-".
func pauseText(b status.Bucket) string {
	switch {
	case b.Paused && b.PausedUntil.IsZero():
		return "by " + b.PausedBy + ", until resumed"
	case b.Paused:
		return "by " + b.PausedBy + ", " + fmtDur(b.PausedUntil.Sub(b.Now)) + " left"
	case !b.ResumesAt.IsZero():
		return "resuming in " + fmtDur(b.ResumesAt.Sub(b.Now))
	}
	return "-"
}

// slotsText tells the slots held and waited for, or "-".
func slotsText(s status.Slots) string {
	if s.Held == 0 && s.Waiting == 0 {
		return "-"
	}
	if s.Lingering > 0 {
		return fmt.Sprintf("%d held (%d lingering), %d waiting", s.Held, s.Lingering, s.Waiting)
	}
	return fmt.Sprintf("%d held, %d waiting", s.Held, s.Waiting)
}
