package usage

import (
	"crypto/rand"
	"encoding/hex"
	"math"
	"time"
)

// Bound returns the most a settle may take of a layer refilled at rate
// beyond what its request took: what the layer refills in the longest
// pause a provider may put on it, maxPause (quota.WithMaxPause). A
// response that reports more, broken or hostile, puts no more debt on the
// fleet than a Retry-After could; the rest is counted in quota.settle.cut.
func Bound(rate float64, maxPause time.Duration) float64 { return rate * maxPause.Seconds() }

// SettleID returns an id that makes a settle count once, however often
// the client sends it.
func SettleID() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Extra returns what a settle with used takes of each meter, named in
// meters, beyond what the request reserved of it, or, below zero, gives
// back: a meter used leaves out, or gives no finite number of zero or
// more, keeps its reservation, and neither does a meter kept (kept[i],
// when kept is not nil) give anything back, as its provider does not.
func Extra(meters []string, reserved []float64, used map[string]float64, kept []bool) []float64 {
	extra := make([]float64, len(reserved))
	for i, m := range meters {
		if n, ok := used[m]; ok && n >= 0 && !math.IsInf(n, 0) {
			extra[i] = n - reserved[i]
			if extra[i] < 0 && kept != nil && kept[i] {
				extra[i] = 0
			}
		}
	}
	return extra
}

// Lower returns what left, what a provider says remains of its meters by
// name, says of each of meters, below zero for a meter it says nothing
// of; nil when it says nothing that is below a meter's burst(i).
func Lower(left map[string]float64, meters []string, burst func(i int) float64) []float64 {
	if len(left) == 0 {
		return nil
	}
	each := make([]float64, len(meters))
	some := false
	for i, name := range meters {
		each[i] = -1
		if n, ok := left[name]; ok && n >= 0 && !math.IsInf(n, 0) && n < burst(i) {
			each[i], some = n, true
		}
	}
	if !some {
		return nil
	}
	return each
}

// Lows returns what a provider's meters hold now, lows being what it
// said of them at at (below zero: it said nothing of that meter): what
// they have refilled since, meter i at rate(i) a second, less extra,
// which the provider takes or gives back too. It is nil when lows is.
func Lows(lows []float64, at time.Time, rate func(i int) float64, extra []float64) []float64 {
	if lows == nil {
		return nil
	}
	since := time.Since(at).Seconds()
	now := make([]float64, len(lows))
	for i, n := range lows {
		now[i] = -1
		if n >= 0 {
			now[i] = max(0, n+rate(i)*since-extra[i])
		}
	}
	return now
}
