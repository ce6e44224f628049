package control

import (
	"log/slog"
	"math"
	"strings"

	"github.com/sharedquota/quota/internal/store"
)

// Lowered returns lims, a bucket's layers, with the rates the fleet
// learned of the provider's real limit in place of theirs where lower,
// each at its Limit's time to fill (see internal/store's learn.lua);
// lims itself when the record tells of none.
func (st *State) Lowered(lims []store.Limit) []store.Limit {
	var out []store.Limit
	for i, r := range st.learned {
		if i < len(lims) && r > 0 && r < lims[i].Rate {
			if out == nil {
				out = append([]store.Limit(nil), lims...)
			}
			out[i] = store.Limit{Rate: r, Burst: max(1, lims[i].Burst*r/lims[i].Rate)}
		}
	}
	if out == nil {
		return lims
	}
	return out
}

// OnLearned has each read of a record that finds a layer's learned rate
// changed by more than a tenth since the Limiter last told of it (or the
// layer learning, or back at its Limit) logged at INFO on logger, and
// each read of a record that tells of learned rates, or of none after
// some, tell gauge each layer's (0: none).
func (c *Controls) OnLearned(logger *slog.Logger, gauge func(bucket, layer string, rate float64)) {
	c.logger, c.gauge = logger, gauge
}

// learned tells of the learned rates of e's layers, as a read found them.
func (c *Controls) learned(e *Entry, rates []float64) {
	if c.logger == nil {
		return
	}
	e.mu.Lock()
	told := e.told
	if c.gauge != nil && (rates != nil || told != nil) {
		for i := range max(len(rates), len(told)) {
			c.gauge(e.name, e.layerName(i), at(rates, i))
		}
	}
	changed := false
	for i := range max(len(rates), len(told)) {
		was, is := at(told, i), at(rates, i)
		if (was == 0) != (is == 0) || math.Abs(is-was) > 0.1*was {
			changed = true
			attrs := []any{"bucket", e.name, "layer", e.layerName(i)}
			switch {
			case is == 0:
				c.logger.Info("quota: the fleet's rate is back at its Limit", attrs...)
			default:
				c.logger.Info("quota: the fleet learned a rate below its Limit", append(attrs, "rate", is, "was", was)...)
			}
		}
	}
	if changed {
		e.told = append(e.told[:0], rates...)
	}
	e.mu.Unlock()
}

func at(v []float64, i int) float64 {
	if i < len(v) {
		return v[i]
	}
	return 0
}

// layerName names e's layer i in the logs: its meter or key suffix, ""
// for the first layer of an unmetered bucket.
func (e *Entry) layerName(i int) string {
	if i == 0 {
		return e.meter
	}
	if f := strings.Fields(e.layers); i-1 < len(f) {
		return f[i-1]
	}
	return ""
}
