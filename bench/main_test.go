package main

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// TestShortRun runs the whole program with shortConfig on a redis-server
// of its own, its contended runs lengthened to a second on the full run's
// bucket (100/s, burst 10), so that the 1-second window fits in them and
// 200 goroutines queue two seconds deep. It checks the table's shape, and
// the claims the tables make, from the measured figures:
//
//   - quota, with batching and without, sends at most one Redis command
//     per grant in the contended runs (one more at most, to read the
//     bucket's pause record) and never grants more than Burst + Rate x W in
//     a window W, as overIssue counts them, while granting at least 80% of
//     Burst + Rate in its busiest second (which itself is not held to the
//     bound: its grants are stamped when their callers wake, and on a
//     loaded machine a window of late stamps holds more than the bound);
//   - with batching, the 64 goroutines of the throughput run share calls:
//     fewer than 0.2 Redis commands per acquisition, where quota without
//     batching and redis_rate send one each; and in the contended runs
//     quota with batching sends fewer commands than it grants;
//   - in the scaling table, one goroutine sends one command per
//     acquisition, and quota with batching sends fewer than 0.1 with 256;
//   - the polling peers send several commands per grant in the contended
//     runs;
//   - the seed script, which trusts the caller's clock, over-issues by more
//     than a whole grant with 200 goroutines;
//
// and that the cells and the targets say so. It is skipped without
// redis-server on PATH unless QUOTA_REQUIRE_REDIS=1.
func TestShortRun(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("QUOTA_REQUIRE_REDIS") == "1" {
			t.Fatalf("redis-server not on PATH and QUOTA_REQUIRE_REDIS=1: %v", err)
		}
		t.Skip("redis-server not on PATH; set QUOTA_REQUIRE_REDIS=1 to fail instead")
	}
	cfg := shortConfig()
	// Contended for 1 s, the window the bound is judged in, on a bucket
	// slow enough that the pollers poll (the full run's 100/s burst 10)
	// and fast enough that 200 goroutines drain their queue in a second.
	cfg.contended = time.Second
	cfg.lim = limit{Rate: 200, Burst: defaultConfig().lim.Burst}
	var out, log bytes.Buffer
	rep, err := measureAll(context.Background(), cfg, &log)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	results := rep.peers
	writeReport(&out, cfg, rep)
	t.Logf("\n%s", out.String())

	lines := strings.Split(out.String(), "\n")
	if len(lines) < 2+len(peers) {
		t.Fatalf("the table has %d lines, want a header, a rule and %d rows", len(lines), len(peers))
	}
	header := cells(lines[0])
	if want := 1 + len(columns(cfg)); len(header) != want {
		t.Errorf("header %q has %d cells, want %d", lines[0], len(header), want)
	}
	rows := map[string]map[string]string{} // peer, header: cell
	for i, p := range peers {
		row := cells(lines[2+i])
		if len(row) != len(header) || row[0] != p.name {
			t.Fatalf("row %d is %q, want %d cells starting with %q", i, lines[2+i], len(header), p.name)
		}
		rows[p.name] = map[string]string{}
		for j, c := range row {
			if c == "" || strings.Contains(c, "NaN") {
				t.Errorf("%s: %s is %q", p.name, header[j], c)
			}
			rows[p.name][header[j]] = c
		}
	}

	lim := cfg.lim
	for _, r := range results {
		for _, c := range r.swarms {
			t.Logf("%s, %d goroutines: %d grants, %d commands (%.3f a grant), max in 1 s %d / %d, excess %+.2f tokens",
				r.name, c.goroutines, c.grants, c.commands, c.perGrant(), c.maxIn1s, c.bound, c.excess)
		}
	}
	for _, r := range results {
		row := rows[r.name]
		switch r.name {
		case quotaName, unbatchedName:
			for i, c := range r.swarms {
				// At most one script call a grant, the first read of the
				// bucket's control record and one when the Limiter begins
				// to listen, and while callers sleep on the bucket a read
				// every half second: two a second of the queue.
				reads := 2 + 2*int64(math.Ceil(float64(c.grants)/cfg.lim.Rate))
				if c.commands > int64(c.grants)+reads {
					t.Errorf("%s, %d goroutines: %d Redis commands for %d grants, want one a grant and %d more", r.name, c.goroutines, c.commands, c.grants, reads)
				}
				if r.name == quotaName && c.commands >= int64(c.grants) {
					t.Errorf("quota, %d goroutines: %d Redis commands for %d grants, want fewer: the first callers share a call", c.goroutines, c.commands, c.grants)
				}
				if c.excess > exactTolerance {
					t.Errorf("quota, %d goroutines: %.2f grants more in a window than Burst + Rate x its length", c.goroutines, c.excess)
				}
				// Exact by granting what the bucket allows, not by starving.
				if want := 0.8 * (float64(lim.Burst) + lim.Rate); float64(c.maxIn1s) < want {
					t.Errorf("quota, %d goroutines: at most %d grants in 1 s, want at least %.0f", c.goroutines, c.maxIn1s, want)
				}
				if cell, want := row[fmt.Sprintf("cmds/grant ×%d", c.goroutines)], fmtFloat(c.perGrant()); !strings.HasPrefix(cell, want+" ") {
					t.Errorf("%s: cmds/grant ×%d is %q, want %s from %d commands for %d grants", r.name, cfg.swarms[i], cell, want, c.commands, c.grants)
				}
			}
			if row["exact"] != "yes" || row["1 trip"] != "yes" {
				t.Errorf("%s: exact %q, 1 trip %q, want yes and yes", r.name, row["exact"], row["1 trip"])
			}
		}
		tput := fmt.Sprintf("cmds/grant ×%d", cfg.parallel)
		switch r.name {
		case quotaName:
			if r.tputCmds >= 0.2 {
				t.Errorf("quota: %.3f Redis commands per acquisition with %d goroutines, want fewer than 0.2: they share calls", r.tputCmds, cfg.parallel)
			}
		case unbatchedName, redisRateName:
			if r.tputCmds < 0.99 || r.tputCmds > 1.01 {
				t.Errorf("%s: %.3f Redis commands per acquisition with %d goroutines, want one each", r.name, r.tputCmds, cfg.parallel)
			}
		}
		if r.redis {
			if cell := row[tput]; !strings.HasPrefix(cell, fmtFloat(r.tputCmds)+" ") {
				t.Errorf("%s: %s is %q, want %s", r.name, tput, cell, fmtFloat(r.tputCmds))
			}
		}
		switch r.name {
		case redisRateName, seedName:
			for _, c := range r.swarms {
				if c.perGrant() < 2 {
					t.Errorf("%s, %d goroutines: %.3f commands a grant, want the polling loop's several", r.name, c.goroutines, c.perGrant())
				}
			}
			if row["1 trip"] != "no" {
				t.Errorf("%s: 1 trip %q, want no", r.name, row["1 trip"])
			}
		}
	}
	seed := byName(results, seedName)
	if c := seed.swarms[len(seed.swarms)-1]; c.excess <= 1 {
		t.Errorf("seed script, %d goroutines: excess %+.2f, want more than a whole grant (it trusts the caller's clock)", c.goroutines, c.excess)
	}
	if cell := rows[seed.name]["exact"]; !strings.HasPrefix(cell, "no, +") {
		t.Errorf("seed script: exact %q, want no", cell)
	}

	// The targets: one line each, and those the short run can judge met.
	text := out.String()
	ts := targets(cfg, results)
	if want := 5 + len(cfg.swarms); len(ts) != want {
		t.Errorf("%d targets, want %d", len(ts), want)
	}
	for _, tg := range ts {
		if !strings.Contains(text, "- "+tg.what+": "+tg.got+"; target "+tg.want+": ") {
			t.Errorf("the output lacks the target %q", tg.what)
		}
		if strings.HasPrefix(tg.what, "cmds/grant") && !tg.met {
			t.Errorf("target %s: %s, want %s", tg.what, tg.got, tg.want)
		}
	}

	// The scaling table: a row for each number of goroutines, three
	// figures for each peer that scales.
	scalers := 0
	for _, p := range peers {
		if p.scaling {
			scalers++
		}
	}
	if want := len(cfg.scale) * scalers; len(rep.scaling) != want {
		t.Fatalf("%d scaling points, want %d", len(rep.scaling), want)
	}
	at := strings.Index(text, "\n| goroutines ")
	if at < 0 {
		t.Fatal("no scaling table")
	}
	scaleLines := strings.Split(strings.TrimSpace(text[at:]), "\n")
	if len(scaleLines) != 2+len(cfg.scale) {
		t.Fatalf("the scaling table has %d lines, want %d", len(scaleLines), 2+len(cfg.scale))
	}
	for i, g := range cfg.scale {
		row := cells(scaleLines[2+i])
		if len(row) != 2+3*scalers || row[0] != fmt.Sprint(g) {
			t.Errorf("scaling row %q: want %d cells starting with %d", scaleLines[2+i], 2+3*scalers, g)
		}
	}
	for _, p := range rep.scaling {
		t.Logf("scaling: %s, %d goroutines: %.0f acq/s, %.3f commands per acquisition, Redis CPU %v per acquisition",
			p.peer, p.goroutines, p.perSec, p.commands, p.redisCPU)
		switch {
		case p.goroutines == 1 && (p.commands < 0.99 || p.commands > 1.01):
			t.Errorf("scaling: %s, one goroutine: %.3f commands per acquisition, want one", p.peer, p.commands)
		case p.peer == quotaName && p.goroutines == 256 && p.commands >= 0.1:
			t.Errorf("scaling: quota, 256 goroutines: %.3f commands per acquisition, want fewer than 0.1", p.commands)
		}
	}
}

