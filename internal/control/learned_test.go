package control

import (
	"bytes"
	"log/slog"
	"slices"
	"strings"
	"testing"

	"github.com/sharedquota/quota/internal/store"
)

// The local shares of an outage take the rates the fleet learned, where
// lower than the Limits, at the Limits' times to fill.
func TestLowered(t *testing.T) {
	lims := []store.Limit{{Rate: 100, Burst: 300}, {Rate: 1000, Burst: 3000}}
	st := &State{learned: []float64{50, 0}}
	if got := st.Lowered(lims); !slices.Equal(got, []store.Limit{{Rate: 50, Burst: 150}, {Rate: 1000, Burst: 3000}}) || lims[0].Rate != 100 {
		t.Errorf("lowered to %v (the Limits now %v)", got, lims)
	}
	st.learned = []float64{200, 0}
	if got := st.Lowered(lims); &got[0] != &lims[0] {
		t.Errorf("a learned rate above the Limit lowered it to %v", got)
	}
}

// A change of a learned rate by more than a tenth is logged at INFO, once
// however many reads find it; a smaller one is not; and so is the layer's
// return to its Limit. The gauge is told of every read.
func TestLearnedLogged(t *testing.T) {
	var buf bytes.Buffer
	var gauged []float64
	c := &Controls{}
	c.OnLearned(slog.New(slog.NewTextHandler(&buf, nil)), func(bucket, layer string, rate float64) { gauged = append(gauged, rate) })
	e := &Entry{name: "api", meter: "requests"}
	for _, rates := range [][]float64{nil, {90}, {90}, {85}, {70}, nil, nil} {
		c.learned(e, rates)
	}
	logged := strings.Count(buf.String(), "learned a rate below its Limit")
	back := strings.Count(buf.String(), "back at its Limit")
	if logged != 2 || back != 1 || !strings.Contains(buf.String(), "rate=70 was=90") || !strings.Contains(buf.String(), "layer=requests") {
		t.Errorf("logged:\n%s", buf.String())
	}
	if !slices.Equal(gauged, []float64{90, 90, 85, 70, 0}) {
		t.Errorf("the gauge was told %v, want 90 90 85 70 0", gauged)
	}
}
