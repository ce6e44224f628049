// Package chart draws what the provider received in each phase of a run,
// one panel per phase stacked on a shared time axis, with the agreed limit
// as a horizontal line, and writes the figure as PNG and SVG.
package chart

import (
	"fmt"
	"image/color"
	"io"
	"os"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// A Figure is the whole picture.
type Figure struct {
	Title   string
	Unit    string  // what the rates count, "requests" when empty
	Refused string  // the legend of the refused line, "of which refused (429)" when empty
	Limit   float64 // the agreed rate, a minute
	Allowed float64 // the most the limit lets through in any 1 s (rate + burst), per minute
	Seconds float64 // the length of a phase
	Panels  []Panel
}

// A Panel is one phase.
type Panel struct {
	Title    string
	T        []float64 // seconds since the phase started
	Received []float64 // what was received in the second before T, per minute
	Refused  []float64 // of which answered 429, per minute
	Marks    []Mark    // moments to mark with a vertical line
}

// A Mark is an event within a phase, such as Redis being killed.
type Mark struct {
	At    float64 // seconds since the phase started
	Label string
}

// Colours of the lines.
var (
	received = color.RGBA{R: 31, G: 119, B: 180, A: 255}
	refused  = color.RGBA{R: 214, G: 39, B: 40, A: 255}
	limit    = color.Black
	allowed  = color.Gray{Y: 140}
	event    = color.RGBA{R: 148, G: 103, B: 189, A: 255}
)

// The figure's width, and its height per panel; three panels or fewer
// share the height of three.
const (
	width       = 10 * vg.Inch
	panelHeight = 3 * vg.Inch
)

// Write draws f and writes it to pngPath and svgPath.
func Write(f Figure, pngPath, svgPath string) error {
	plots, err := f.plots()
	if err != nil {
		return err
	}
	height := panelHeight * vg.Length(max(3, len(f.Panels)))
	return writeBoth(f.Title, plots, height, pngPath, svgPath)
}

// writeBoth lays the title and the plots out, one panel a row, and writes
// them to pngPath and svgPath.
func writeBoth(title string, plots [][]*plot.Plot, height vg.Length, pngPath, svgPath string) error {
	png := vgimg.NewWith(vgimg.UseWH(width, height), vgimg.UseDPI(110), vgimg.UseBackgroundColor(color.White))
	layout(draw.New(png), title, plots)
	if err := save(pngPath, vgimg.PngCanvas{Canvas: png}); err != nil {
		return err
	}
	svg := vgsvg.New(width, height)
	layout(draw.New(svg), title, plots)
	return save(svgPath, svg)
}

// layout lays a figure's title and panels out on c.
func layout(c draw.Canvas, figTitle string, plots [][]*plot.Plot) {
	title := text.Style{
		Color:   color.Black,
		Font:    font.From(plot.DefaultFont, vg.Points(15)),
		XAlign:  draw.XCenter,
		YAlign:  draw.YTop,
		Handler: plot.DefaultTextHandler,
	}
	c.FillText(title, vg.Point{X: (c.Min.X + c.Max.X) / 2, Y: c.Max.Y - vg.Points(8)}, figTitle)
	tiles := draw.Tiles{Rows: len(plots), Cols: 1, PadTop: vg.Points(36), PadBottom: vg.Points(6),
		PadLeft: vg.Points(6), PadRight: vg.Points(14), PadY: vg.Points(14)}
	canvases := plot.Align(plots, tiles, c)
	for i := range plots {
		plots[i][0].Draw(canvases[i][0])
	}
}

// plots makes one plot per panel, all with the same axes.
func (f Figure) plots() ([][]*plot.Plot, error) {
	top := f.Allowed
	for _, p := range f.Panels {
		for i, v := range p.Received {
			top = max(top, v, p.Refused[i])
		}
	}
	top *= 1.12
	unit := f.Unit
	if unit == "" {
		unit = "requests"
	}
	var out [][]*plot.Plot
	for i, p := range f.Panels {
		pl := plot.New()
		pl.Title.Text = p.Title
		pl.Title.TextStyle.Font.Size = vg.Points(12)
		pl.Title.Padding = vg.Points(4)
		pl.X.Min, pl.X.Max = 0, f.Seconds
		pl.Y.Min, pl.Y.Max = 0, top
		pl.Y.Label.Text = unit + "/min (x the limit)"
		pl.Y.Tick.Marker = limitTicks(f.Limit)
		if i == len(f.Panels)-1 {
			pl.X.Label.Text = "seconds since the phase started  (rate = " + unit + " received in the preceding 1 s, x60)"
		}
		pl.Add(plotter.NewGrid())
		pl.Legend.Top = true
		pl.Legend.Left = false
		pl.Legend.TextStyle.Font.Size = vg.Points(9)
		pl.Legend.XOffs = -vg.Points(4)
		if err := f.addLines(pl, p, top, i == 0); err != nil { // the first panel's legend serves all
			return nil, err
		}
		out = append(out, []*plot.Plot{pl})
	}
	return out, nil
}

// addLines adds a panel's series, the limit lines and its marks to pl, and
// the lines to its legend if legend is set.
func (f Figure) addLines(pl *plot.Plot, p Panel, top float64, legend bool) error {
	refusedLabel := f.Refused
	if refusedLabel == "" {
		refusedLabel = "of which refused (429)"
	}
	horizontal := func(y float64) plotter.XYs { return plotter.XYs{{X: 0, Y: y}, {X: f.Seconds, Y: y}} }
	lines := []struct {
		name  string
		xys   plotter.XYs
		color color.Color
		width vg.Length
		dash  []vg.Length
	}{
		{"received by the provider", xys(p.T, p.Received), received, 2.5, nil},
		{refusedLabel, xys(p.T, p.Refused), refused, 1.5, nil},
		{fmt.Sprintf("agreed limit (%.0f/min)", f.Limit), horizontal(f.Limit), limit, 1.5, []vg.Length{vg.Points(6), vg.Points(4)}},
		{fmt.Sprintf("most the limit allows in any 1 s (rate + burst, %.0f/min)", f.Allowed), horizontal(f.Allowed), allowed, 1.2, []vg.Length{vg.Points(2), vg.Points(3)}},
	} // the limit lines last, so that they show where the provider's rate meets them
	for _, l := range lines {
		line, err := plotter.NewLine(l.xys)
		if err != nil {
			return err
		}
		line.Color, line.Width, line.Dashes = l.color, l.width, l.dash
		pl.Add(line)
		if legend {
			pl.Legend.Add(l.name, line)
		}
	}
	for _, m := range p.Marks {
		line, err := plotter.NewLine(plotter.XYs{{X: m.At, Y: 0}, {X: m.At, Y: top}})
		if err != nil {
			return err
		}
		line.Color, line.Width, line.Dashes = event, 1.5, []vg.Length{vg.Points(4), vg.Points(2)}
		label, err := plotter.NewLabels(plotter.XYLabels{XYs: plotter.XYs{{X: m.At, Y: top * 0.96}}, Labels: []string{" " + m.Label}})
		if err != nil {
			return err
		}
		label.TextStyle[0].Color = event
		label.TextStyle[0].YAlign = draw.YTop
		pl.Add(line, label)
	}
	return nil
}

// limitTicks marks the vertical axis at multiples of the limit, labelled
// with the rate and the multiple.
func limitTicks(limit float64) plot.TickerFunc {
	return func(lo, hi float64) []plot.Tick {
		step := 1.0
		for hi/(step*limit) > 6 {
			step *= 2
		}
		ticks := []plot.Tick{{Value: 0, Label: "0"}, {Value: limit, Label: fmt.Sprintf("%.0f (1x)", limit)}}
		for k := step; k*limit <= hi; k += step {
			if k > 1 {
				ticks = append(ticks, plot.Tick{Value: k * limit, Label: fmt.Sprintf("%.0f (%gx)", k*limit, k)})
			}
		}
		return ticks
	}
}

func xys(x, y []float64) plotter.XYs {
	out := make(plotter.XYs, len(x))
	for i := range x {
		out[i] = plotter.XY{X: x[i], Y: y[i]}
	}
	return out
}

// save writes the canvas w to path.
func save(path string, w io.WriterTo) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := w.WriteTo(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