// cells splits a Markdown table row into its trimmed cells.
func cells(line string) []string {
	parts := strings.Split(strings.Trim(line, "|"), "|")
	for i, p := range parts {
		parts[i] = strings.TrimSpace(p)
	}
	return parts
}

// recordHook records the names of the commands that reach it, with the
// operation of each script call.
type recordHook struct {
	mu   *sync.Mutex
	seen *[]string
}

func (recordHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h recordHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		args := cmd.Args()
		what := cmd.Name()
		if isControlRead(args) {
			what = "control read"
		}
		h.mu.Lock()
		*h.seen = append(*h.seen, what)
		h.mu.Unlock()
		return next(ctx, cmd)
	}
}

func (recordHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// The peer without control reads sends none, and every take: the peer it
// is compared with sends them, so that the comparison measures them.
func TestControlReadsNotSent(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("QUOTA_REQUIRE_REDIS") == "1" {
			t.Fatalf("redis-server not on PATH and QUOTA_REQUIRE_REDIS=1: %v", err)
		}
		t.Skip("redis-server not on PATH; set QUOTA_REQUIRE_REDIS=1 to fail instead")
	}
	ctx := context.Background()
	srv, err := startServer(ctx, "redis-server")
	if err != nil {
		t.Fatal(err)
	}
	defer srv.stop()
	for _, c := range []struct {
		acquire      func(*redis.Client, string, limit) acquireFunc
		controlReads bool
	}{
		{quotaAcquire(true), true},
		{uncontrolledAcquire, false},
	} {
		var mu sync.Mutex
		var seen []string
		rdb := redis.NewClient(&redis.Options{Addr: srv.addr})
		defer rdb.Close()
		// Added after the peer's own hooks, this one runs after them,
		// and sees only the commands they send on to Redis.
		acquire := c.acquire(rdb, "reads", unlimited)
		rdb.AddHook(recordHook{&mu, &seen})
		for range 5 {
			if err := acquire(ctx); err != nil {
				t.Fatal(err)
			}
		}
		mu.Lock()
		reads := slices.Index(seen, "control read") >= 0
		mu.Unlock()
		if reads != c.controlReads {
			t.Errorf("control reads sent: %v, want %v; the commands: %v", reads, c.controlReads, seen)
		}
	}
}
