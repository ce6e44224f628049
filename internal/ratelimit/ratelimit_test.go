package ratelimit

import (
	"maps"
	"testing"
)

func TestParams(t *testing.T) {
	for _, c := range []struct {
		item string
		want map[string]float64
	}{
		{`"default";r=50;t=30`, map[string]float64{"r": 50, "t": 30}},
		{` "output_tokens" ; Q="8000" ; w = 60 `, map[string]float64{"q": 8000, "w": 60}},
		{`limit=100;remaining=x;reset`, map[string]float64{"limit": 100}},
		{``, map[string]float64{}},
	} {
		if got := Params(c.item); !maps.Equal(got, c.want) {
			t.Errorf("Params(%q) = %v, want %v", c.item, got, c.want)
		}
	}
}

func TestDefaultBurst(t *testing.T) {
	for _, c := range []struct{ rate, want float64 }{
		{5, 15},
		{1.0 / 60, 1}, // a token a minute: at least 1
	} {
		if got := DefaultBurst(c.rate); got != c.want {
			t.Errorf("DefaultBurst(%v) = %v, want %v", c.rate, got, c.want)
		}
	}
}
