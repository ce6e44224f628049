package usage

import (
	"math"
	"slices"
	"testing"
	"testing/synctest"
	"time"
)

func TestExtra(t *testing.T) {
	meters := []string{"requests", "input", "output"}
	reserved := []float64{1, 100, 50}
	used := map[string]float64{"input": 80, "output": 70, "requests": math.Inf(1)}
	if got := Extra(meters, reserved, used, nil); !slices.Equal(got, []float64{0, -20, 20}) {
		t.Errorf("Extra = %v, want 0 (not finite: kept), -20, 20", got)
	}
	if got := Extra(meters, reserved, used, []bool{false, true, false}); !slices.Equal(got, []float64{0, 0, 20}) {
		t.Errorf("Extra with input kept = %v, want 0, 0, 20", got)
	}
	if got := Extra(meters, reserved, nil, nil); !slices.Equal(got, []float64{0, 0, 0}) {
		t.Errorf("Extra of no usage = %v, want nothing", got)
	}
}

func TestLows(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		at := time.Now()
		time.Sleep(2 * time.Second)
		rate := func(i int) float64 { return float64(i + 1) }
		got := Lows([]float64{-1, 10, 1}, at, rate, []float64{0, 4, 10})
		// Meter 1 refilled 4 in 2s, less 4 taken; meter 2 refilled 6, less 10.
		if !slices.Equal(got, []float64{-1, 10, 0}) {
			t.Errorf("Lows = %v, want -1 (unsaid), 10, 0", got)
		}
		if Lows(nil, at, rate, nil) != nil {
			t.Error("Lows of nothing said is not nil")
		}
	})
}

func TestLower(t *testing.T) {
	meters := []string{"requests", "input", "output"}
	burst := func(i int) float64 { return 100 }
	got := Lower(map[string]float64{"input": 40, "output": 100, "other": 1}, meters, burst)
	if !slices.Equal(got, []float64{-1, 40, -1}) {
		t.Errorf("Lower = %v, want -1 (unsaid), 40, -1 (not below the burst)", got)
	}
	if got := Lower(map[string]float64{"output": 100, "input": math.NaN()}, meters, burst); got != nil {
		t.Errorf("Lower of nothing below a burst = %v, want nil", got)
	}
	if Lower(nil, meters, burst) != nil {
		t.Error("Lower of nothing said is not nil")
	}
}
