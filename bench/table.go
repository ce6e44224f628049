package main

import (
	"fmt"
	"io"
	"math"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// column is one column of the table. value, when set, gives the figure
// that is compared with redis_rate's; ok false leaves the cell without a
// figure.
type column struct {
	header string
	value  func(r peerResult) (v float64, ok bool)
	format func(v float64) string
	cell   func(r peerResult) string
}

// columns returns the table's columns for cfg.
func columns(cfg config) []column {
	cols := []column{
		{header: "p50", value: func(r peerResult) (float64, bool) { return float64(r.lat.p50), true }, format: fmtDuration},
		{header: "p99", value: func(r peerResult) (float64, bool) { return float64(r.lat.p99), true }, format: fmtDuration},
		{header: fmt.Sprintf("acq/s ×%d", cfg.parallel), value: func(r peerResult) (float64, bool) { return r.perSec, true }, format: fmtCount},
		{header: fmt.Sprintf("cmds/grant ×%d", cfg.parallel), value: func(r peerResult) (float64, bool) { return r.tputCmds, r.redis }, format: fmtFloat},
		{header: "Redis CPU/acq", value: func(r peerResult) (float64, bool) { return float64(r.redisCPU), r.redis }, format: fmtDuration},
		{header: "allocs/acq", value: func(r peerResult) (float64, bool) { return r.lat.allocs, true }, format: fmtFloat},
	}
	for i, g := range cfg.swarms {
		cols = append(cols, column{
			header: fmt.Sprintf("cmds/grant ×%d", g),
			value: func(r peerResult) (float64, bool) {
				return r.swarms[i].perGrant(), r.redis
			},
			format: fmtFloat,
		})
	}
	for i, g := range cfg.swarms {
		cols = append(cols, column{
			header: fmt.Sprintf("max 1 s ×%d", g),
			cell: func(r peerResult) string {
				c := r.swarms[i]
				return fmt.Sprintf("%d / %d", c.maxIn1s, c.bound)
			},
		})
	}
	cols = append(cols,
		column{header: "exact", cell: func(r peerResult) string {
			if exact(r) {
				return "yes"
			}
			return fmt.Sprintf("no, %+.1f", worstExcess(r))
		}},
		column{header: "1 trip", cell: func(r peerResult) string {
			if !r.redis {
				return "no Redis"
			}
			return yesNo(oneTrip(r))
		}},
	)
	return cols
}

// exactTolerance is the excess, in tokens, below which a peer counts as
// exact. Grants come whole, and a stamp is never early, so an exact limiter
// measures at most 0; a tenth of a token leaves room for rounding, and for
// x/time/rate, whose concurrent callers may take its lock in another order
// than they read the clock and be granted a fraction of an interval early.
const exactTolerance = 0.1

// exact reports whether r never granted more than the bucket allows, within
// exactTolerance, in any contended run.
func exact(r peerResult) bool { return worstExcess(r) <= exactTolerance }

// worstExcess returns r's largest excess over its contended runs.
func worstExcess(r peerResult) float64 {
	worst := math.Inf(-1)
	for _, c := range r.swarms {
		worst = max(worst, c.excess)
	}
	return worst
}

// oneTrip reports whether r sent at most 1.1 Redis commands per grant in
// every contended run.
func oneTrip(r peerResult) bool {
	for _, c := range r.swarms {
		if !(c.perGrant() <= 1.1) {
			return false
		}
	}
	return true
}

// writeTable writes the results as one Markdown table, aligned for a
// terminal, followed by what was measured.
func writeTable(w io.Writer, cfg config, version string, results []peerResult) {
	cols := columns(cfg)
	rows := [][]string{{"peer"}}
	for _, c := range cols {
		rows[0] = append(rows[0], c.header)
	}
	for _, r := range results {
		row := []string{r.name}
		for _, c := range cols {
			row = append(row, cellOf(c, r, results))
		}
		rows = append(rows, row)
	}
	writeRows(w, rows)

	fmt.Fprintf(w, "\nredis-server %s on loopback, started by this program; %s, GOMAXPROCS %d.\n",
		version, runtime.Version(), gomaxprocs())
	fmt.Fprintf(w, "- p50, p99, allocs/acq: %d acquisitions one after another, the medians of %d rounds' p50 and p99; "+
		"acq/s ×%d: %d goroutines, the median of %d runs of %v, and cmds/grant ×%d the Redis commands they sent per acquisition; "+
		"all on a bucket that never makes anyone wait, the peers taking turns in %d rounds.\n",
		cfg.ops, cfg.rounds, cfg.parallel, cfg.parallel, cfg.rounds, cfg.throughput/time.Duration(cfg.rounds), cfg.parallel, cfg.rounds)
	fmt.Fprintf(w, "- cmds/grant ×N, max 1 s ×N: N goroutines for %v on a fresh bucket of %g/s burst %d. "+
		"cmds/grant counts every Redis command but connection set-up (HELLO, CLIENT, AUTH, SELECT); "+
		"max 1 s is the most grants in any 1-second window / the bound Burst + Rate × (1 s + %v of stamp slack); "+
		"a grant is stamped when its caller wakes, so on a loaded machine a window may hold a few more than the bound without any over-issue.\n",
		cfg.contended, cfg.lim.Rate, cfg.lim.Burst, stampSlack)
	fmt.Fprintln(w, "- Redis CPU/acq: the CPU time redis-server used during the acq/s runs (INFO cpu), "+
		"divided by their acquisitions: what one acquisition costs the Redis that the whole fleet shares.")
	fmt.Fprintln(w, "- (Nx): the figure divided by redis_rate's in its column; "+
		"x/time/rate, in-process, is the lower bound of cost.")
	fmt.Fprintf(w, "- exact: in every contended run, no window [a, b] holds more than Burst + Rate × (b - a) grants, within %g of a token, "+
		"counting the grants called at a or later that returned by b; a caller that wakes late only lowers the count, "+
		"so wake-up jitter cannot fake an excess. no, +N: N grants too many at worst. "+
		"1 trip: at most 1.1 Redis commands per grant in every contended run.\n", exactTolerance)
}

// cellOf formats r's figure in column c with its ratio to redis_rate's.
func cellOf(c column, r peerResult, all []peerResult) string {
	if c.cell != nil {
		return c.cell(r)
	}
	v, ok := c.value(r)
	if !ok {
		return "-"
	}
	s := c.format(v)
	if ref, ok := c.value(byName(all, redisRateName)); ok && ref > 0 && !math.IsNaN(v) {
		s += " (" + fmtRatio(v/ref) + ")"
	}
	return s
}

// byName returns the result of the peer called name.
func byName(all []peerResult, name string) peerResult {
	for _, r := range all {
		if r.name == name {
			return r
		}
	}
	return peerResult{}
}

// A target is a figure of quota's that the run is to reach.
type target struct {
	what string
	got  string
	want string
	met  bool
}

// targets returns quota's targets, measured in this run: with the
// goroutines of the throughput run on a bucket that never makes anyone
// wait, at most 0.1 Redis command per grant, Redis CPU per acquisition at
// most 0.1 times redis_rate's (the line gives both) and throughput at
// least 3 times; the
// uncontended median latency at most 1.05 times that of quota without
// batching; Redis CPU per acquisition at most 1.05 times that of quota
// whose control reads are not sent; and in every contended run, exact, the busiest second within
// the bound, and fewer Redis commands than grants.
func targets(cfg config, all []peerResult) []target {
	q, off, rr := byName(all, quotaName), byName(all, unbatchedName), byName(all, redisRateName)
	cpu, tput := float64(q.redisCPU)/float64(rr.redisCPU), q.perSec/rr.perSec
	p50 := float64(q.lat.p50) / float64(off.lat.p50)
	unc := byName(all, uncontrolName)
	ctlCPU := float64(q.redisCPU) / float64(unc.redisCPU)
	ts := []target{
		{fmt.Sprintf("cmds/grant ×%d", cfg.parallel), fmtFloat(q.tputCmds), "at most 0.1", q.tputCmds <= 0.1},
		{fmt.Sprintf("Redis CPU/acq ×%d", cfg.parallel), fmt.Sprintf("quota %s, redis_rate %s: %s redis_rate's",
			fmtDuration(float64(q.redisCPU)), fmtDuration(float64(rr.redisCPU)), fmtRatio(cpu)), "at most 0.1x", cpu <= 0.1},
		{fmt.Sprintf("acq/s ×%d", cfg.parallel), fmtRatio(tput) + " redis_rate's", "at least 3x", tput >= 3},
		{"p50", fmtRatio(p50) + " quota's with WithNoBatching()", "at most 1.05x", p50 <= 1.05},
		{"Redis CPU/acq with runtime control", fmtRatio(ctlCPU) + " quota's without its control reads", "at most 1.05x", ctlCPU <= 1.05},
	}
	for _, c := range q.swarms {
		ts = append(ts, target{
			what: fmt.Sprintf("×%d on %g/s burst %d", c.goroutines, cfg.lim.Rate, cfg.lim.Burst),
			got:  fmt.Sprintf("max 1 s %d / %d, excess %+.1f, cmds/grant %s", c.maxIn1s, c.bound, c.excess, fmtFloat(c.perGrant())),
			want: "within the bound, exact, below 1",
			met:  c.maxIn1s <= c.bound && c.excess <= exactTolerance && c.perGrant() < 1,
		})
	}
	return ts
}

// writeTargets writes quota's targets and whether this run met them.
func writeTargets(w io.Writer, cfg config, all []peerResult) {
	fmt.Fprintln(w, "Targets, quota against redis_rate in this run:")
	for _, t := range targets(cfg, all) {
		verdict := "met"
		if !t.met {
			verdict = "NOT MET"
		}
		fmt.Fprintf(w, "- %s: %s; target %s: %s\n", t.what, t.got, t.want, verdict)
	}
}

// writeRows writes rows as a Markdown table whose columns are padded to
// the same width; the first row is the header.
func writeRows(w io.Writer, rows [][]string) {
	widths := make([]int, len(rows[0]))
	for _, row := range rows {
		for i, cell := range row {
			widths[i] = max(widths[i], len([]rune(cell)))
		}
	}
	line := func(row []string) {
		var b strings.Builder
		b.WriteString("|")
		for i, cell := range row {
			b.WriteString(" " + cell + strings.Repeat(" ", widths[i]-len([]rune(cell))) + " |")
		}
		fmt.Fprintln(w, b.String())
	}
	line(rows[0])
	sep := make([]string, len(widths))
	for i, n := range widths {
		sep[i] = strings.Repeat("-", n)
	}
	line(sep)
	for _, row := range rows[1:] {
		line(row)
	}
}

// fmtDuration formats nanoseconds as ns, µs or ms.
func fmtDuration(ns float64) string {
	d := time.Duration(ns)
	switch {
	case d < time.Microsecond:
		return fmt.Sprintf("%d ns", d.Nanoseconds())
	case d < time.Millisecond:
		return fmt.Sprintf("%.1f µs", ns/1e3)
	default:
		return fmt.Sprintf("%.2f ms", ns/1e6)
	}
}

// fmtCount formats a rate as a whole number with thousands separators.
func fmtCount(v float64) string {
	s := strconv.FormatInt(int64(math.Round(v)), 10)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// fmtFloat formats a small figure with three decimals, a larger one with
// one.
func fmtFloat(v float64) string {
	if v < 10 {
		return strconv.FormatFloat(v, 'f', 3, 64)
	}
	return strconv.FormatFloat(v, 'f', 1, 64)
}

// fmtRatio formats a ratio to two decimals, or two significant digits
// when it is below 0.1.
func fmtRatio(r float64) string {
	if r < 0.1 {
		return strconv.FormatFloat(r, 'g', 2, 64) + "x"
	}
	return strconv.FormatFloat(r, 'f', 2, 64) + "x"
}

// yesNo formats a verdict.
func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
