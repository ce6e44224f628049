package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestShortRun runs the whole program with shortConfig on a redis-server
// of its own, its contended runs lengthened to a second on the full run's
// bucket (100/s, burst 10), so that the 1-second window fits in them and
// 200 goroutines queue two seconds deep. It checks the table's shape, and
// the claims the table makes, from the measured figures:
//
//   - quota sends one Redis command per grant (one more at most, to load
//     its script) and never grants more than Burst + Rate x W in a window
//     W, as overIssue counts them, while granting at least 80% of Burst +
//     Rate in its busiest second (which itself is not held to the bound:
//     its grants are stamped when their callers wake, and on a loaded
//     machine a window of late stamps holds more than the bound);
//   - the polling peers send several commands per grant;
//   - the seed script, which trusts the caller's clock, over-issues by more
//     than a whole grant with 200 goroutines;
//
// and that the table's cells say so. It is skipped without redis-server on
// PATH unless QUOTA_REQUIRE_REDIS=1.
func TestShortRun(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("QUOTA_REQUIRE_REDIS") == "1" {
			t.Fatalf("redis-server not on PATH and QUOTA_REQUIRE_REDIS=1: %v", err)
		}
		t.Skip("redis-server not on PATH; set QUOTA_REQUIRE_REDIS=1 to fail instead")
	}
	cfg := shortConfig()
	cfg.contended = time.Second
	cfg.lim = defaultConfig().lim
	var out, log bytes.Buffer
	version, results, err := measureAll(context.Background(), cfg, &log)
	if err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	writeTable(&out, cfg, version, results)
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
		case "quota Limiter.Wait":
			for i, c := range r.swarms {
				// One script call a grant, and once per bucket the read of
				// its pause record when the first caller sleeps on it.
				if c.commands > int64(c.grants)+1 {
					t.Errorf("quota, %d goroutines: %d Redis commands for %d grants, want one a grant and one more", c.goroutines, c.commands, c.grants)
				}
				if c.excess > exactTolerance {
					t.Errorf("quota, %d goroutines: %.2f grants more in a window than Burst + Rate x its length", c.goroutines, c.excess)
				}
				// Exact by granting what the bucket allows, not by starving.
				if want := 0.8 * (float64(lim.Burst) + lim.Rate); float64(c.maxIn1s) < want {
					t.Errorf("quota, %d goroutines: at most %d grants in 1 s, want at least %.0f", c.goroutines, c.maxIn1s, want)
				}
				if cell, want := row[fmt.Sprintf("cmds/grant ×%d", c.goroutines)], fmtFloat(c.perGrant()); !strings.HasPrefix(cell, want+" ") {
					t.Errorf("quota: cmds/grant ×%d is %q, want %s from %d commands for %d grants", cfg.swarms[i], cell, want, c.commands, c.grants)
				}
			}
			if row["exact"] != "yes" || row["1 trip"] != "yes" {
				t.Errorf("quota: exact %q, 1 trip %q, want yes and yes", row["exact"], row["1 trip"])
			}
		case "go-redis/redis_rate v10", "seed article script + loop":
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
	seed := results[slices.IndexFunc(results, func(r peerResult) bool { return r.name == "seed article script + loop" })]
	if c := seed.swarms[len(seed.swarms)-1]; c.excess <= 1 {
		t.Errorf("seed script, %d goroutines: excess %+.2f, want more than a whole grant (it trusts the caller's clock)", c.goroutines, c.excess)
	}
	if cell := rows[seed.name]["exact"]; !strings.HasPrefix(cell, "no, +") {
		t.Errorf("seed script: exact %q, want no", cell)
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
