package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// TestShortRun runs the whole program with shortConfig on a redis-server
// of its own and checks that the table has its header and a row for every
// peer. It is skipped without redis-server on PATH unless
// QUOTA_REQUIRE_REDIS=1.
func TestShortRun(t *testing.T) {
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("QUOTA_REQUIRE_REDIS") == "1" {
			t.Fatalf("redis-server not on PATH and QUOTA_REQUIRE_REDIS=1: %v", err)
		}
		t.Skip("redis-server not on PATH; set QUOTA_REQUIRE_REDIS=1 to fail instead")
	}
	var out, log bytes.Buffer
	if err := run(context.Background(), shortConfig(), &out, &log); err != nil {
		t.Fatalf("%v\n%s", err, log.String())
	}
	t.Logf("\n%s", out.String())

	lines := strings.Split(out.String(), "\n")
	if len(lines) < 2+len(peers) {
		t.Fatalf("the table has %d lines, want a header, a rule and %d rows", len(lines), len(peers))
	}
	header := cells(lines[0])
	if want := 1 + len(columns(shortConfig())); len(header) != want {
		t.Errorf("header %q has %d cells, want %d", lines[0], len(header), want)
	}
	for i, p := range peers {
		row := cells(lines[2+i])
		if len(row) != len(header) || row[0] != p.name {
			t.Errorf("row %d is %q, want %d cells starting with %q", i, lines[2+i], len(header), p.name)
		}
		for j, c := range row {
			if c == "" || strings.Contains(c, "NaN") {
				t.Errorf("%s: %s is %q", p.name, header[j], c)
			}
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
