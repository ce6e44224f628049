package chart

import (
	"image/color"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

// A Waits figure shows how long each request waited, one panel per phase
// stacked on a shared time axis.
type Waits struct {
	Title   string
	Seconds float64 // the length of a phase
	Top     float64 // the wait axis's top, seconds
	Panels  []WaitPanel
}

// A WaitPanel is one phase: a point per request, in series.
type WaitPanel struct {
	Title  string
	Series []Series
}

// A Series is one kind of request: when each was asked for (seconds since
// the phase started) and how long it waited (seconds).
type Series struct {
	Name    string
	T, Wait []float64
	Marked  bool // drawn larger and in red, above the others
}

// Colour of the unmarked points.
var plain = color.Gray{Y: 150}

// Write draws w and writes it to pngPath and svgPath.
func (w Waits) Write(pngPath, svgPath string) error {
	var plots [][]*plot.Plot
	for _, p := range w.Panels {
		pl := plot.New()
		pl.Title.Text = p.Title
		pl.Title.TextStyle.Font.Size = vg.Points(12)
		pl.X.Label.Text = "seconds into the phase"
		pl.Y.Label.Text = "wait for a token, s"
		pl.X.Min, pl.X.Max = 0, w.Seconds
		pl.Y.Min, pl.Y.Max = 0, w.Top
		pl.Add(plotter.NewGrid())
		pl.Legend.Top = true
		pl.Legend.TextStyle.Font.Size = vg.Points(9)
		for _, s := range p.Series {
			sc, err := plotter.NewScatter(xys(s.T, s.Wait))
			if err != nil {
				return err
			}
			sc.GlyphStyle = draw.GlyphStyle{Color: plain, Radius: vg.Points(1.5), Shape: draw.CircleGlyph{}}
			if s.Marked {
				sc.GlyphStyle = draw.GlyphStyle{Color: refused, Radius: vg.Points(4), Shape: draw.TriangleGlyph{}}
			}
			pl.Add(sc)
			pl.Legend.Add(s.Name, sc)
		}
		plots = append(plots, []*plot.Plot{pl})
	}
	return writeBoth(w.Title, plots, panelHeight*vg.Length(max(2, len(w.Panels))), pngPath, svgPath)
}
