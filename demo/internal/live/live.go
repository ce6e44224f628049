// Package live shows the progress of a run while it happens: a bar per
// phase with the provider's current rate against the limit when the output
// is a terminal, and one plain line a second when it is not (a pipe, a file,
// CI's log).
package live

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"github.com/vbauerster/mpb/v8"
	"github.com/vbauerster/mpb/v8/decor"
	"golang.org/x/term"
)

// A Sample is what the provider sees at one moment of a phase, or at its
// end once it is over.
type Sample struct {
	PerMinute float64 // requests received in the last second, per minute
	Limit     float64 // the agreed rate, per minute
	Refused   int     // 429s answered so far in the phase
}

// String describes the sample, for example
// "provider 2400/min = 4.0x the limit (600/min), 429s: 57".
func (s Sample) String() string {
	return fmt.Sprintf("provider %4.0f/min = %.1fx the limit (%.0f/min), 429s: %d",
		s.PerMinute, s.PerMinute/s.Limit, s.Limit, s.Refused)
}

// A Display shows the phases of a run on w.
type Display struct {
	w    io.Writer
	bars *mpb.Progress // nil when w is not a terminal

	mu sync.Mutex // serialises plain writes to w
}

// New returns a Display writing to w, with live bars if w is a terminal.
func New(w io.Writer) *Display {
	d := &Display{w: w}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		d.bars = mpb.New(mpb.WithOutput(w), mpb.WithWidth(24), mpb.WithRefreshRate(100*time.Millisecond))
	}
	return d
}

// Write prints whole lines to the display, above the bars when there are
// any. It is safe for concurrent use.
func (d *Display) Write(b []byte) (int, error) {
	if d.bars != nil {
		if n, err := d.bars.Write(b); err == nil {
			return n, nil
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.w.Write(b)
}

// A Phase is the progress of one phase on the display.
type Phase struct {
	title  string
	start  time.Time
	total  time.Duration
	sample func() Sample
	d      *Display
	bar    *mpb.Bar
	stop   chan struct{}
	done   sync.WaitGroup
}

// Phase starts showing a phase titled title that runs from start for
// total; sample reports what the provider sees now.
func (d *Display) Phase(title string, start time.Time, total time.Duration, sample func() Sample) *Phase {
	p := &Phase{title: title, start: start, total: total, sample: sample, d: d, stop: make(chan struct{})}
	if d.bars != nil {
		p.bar = d.bars.AddBar(total.Milliseconds(),
			mpb.PrependDecorators(decor.Name(title, decor.WC{C: decor.DindentRight | decor.DextraSpace | decor.DSyncWidth})),
			mpb.AppendDecorators(
				decor.Any(func(decor.Statistics) string { return p.clock() }, decor.WC{C: decor.DextraSpace}),
				decor.Any(func(decor.Statistics) string { return "  " + p.sample().String() }),
			),
		)
		p.done.Go(p.tick)
	} else {
		p.done.Go(p.lines)
	}
	return p
}

// Done marks the phase finished and shows its final state.
func (p *Phase) Done() {
	close(p.stop)
	p.done.Wait()
	if p.bar != nil {
		p.bar.SetCurrent(p.total.Milliseconds())
		return
	}
	p.line()
}

// clock returns the elapsed time against the phase's length.
func (p *Phase) clock() string {
	el := min(max(time.Since(p.start), 0), p.total)
	return fmt.Sprintf("%4.1fs/%.0fs", el.Seconds(), p.total.Seconds())
}

// tick moves the bar with the clock until the phase is done.
func (p *Phase) tick() {
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-p.stop:
			return
		case <-t.C:
			el := min(max(time.Since(p.start), 0), p.total-time.Millisecond)
			p.bar.SetCurrent(el.Milliseconds())
		}
	}
}

// lines prints one line for every second of the phase but its last, which
// Done prints.
func (p *Phase) lines() {
	for at := time.Second; at < p.total; at += time.Second {
		t := time.NewTimer(time.Until(p.start.Add(at)))
		select {
		case <-p.stop:
			t.Stop()
			return
		case <-t.C:
			p.line()
		}
	}
}

func (p *Phase) line() {
	fmt.Fprintf(p.d, "%s  %s  %s\n", p.title, p.clock(), p.sample())
}

// Close waits for the bars to be drawn for the last time. Write then goes
// straight to the output.
func (d *Display) Close() {
	if d.bars != nil {
		d.bars.Wait()
	}
}
