package main

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// quotaRun runs the command line with env as the environment and returns
// its exit status, stdout and stderr.
func quotaRun(env map[string]string, args ...string) (int, string, string) {
	var out, errOut bytes.Buffer
	code := run(args, &out, &errOut, func(k string) string { return env[k] })
	return code, out.String(), errOut.String()
}

// mustRun runs the command line and fails the test unless it succeeds
// and prints nothing on stderr.
func mustRun(t *testing.T, env map[string]string, args ...string) string {
	t.Helper()
	return mustRunWarned(t, env, false, args...)
}

// mustRunNew runs the command line on a bucket that Redis does not hold
// and fails the test unless it succeeds with a warning about that.
func mustRunNew(t *testing.T, env map[string]string, args ...string) string {
	t.Helper()
	return mustRunWarned(t, env, true, args...)
}

func mustRunWarned(t *testing.T, env map[string]string, warned bool, args ...string) string {
	t.Helper()
	code, out, errOut := quotaRun(env, args...)
	if code != 0 {
		t.Fatalf("quotactl %s: exit %d, stderr %q", strings.Join(args, " "), code, errOut)
	}
	if got := strings.HasPrefix(errOut, "quotactl: warning: no bucket ") && strings.Count(errOut, "\n") == 1; got != warned || !warned && errOut != "" {
		t.Errorf("quotactl %s: stderr %q; want the warning of an unknown bucket: %v", strings.Join(args, " "), errOut, warned)
	}
	return out
}

func TestHelp(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"-help"}, {"help"}, {"-json", "help"}} {
		code, out, errOut := quotaRun(nil, args...)
		if code != 0 || !strings.HasPrefix(out, "usage:") || errOut != "" {
			t.Errorf("quotactl %v: exit %d, stdout %q, stderr %q; want the usage on stdout, exit 0", args, code, out, errOut)
		}
	}
}

// TestBadUsage: bad input to every subcommand exits 2 before reaching
// Redis, with one line that says why and one that points to the usage.
func TestBadUsage(t *testing.T) {
	env := map[string]string{"REDIS_URL": "redis://127.0.0.1:1"} // never dialled
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "no subcommand"},
		{[]string{"-json"}, "no subcommand"},
		{[]string{"-nosuchflag", "status", "x"}, "flag provided but not defined"},
		{[]string{"-redis"}, "flag needs an argument"},
		{[]string{"stats", "x"}, `unknown subcommand "stats"`},
		{[]string{"status", "x", "--", "-json"}, `unexpected argument "-json"`}, // no flag after --
		{[]string{"status", "x", "-nosuchflag"}, "flag provided but not defined: -nosuchflag"},
		{[]string{"status", "x", "-redis"}, "flag needs an argument: -redis"},
		{[]string{"status", "x", "-json=maybe"}, `invalid boolean value "maybe" for -json`},
		{[]string{"status", "--"}, "missing arguments"},
		{[]string{"--", "-json", "status", "x"}, `unknown subcommand "-json"`},
		{[]string{"status"}, "missing arguments"},
		{[]string{"status", ""}, "name is empty"},
		{[]string{"status", "a", "b"}, `unexpected argument "b"`},
		{[]string{"limit"}, "missing arguments"},
		{[]string{"limit", "x"}, "missing arguments"},
		{[]string{"limit", "x", "fast"}, `bad rate "fast"`},
		{[]string{"limit", "x", "10/w"}, `bad rate "10/w": the unit after / must be one of s, sec, second, m, min,`},
		{[]string{"limit", "x", "0/s"}, `bad limit "0/s": rate 0 must be a finite number above zero`},
		{[]string{"limit", "x", "-5"}, `bad limit "-5": rate -5 must be`}, // a number, not a flag
		{[]string{"limit", "x", "--", "-5/s"}, `bad limit "-5/s": rate -5 must be`},
		{[]string{"limit", "x", "-x5"}, "flag provided but not defined: -x5"},
		{[]string{"limit", "x", "NaN"}, `bad limit "NaN": rate NaN must be`},
		{[]string{"limit", "x", "Inf/s"}, `bad limit "Inf/s": rate +Inf must be`},
		{[]string{"limit", "x", "/s"}, `bad rate "/s"`},
		{[]string{"limit", "x", "10/s", "many"}, `bad burst "many"`},
		{[]string{"limit", "x", "10/s", "0"}, `bad burst "0": want 1 token or more`},
		{[]string{"limit", "x", "10/s", "-1"}, `bad limit "10/s -1": burst -1 must be a finite number, zero or more`},
		{[]string{"limit", "x", "10/s", "Inf"}, `bad limit "10/s Inf": burst +Inf must be a finite number`},
		{[]string{"limit", "x", "10/s", "0.5"}, `bad limit "10/s 0.5": burst 0.5 holds less than one token`},
		{[]string{"limit", "x", "10/s", "5", "6"}, `unexpected argument "6"`},
		{[]string{"limit", "x", "off", "5"}, `unexpected argument "5" after off`},
		{[]string{"limit", "x", "1/d", "400"}, `bad limit "1/d 400": a burst of 400 at 1.1574074074074073e-05/s takes longer than`},
		{[]string{"limit", "x", "1e-8"}, "a burst of 1 at 1e-08/s takes longer"}, // the default burst of one token
		{[]string{"pause"}, "missing arguments"},
		{[]string{"pause", "x"}, "missing arguments"},
		{[]string{"pause", "x", "soon"}, `bad duration "soon"`},
		{[]string{"pause", "x", "10"}, `bad duration "10"`},
		{[]string{"pause", "x", "0s"}, `bad duration "0s"`},
		{[]string{"pause", "x", "-1s"}, `bad duration "-1s"`},
		{[]string{"pause", "x", "1s", "2s"}, `unexpected argument "2s"`},
		{[]string{"resume"}, "missing arguments"},
		{[]string{"resume", "x", "now"}, `unexpected argument "now"`},
		{[]string{"list", "x"}, `list: unexpected argument "x": want none`},
		{[]string{"lst"}, `unknown subcommand "lst": want status, limit, pause, resume, list or top`},
		{[]string{"top", "a", "b"}, `top: unexpected argument "b": want [NAME]`},
		{[]string{"top", ""}, "name is empty"},
		{[]string{"-json", "top"}, "top: -json does not apply"},
		{[]string{"top"}, "top: needs a terminal"}, // the test's stdout is a buffer
		{[]string{"top", "api"}, "top: needs a terminal"},
		{[]string{"-redis", "localhost", "status", "x"}, `bad -redis address "localhost"`},
		{[]string{"-redis", "a:1,b", "status", "x"}, `bad -redis address "b"`},
		{[]string{"-redis", "http://localhost:6379", "status", "x"}, "bad -redis"},
		{[]string{"status", "x", "-redis", "localhost"}, `bad -redis address "localhost"`},
	} {
		code, out, errOut := quotaRun(env, tc.args...)
		lines := strings.Split(strings.TrimSuffix(errOut, "\n"), "\n")
		if code != 2 || out != "" || len(lines) != 2 || !strings.HasPrefix(lines[0], "quotactl: ") ||
			!strings.Contains(lines[0], tc.want) || lines[1] != hint {
			t.Errorf("quotactl %q: exit %d, stdout %q, stderr %q; want exit 2 and %q, then the hint", tc.args, code, out, errOut, tc.want)
		}
	}
}

// TestFlagsAnywhere: the flags are the same before the subcommand, after
// it and among its arguments, with a value after a space or an "=", and a
// "--" ends them.
func TestFlagsAnywhere(t *testing.T) {
	want := command{redis: "h:1", prefix: "p:", json: true, op: "status", name: "api"}
	for _, args := range [][]string{
		{"-redis", "h:1", "-prefix", "p:", "-json", "status", "api"},
		{"status", "api", "-json", "-redis", "h:1", "-prefix", "p:"},
		{"-json", "status", "-redis=h:1", "api", "--prefix=p:"},
		{"status", "-json", "api", "-redis", "h:1", "-prefix=p:"},
		{"-redis", "h:1", "-prefix", "p:", "status", "-json", "--", "api"},
	} {
		if got, err := parse(args); err != nil || got != want {
			t.Errorf("parse(%q) = %+v, %v; want %+v", args, got, err, want)
		}
	}
	for _, tc := range []struct {
		args []string
		want command
	}{
		{[]string{"status", "--", "-api"}, command{prefix: quota.DefaultPrefix, op: "status", name: "-api"}},
		{[]string{"-json", "--", "resume", "--"}, command{prefix: quota.DefaultPrefix, json: true, op: "resume", name: "--"}},
		{[]string{"-prefix", "--", "status", "-"}, command{prefix: "--", op: "status", name: "-"}}, // a flag's value may be "--"
		{[]string{"list", "-json"}, command{prefix: quota.DefaultPrefix, json: true, op: "list"}},
		{[]string{"pause", "x", "-json", "5s"}, command{prefix: quota.DefaultPrefix, json: true, op: "pause", name: "x", pause: 5 * time.Second}},
		{[]string{"limit", "x", "-json=false", "10/s", "-json", "5"}, command{prefix: quota.DefaultPrefix, json: true, op: "limit", name: "x", limit: quota.Limit{Rate: 10, Burst: 5}, rate: "10/s", burst: true}},
	} {
		if got, err := parse(tc.args); err != nil || got != tc.want {
			t.Errorf("parse(%q) = %+v, %v; want %+v", tc.args, got, err, tc.want)
		}
	}
	for _, args := range [][]string{{"status", "x", "-h"}, {"limit", "x", "--help"}} {
		if code, out, _ := quotaRun(nil, args...); code != 0 || !strings.HasPrefix(out, "usage:") {
			t.Errorf("quotactl %q: exit %d, stdout %q; want the usage", args, code, out)
		}
	}
}

func TestParseRate(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want float64
	}{
		{"10/s", 10}, {"300/m", 5}, {"7200/h", 2}, {"10000/d", 10000.0 / 86400}, {"2.5", 2.5}, {"0.5/s", 0.5}, {"1e3", 1000},
		{"10/sec", 10}, {"10/second", 10}, {"300/min", 5}, {"300/minute", 5},
		{"7200/hr", 2}, {"7200/hour", 2}, {"172800/day", 2},
	} {
		got, err := parseRate(tc.in)
		if err != nil || math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("parseRate(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	// The error for an unknown unit lists every unit accepted.
	for _, in := range []string{"10/w", "10/mins", "10/S", "10/", "10/s/s"} {
		_, err := parseRate(in)
		if err == nil {
			t.Errorf("parseRate(%q) accepted it", in)
			continue
		}
		listed := strings.Fields(strings.ReplaceAll(strings.SplitN(err.Error(), "one of ", 2)[1], ",", ""))
		slices.Sort(listed)
		if units := slices.Sorted(maps.Keys(rateUnits)); !slices.Equal(listed, units) {
			t.Errorf("parseRate(%q): %v; want the units %v listed", in, err, units)
		}
	}
	for _, tc := range []struct {
		args []string
		want quota.Limit
	}{
		{[]string{"10/s"}, quota.Limit{Rate: 10, Burst: 30}}, // the package's default burst
		{[]string{"10000/d"}, quota.Limit{Rate: 10000.0 / 86400, Burst: 1}},
		{[]string{"20/s", "5"}, quota.Limit{Rate: 20, Burst: 5}},
		{[]string{"1/d", "366"}, quota.Limit{Rate: 1.0 / 86400, Burst: 366}},
	} {
		got, err := parseLimit(tc.args)
		if err != nil || got != tc.want {
			t.Errorf("parseLimit(%q) = %+v, %v; want %+v", tc.args, got, err, tc.want)
		}
	}
	// parseLimit refuses what Limit.Validate refuses, and a burst below 1.
	for _, tc := range []struct {
		args []string
		lim  quota.Limit
	}{
		{[]string{"1/d", "366"}, quota.Limit{Rate: 1.0 / 86400, Burst: 366}},
		{[]string{"1/d", "367"}, quota.Limit{Rate: 1.0 / 86400, Burst: 367}},
		{[]string{"1e-9"}, quota.Limit{Rate: 1e-9}},
		{[]string{"1e308"}, quota.Limit{Rate: 1e308}}, // no finite default burst
		{[]string{"1e308", "1e300"}, quota.Limit{Rate: 1e308, Burst: 1e300}},
		{[]string{"5", "0.99"}, quota.Limit{Rate: 5, Burst: 0.99}},
		{[]string{"5", "1"}, quota.Limit{Rate: 5, Burst: 1}},
		{[]string{"5e-324", "1"}, quota.Limit{Rate: 5e-324, Burst: 1}},
	} {
		_, err := parseLimit(tc.args)
		verr := tc.lim.Validate()
		want := verr != nil || len(tc.args) > 1 && tc.lim.Burst < 1
		if (err != nil) != want || verr != nil && !strings.HasSuffix(err.Error(), strings.TrimPrefix(verr.Error(), quota.ErrInvalidLimit.Error())) {
			t.Errorf("parseLimit(%q) = %v; Validate says %v", tc.args, err, verr)
		}
	}
	for r, want := range map[float64]string{10: "10/s", 5: "5/s", 0.5: "30/m", 10000.0 / 86400: "10000/d", 2.0 / 3600: "2/h", 1.0 / 7: "0.142857/s"} {
		if got := fmtRate(r); got != want {
			t.Errorf("fmtRate(%v) = %q, want %q", r, got, want)
		}
	}
}

// statusOf runs quotactl -json status and decodes its object.
func statusOf(t *testing.T, env map[string]string, flags ...string) map[string]any {
	t.Helper()
	out := mustRun(t, env, append(append([]string{"-json"}, flags...), "status", "api.example.com")...)
	if strings.Count(out, "\n") != 1 {
		t.Errorf("quotactl -json status printed %q, want one line", out)
	}
	var m map[string]any
	if err := json.Unmarshal([]byte(out), &m); err != nil {
		t.Fatalf("quotactl -json status printed %q: %v", out, err)
	}
	return m
}

// TestCommands runs every subcommand against a redis-server and checks
// what the package reads back, and what quotactl prints.
func TestCommands(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	env := map[string]string{}
	flags := []string{"-redis", srv.Addr()}
	cmd := func(args ...string) string { return mustRun(t, env, append(append([]string{}, flags...), args...)...) }
	const name = "api.example.com"
	l := quota.NewLimiter(srv.Client(t))
	if err := l.Wait(ctx, name, quota.PerSecond(100)); err != nil {
		t.Fatal(err)
	}

	// Nothing set: the callers' Limit, one worker.
	st := statusOf(t, env, flags...)
	want := map[string]any{
		"name": name, "limit": map[string]any{"rate": 100.0, "burst": 300.0}, "override": nil,
		"paused": false, "paused_forever": false, "paused_since": nil, "paused_until": nil,
		"pause_left_seconds": 0.0, "workers": 1.0, "fleet_workers": 0.0, "queue_seconds": 0.0,
	}
	for k, v := range want {
		if !jsonEqual(st[k], v) {
			t.Errorf("status %s = %v, want %v", k, st[k], v)
		}
	}
	if tok, _ := st["tokens"].(float64); tok < 299 || tok > 300 {
		t.Errorf("status tokens = %v, want about 299", st["tokens"])
	}
	if len(st) != 20 {
		t.Errorf("status has %d fields, want 20: %v", len(st), st)
	}
	layers, _ := st["layers"].([]any)
	if len(layers) != 1 {
		t.Fatalf("status layers = %v, want one", st["layers"])
	}
	layer := layers[0].(map[string]any)
	if g, _ := layer["granted"].([]any); layer["rate"] != 100.0 || layer["burst"] != 300.0 || layer["override"] != false || len(g) != 60 {
		t.Errorf("status layers[0] = %v", layer)
	}
	if lim, _ := st["limiters"].([]any); len(lim) != 1 || !jsonEqual(st["slots"], map[string]any{"held": 0.0, "lingering": 0.0, "waiting": 0.0}) ||
		st["resumes_at"] != nil || st["now"] == nil || st["granted_until"] == nil {
		t.Errorf("status limiters %v, slots %v, resumes_at %v, now %v, granted_until %v", st["limiters"], st["slots"], st["resumes_at"], st["now"], st["granted_until"])
	}
	text := cmd("status", name)
	for _, line := range []string{"bucket   api.example.com", "limit    100/s, burst 300 (the callers'; no override)", "paused   no", "workers  1 on this bucket"} {
		if !strings.Contains(text, line+"\n") {
			t.Errorf("status printed\n%s\nwithout the line %q", text, line)
		}
	}

	// The flags after the subcommand and its arguments.
	out := mustRun(t, env, "status", name, "-json", "-redis", srv.Addr())
	if after, err := decode(out); err != nil || after["name"] != name || !jsonEqual(after["limit"], want["limit"]) {
		t.Errorf("quotactl status NAME -json -redis ADDR printed %q", out)
	}

	// limit
	if out := cmd("limit", name, "20/s", "5"); !strings.Contains(out, "limited to 20/s, burst 5") {
		t.Errorf("limit printed %q", out)
	}
	got, err := l.Status(ctx, name)
	if err != nil || got.Override == nil || *got.Override != (quota.Limit{Rate: 20, Burst: 5}) {
		t.Fatalf("after quotactl limit 20/s 5, Status = %+v, %v", got, err)
	}
	st = statusOf(t, env, flags...)
	if !jsonEqual(st["override"], map[string]any{"rate": 20.0, "burst": 5.0}) || !jsonEqual(st["limit"], st["override"]) {
		t.Errorf("status after limit: limit %v override %v", st["limit"], st["override"])
	}
	if text := cmd("status", name); !strings.Contains(text, "limit    20/s, burst 5 (override)\n") {
		t.Errorf("status printed\n%s", text)
	}
	var action map[string]any
	out = cmd("-json", "limit", name, "300/m")
	if action, err = decode(out); err != nil || !jsonEqual(action, map[string]any{
		"name": name, "action": "limit", "override": map[string]any{"rate": 5.0, "burst": 15.0}}) {
		t.Errorf("quotactl -json limit 300/m printed %q", out)
	}
	cmd("limit", name, "off")
	if got, err := l.Status(ctx, name); err != nil || got.Override != nil || got.Limit.Rate != 100 {
		t.Fatalf("after quotactl limit off, Status = %+v, %v", got, err)
	}

	// pause for a while, then forever, then resume
	before := time.Now()
	if out := cmd("pause", name, "90s"); !strings.Contains(out, "paused for 1m30s") {
		t.Errorf("pause printed %q", out)
	}
	st = statusOf(t, env, flags...)
	left, _ := st["pause_left_seconds"].(float64)
	since, _ := time.Parse(time.RFC3339, str(st["paused_since"]))
	until, _ := time.Parse(time.RFC3339, str(st["paused_until"]))
	if st["paused"] != true || st["paused_forever"] != false || left < 85 || left > 90 ||
		since.Sub(before).Abs() > time.Second || until.Sub(since.Add(90*time.Second)).Abs() > time.Millisecond {
		t.Errorf("status after pause 90s: %v", st)
	}
	if text := cmd("status", name); !strings.Contains(text, "paused   until ") || !strings.Contains(text, "s left), since ") {
		t.Errorf("status printed\n%s", text)
	}
	out = cmd("-json", "pause", name, "forever")
	if action, err = decode(out); err != nil || !jsonEqual(action, map[string]any{"name": name, "action": "pause", "forever": true}) {
		t.Errorf("quotactl -json pause forever printed %q", out)
	}
	st = statusOf(t, env, flags...)
	if st["paused"] != true || st["paused_forever"] != true || st["paused_until"] != nil || st["pause_left_seconds"] != nil || st["paused_since"] == nil {
		t.Errorf("status after pause forever: %v", st)
	}
	if text := cmd("status", name); !strings.Contains(text, "paused   until resumed, since ") {
		t.Errorf("status printed\n%s", text)
	}
	if got, err := l.Status(ctx, name); err != nil || !got.Paused || !got.PausedUntil.IsZero() {
		t.Fatalf("after quotactl pause forever, Status = %+v, %v", got, err)
	}
	if ok, _ := l.Allow(ctx, name, quota.PerSecond(100)); ok {
		t.Error("Allow granted a token while paused forever")
	}
	out = cmd("-json", "resume", name)
	if action, err = decode(out); err != nil || !jsonEqual(action, map[string]any{"name": name, "action": "resume"}) {
		t.Errorf("quotactl -json resume printed %q", out)
	}
	if got, err := l.Status(ctx, name); err != nil || got.Paused {
		t.Fatalf("after quotactl resume, Status = %+v, %v", got, err)
	}

	// A provider's Retry-After is the bucket's pause too: status shows it
	// and who set it, and resume ends it.
	provider := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Retry-After", "60")
		w.WriteHeader(http.StatusTooManyRequests)
	}))
	defer provider.Close()
	host := strings.TrimPrefix(provider.URL, "http://")
	tr := quota.NewTransport(srv.Client(t), quota.PerSecond(100))
	resp, err := (&http.Client{Transport: tr}).Get(provider.URL)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	var paused map[string]any
	for range 100 { // the pause is recorded after the response returns
		if paused, err = decode(cmd("-json", "status", host)); err == nil && paused["paused"] == true {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if paused["paused"] != true || paused["paused_by"] != "provider" {
		t.Errorf("status during a Retry-After pause: %v", paused)
	}
	if text := cmd("status", host); !strings.Contains(text, "s left), since ") || !strings.Contains(text, "by the provider\n") {
		t.Errorf("status during a Retry-After pause printed\n%s", text)
	}
	cmd("resume", host)
	if got, err := l.Status(ctx, host); err != nil || got.Paused {
		t.Errorf("after quotactl resume of a Retry-After pause, Status = %+v, %v", got, err)
	}

	// Another prefix is another set of buckets.
	other := quota.NewLimiter(srv.Client(t), quota.WithPrefix("tenant7:"))
	mustRunNew(t, env, append(flags, "-prefix", "tenant7:", "limit", name, "1/s")...)
	if got, _ := other.Status(ctx, name); got.Override == nil || got.Override.Rate != 1 {
		t.Errorf("quotactl -prefix tenant7: limit: Status under that prefix = %+v", got)
	}
	if got, _ := l.Status(ctx, name); got.Override != nil {
		t.Errorf("quotactl -prefix tenant7: limit set an override under the default prefix")
	}
	// An unknown bucket: nothing known, nothing invented.
	st, err = decode(mustRunNew(t, env, append(flags, "-json", "-prefix", "nobody:", "status", name)...))
	if err != nil || st["limit"] != nil || st["override"] != nil || st["tokens"] != 0.0 || st["workers"] != 0.0 {
		t.Errorf("status of an unused bucket: %v, %v", st, err)
	}
	if text := mustRunNew(t, env, append(flags, "-prefix", "nobody:", "status", name)...); !strings.Contains(text, "limit    unknown") {
		t.Errorf("status of an unused bucket printed\n%s", text)
	}
}

// TestUnknownBucket: status, limit, pause and resume warn on stderr when
// Redis holds nothing of the bucket, do their work all the same and exit
// 0. A bucket with a key of its own draws no warning, whatever its name,
// even when its Status shows nothing.
func TestUnknownBucket(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	rdb := srv.Client(t)
	l := quota.NewLimiter(rdb)
	flags := []string{"-redis", srv.Addr()}
	warning := func(name, prefix string) string {
		return fmt.Sprintf("quotactl: warning: no bucket %q under prefix %q in Redis (a typo?); ", name, prefix)
	}
	warned := func(errOut, name, prefix string) bool {
		return strings.HasPrefix(errOut, warning(name, prefix)) && strings.Count(errOut, "\n") == 1
	}

	for i, tc := range []struct {
		args []string // NAME stands for the bucket's name
		done func(quota.Status) bool
	}{
		{[]string{"status", "NAME"}, nil},
		{[]string{"status", "NAME", "-json"}, nil},
		{[]string{"limit", "NAME", "5/s"}, func(st quota.Status) bool { return st.Override != nil && st.Override.Rate == 5 }},
		{[]string{"limit", "NAME", "off"}, nil},
		{[]string{"pause", "NAME", "1m"}, func(st quota.Status) bool { return st.Paused }},
		{[]string{"-json", "pause", "NAME", "forever"}, func(st quota.Status) bool { return st.Paused && st.PausedUntil.IsZero() }},
		{[]string{"resume", "NAME"}, nil},
	} {
		name := fmt.Sprintf("typo%d.example.com", i)
		args := append([]string{}, flags...)
		for _, a := range tc.args {
			args = append(args, strings.ReplaceAll(a, "NAME", name))
		}
		code, out, errOut := quotaRun(nil, args...)
		if code != 0 || out == "" || !warned(errOut, name, quota.DefaultPrefix) {
			t.Errorf("quotactl %q on an unknown bucket: exit %d, stdout %q, stderr %q; want exit 0, the output and the warning %q...",
				args, code, out, errOut, warning(name, quota.DefaultPrefix))
		}
		if strings.Contains(strings.Join(args, " "), "-json") && !json.Valid([]byte(out)) {
			t.Errorf("quotactl %q printed %q, not JSON", args, out)
		}
		if st, err := l.Status(ctx, name); err != nil || tc.done != nil && !tc.done(st) {
			t.Errorf("after quotactl %q, Status = %+v, %v", args, st, err)
		}
	}
	// The record that limit made is the bucket's.
	mustRun(t, nil, append(flags, "status", "typo2.example.com")...)

	// Buckets that only their keys reveal: a slow bucket's layer, with the
	// record removed, under names that are written in their keys escaped
	// or shortened; and concurrency slots held.
	names := []string{"plain", "}brace", "%percent", "%}", "a}b", "x}:ctl", strings.Repeat("d", 200),
		strings.Repeat("e", 201), strings.Repeat("f", 300), "}" + strings.Repeat("g", 300), "%" + strings.Repeat("h", 300)}
	slow := quota.Limit{Rate: 0.01, Burst: 1} // a take leaves the key for 100 s
	// A Limiter of their own makes the keys, on a client closed before the
	// records go: it reads its records again in the background when its
	// subscription is confirmed, which would write them back.
	maker := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	lk := quota.NewLimiter(maker, quota.WithLogger(slog.New(slog.DiscardHandler)))
	for _, name := range names {
		if err := lk.Wait(ctx, name, slow); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := lk.AcquireSlot(ctx, "pool", 2); err != nil {
		t.Fatal(err)
	}
	maker.Close() // the slot is held until its lease ends
	names = append(names, "pool")
	var ctl []string
	for it := rdb.Scan(ctx, 0, "*:ctl", 0).Iterator(); it.Next(ctx); {
		ctl = append(ctl, it.Val())
	}
	if len(ctl) > 0 {
		if err := rdb.Del(ctx, ctl...).Err(); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range names {
		if st, err := l.Status(ctx, name); err != nil || st.Limit.Rate != 0 || st.Paused || st.Workers != 0 {
			t.Fatalf("Status(%q) without its record = %+v, %v; want it to show nothing", name, st, err)
		}
		if code, _, errOut := quotaRun(nil, append(flags, "status", "--", name)...); code != 0 || errOut != "" {
			t.Errorf("quotactl status %q, a bucket with a key: exit %d, stderr %q; want no warning", name, code, errOut)
		}
	}
	// The same names under another prefix are other buckets.
	code, _, errOut := quotaRun(nil, append(flags, "-prefix", "other:", "status", "plain")...)
	if code != 0 || !warned(errOut, "plain", "other:") {
		t.Errorf("quotactl -prefix other: status plain: exit %d, stderr %q; want the warning", code, errOut)
	}
}

// TestBucketOf: list reads back the name of every key of a bucket, once
// escaped or shortened, and no other key.
func TestBucketOf(t *testing.T) {
	long := strings.Repeat("x", 300)
	for _, prefix := range []string{"quota:", "", "a{b}:", "*?[]\\:"} {
		for _, name := range []string{"api.example.com", "}", "}x", "%", "%%", "%x", "a}b", "x}:ctl", "{", "{}", " ",
			"my bucket", "line\nbreak", strings.Repeat("y", 200), strings.Repeat("z", 201), long, "}" + long, "%" + long} {
			want := listed{Name: name}
			if len(name) > store.MaxNameLen {
				sum := sha256.Sum256([]byte(name))
				want = listed{Name: name[:184] + "~" + hex.EncodeToString(sum[:8]), Shortened: true}
			}
			for _, suffix := range append(keySuffixes, "", ":5/15", ":0.1/1e-07", ":1e+21/3", ":input_tokens:100/1000") {
				key := bucketKey(prefix, name) + suffix
				if got, ok := bucketOf(prefix, key); !ok || got != want {
					t.Errorf("bucketOf(%q, %q) = %+v, %v; want %+v", prefix, key, got, ok, want)
				}
			}
		}
	}
	for _, key := range []string{
		"quota:workers", "quota:resume", "quota:control", "other:{x}", "quota{x}", "quota:x{y}",
		"quota:{x", "quota:{}", "quota:{}x}", "quota:{%x}", "quota:{%}", "quota:{x}:other", "quota:{x}:ctl:more",
		"quota:{x}:5", "quota:{x}:5/", "quota:{x}:/5", "quota:{x}:a/b", "quota:{x}5/15", "quota:{x}:slots:",
		"quota:{x}:in:5", "quota:{x}:in:5/", "quota:{x}:a b:5/15", "quota:{x}::5/15",
		"quota:{" + strings.Repeat("y", 201) + "}", "quota:{" + long + "}",
		"quota:{" + strings.Repeat("y", 184) + "~0123456789ABCDEF}", "quota:{" + strings.Repeat("y", 185) + "~0123456789abcde}",
	} {
		if got, ok := bucketOf("quota:", key); ok {
			t.Errorf("bucketOf(quota:, %q) = %+v, a bucket; want none", key, got)
		}
	}
	if got := globEscape(`a*b?c[d]e\f{g}`); got != `a\*b\?c\[d\]e\\f{g}` {
		t.Errorf("globEscape = %s", got)
	}
}

// TestList: list prints every bucket that has a key once, however many
// keys it has and however its name is written in them, and nothing else;
// it reads the keys with SCAN, a thousand a call, never with KEYS.
func TestList(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	rdb := srv.Client(t)
	l := quota.NewLimiter(rdb)
	flags := []string{"-redis", srv.Addr()}

	long := strings.Repeat("l", 300)
	names := []string{"api.example.com", "}brace", "%percent", "a}b", "my bucket", "-dash", strings.Repeat("d", 200)}
	for _, name := range names {
		if err := l.WaitN(ctx, name, 1, quota.Limit{Rate: 1, Burst: 1}, quota.PerMinute(10)); err != nil { // two layers, a record
			t.Fatal(err)
		}
	}
	if err := l.Wait(ctx, long, quota.PerSecond(1)); err != nil {
		t.Fatal(err)
	}
	if err := l.SetLimit(ctx, "override-only", quota.PerSecond(5)); err != nil {
		t.Fatal(err)
	}
	slot, err := l.AcquireSlot(ctx, "pool", 1)
	if err != nil {
		t.Fatal(err)
	}
	defer slot.Release()
	names = append(names, "override-only", "pool")
	// Keys of no bucket, and keys under other prefixes.
	for _, key := range []string{"quota:workers", "quota:resume", "quota:{x", "quota:{}", "quota:{%x}", "quota:{x}:other",
		"quotaX{y}", "other:{z}", "quota:" + long} {
		if err := rdb.Set(ctx, key, "1", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
	}
	// Enough buckets that the scan takes several calls.
	const many = 2500
	if _, err := rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i := range many {
			p.Set(ctx, fmt.Sprintf("quota:{n%04d}", i), "1", time.Minute)
			names = append(names, fmt.Sprintf("n%04d", i))
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
		t.Fatal(err)
	}

	var got []listed
	out := mustRun(t, nil, append(flags, "list", "-json")...)
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("quotactl list -json printed %.200q: %v", out, err)
	}
	slices.Sort(names)
	var shortened []listed
	got = slices.DeleteFunc(got, func(b listed) bool {
		if b.Shortened {
			shortened = append(shortened, b)
		}
		return b.Shortened
	})
	gotNames := make([]string, len(got))
	for i, b := range got {
		gotNames[i] = b.Name
	}
	if !slices.Equal(gotNames, names) {
		t.Errorf("quotactl list -json: %d buckets not shortened; want the %d made, in order: %q ...", len(got), len(names), gotNames[:min(len(gotNames), 12)])
	}
	if len(shortened) != 1 || len(shortened[0].Name) != store.MaxNameLen+1 || !strings.HasPrefix(shortened[0].Name, long[:184]+"~") {
		t.Errorf("quotactl list -json: shortened %+v; want the long name's first bytes and a digest", shortened)
	}
	if !strings.Contains(out, `"shortened":true`) || strings.Count(out, `"shortened"`) != 1 {
		t.Errorf("quotactl list -json marks %d names shortened, want 1", strings.Count(out, `"shortened"`))
	}

	info, err := rdb.Info(ctx, "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := 0
	fmt.Sscanf(info[strings.Index(info, "cmdstat_scan:")+len("cmdstat_scan:"):], "calls=%d", &calls)
	t.Logf("quotactl list: %d calls of SCAN over %d keys", calls, rdb.DBSize(ctx).Val())
	if keys := rdb.DBSize(ctx).Val(); calls < int(keys)/1000 || calls > int(keys)/1000*3+3 || strings.Contains(info, "cmdstat_keys:") {
		t.Errorf("quotactl list ran SCAN %d times over %d keys, want about one call per 1000 keys and no KEYS:\n%s", calls, keys, info)
	}

	// The text: one bucket a line, quoted for a shell where it needs it.
	text := mustRun(t, nil, append(flags, "list")...)
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	if len(lines) != len(names)+1 || !slices.Contains(lines, "'my bucket'") || !slices.Contains(lines, "'}brace'") || !slices.Contains(lines, "-dash") ||
		!slices.Contains(lines, quoteName(shortened[0].Name)+shortenedNote) {
		t.Errorf("quotactl list printed %d lines, want %d: %q ...", len(lines), len(names)+1, lines[:min(len(lines), 12)])
	}

	// A prefix with no bucket: nothing, and a warning.
	code, out, errOut := quotaRun(nil, append(flags, "-prefix", "quota:{n0", "list", "-json")...)
	if code != 0 || out != "[]\n" || errOut != "quotactl: warning: no bucket under prefix \"quota:{n0\" in Redis (another -prefix?)\n" {
		t.Errorf("quotactl list under an empty prefix: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	// A prefix with glob characters matches only itself.
	if err := rdb.Set(ctx, "te?t:{a}", "1", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.Set(ctx, "text:{b}", "1", time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	if out := mustRun(t, nil, append(flags, "-prefix", "te?t:", "list")...); out != "a\n" {
		t.Errorf("quotactl -prefix te?t: list printed %q, want a alone", out)
	}
}

func decode(s string) (map[string]any, error) {
	var m map[string]any
	err := json.Unmarshal([]byte(s), &m)
	return m, err
}

func str(v any) string { s, _ := v.(string); return s }

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return bytes.Equal(x, y)
}

// TestRedisURL: REDIS_URL, and a URL in -redis, carry the password; a
// wrong one fails with exit 1 and never shows the password.
func TestRedisURL(t *testing.T) {
	const pass = "s3cret-pw"
	srv := redistest.Start(t) // (its readiness check does not authenticate)
	ctx := context.Background()
	if err := srv.Client(t).ConfigSet(ctx, "requirepass", pass).Err(); err != nil {
		t.Fatal(err)
	}
	admin := srv.Client(t, func(o *redis.Options) { o.Password = pass })
	l := quota.NewLimiter(admin)
	good := "redis://:" + pass + "@" + srv.Addr() + "/0"
	mustRunNew(t, map[string]string{"REDIS_URL": good}, "limit", "env", "7/s")
	mustRunNew(t, nil, "-redis", good, "limit", "flag", "8/s")
	// -redis wins over REDIS_URL.
	mustRunNew(t, map[string]string{"REDIS_URL": "redis://127.0.0.1:1"}, "-redis", good, "limit", "both", "9/s")
	for name, rate := range map[string]float64{"env": 7, "flag": 8, "both": 9} {
		if st, err := l.Status(ctx, name); err != nil || st.Override == nil || st.Override.Rate != rate {
			t.Errorf("Status(%s) = %+v, %v; want an override of %v/s", name, st, err, rate)
		}
	}

	for _, tc := range []struct {
		env  map[string]string
		args []string
	}{
		{map[string]string{"REDIS_URL": "redis://:wrong-" + pass + "@" + srv.Addr()}, []string{"status", "x"}},
		{nil, []string{"-redis", "redis://:wrong-" + pass + "@" + srv.Addr(), "status", "x"}},
		{nil, []string{"-redis", srv.Addr(), "status", "x"}}, // no password
	} {
		code, out, errOut := quotaRun(tc.env, tc.args...)
		if code != 1 || out != "" || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, "redis at "+srv.Addr()+": ") || strings.Contains(errOut, pass) {
			t.Errorf("quotactl %v with a wrong password: exit %d, stdout %q, stderr %q; want exit 1 and one line naming %s without the password", tc.args, code, out, errOut, srv.Addr())
		}
	}
	for _, u := range []string{"http://localhost:6379", "redis://:" + pass + "@localhost:port/0", "redis://:" + pass + "@localhost:6379/db"} {
		code, _, errOut := quotaRun(map[string]string{"REDIS_URL": u}, "status", "x")
		if code != 2 || !strings.HasPrefix(errOut, "quotactl: bad REDIS_URL: ") || strings.Count(errOut, "\n") != 2 || strings.Contains(errOut, pass) {
			t.Errorf("REDIS_URL=%s: exit %d, stderr %q; want exit 2, the reason without the password", u, code, errOut)
		}
	}
}

// TestTLSURL: rediss:// turns TLS on; a server that does not speak it
// is an error of Redis, exit 1.
func TestTLSURL(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	code, _, errOut := quotaRun(map[string]string{"REDIS_URL": "rediss://" + srv.Addr()}, "status", "x")
	if code != 1 || !strings.Contains(errOut, "redis at "+srv.Addr()) {
		t.Errorf("rediss:// to a plain server: exit %d, stderr %q; want exit 1", code, errOut)
	}
}

// TestCluster: a comma-separated -redis is a Cluster's nodes.
func TestCluster(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	l := quota.NewLimiter(c.Client(t))
	addrs := strings.Join(c.Addrs(), ",")
	names := []string{"a.example.com", "b.example.com", "c.example.com", "d.example.com", "e.example.com"}
	for _, name := range names {
		mustRunNew(t, nil, "-redis", addrs, "limit", name, "3/s", "2")
		mustRun(t, nil, "-redis", addrs, "pause", name, "forever")
	}
	// list scans every master: the buckets are on more than one.
	holding := 0
	for _, s := range c.Nodes() {
		if n, err := s.Client(t).DBSize(ctx).Result(); err == nil && n > 0 {
			holding++
		}
	}
	var listed []map[string]any
	if err := json.Unmarshal([]byte(mustRun(t, nil, "-redis", addrs, "list", "-json")), &listed); err != nil || holding < 2 ||
		!jsonEqual(listed, []map[string]string{{"name": names[0]}, {"name": names[1]}, {"name": names[2]}, {"name": names[3]}, {"name": names[4]}}) {
		t.Errorf("quotactl list on the Cluster, %d of whose masters hold buckets: %v, %v; want %q", holding, listed, err, names)
	}
	for _, name := range names {
		st, err := l.Status(ctx, name)
		if err != nil || st.Override == nil || *st.Override != (quota.Limit{Rate: 3, Burst: 2}) || !st.Paused {
			t.Errorf("Status(%s) on the Cluster = %+v, %v", name, st, err)
		}
		mustRun(t, nil, "-redis", addrs, "resume", name)
		mustRun(t, nil, "-redis", addrs, "limit", name, "off")
		if st, err := l.Status(ctx, name); err != nil || st.Override != nil || st.Paused {
			t.Errorf("Status(%s) after resume and limit off = %+v, %v", name, st, err)
		}
	}
}

// TestUnreachable: no server at the address: exit 1, one line naming it.
func TestUnreachable(t *testing.T) {
	redistest.Long(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	for _, tc := range []struct {
		env  map[string]string
		args []string
		name string
	}{
		{nil, []string{"-redis", addr, "status", "x"}, addr},
		{nil, []string{"-redis", addr, "-json", "limit", "x", "1/s"}, addr},
		{nil, []string{"-redis", addr, "pause", "x", "1s"}, addr},
		{nil, []string{"-redis", addr, "resume", "x"}, addr},
		{map[string]string{"REDIS_URL": "redis://:pw@" + addr}, []string{"limit", "x", "off"}, addr},
		{nil, []string{"-redis", addr + "," + addr, "status", "x"}, addr + "," + addr},
		{nil, []string{"-redis", addr, "list"}, addr},
		{nil, []string{"-redis", addr + "," + addr, "list", "-json"}, addr + "," + addr},
	} {
		// Each waits out its retries: side by side.
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Parallel()
			unreachable(t, addr, tc.env, tc.args, tc.name)
		})
	}
}

// unreachable runs quotactl args under env with nothing listening at addr,
// named name in its error, and checks that it fails at once in one line.
func unreachable(t *testing.T, addr string, env map[string]string, args []string, name string) {
	start := time.Now()
	code, out, errOut := quotaRun(env, args...)
	took := time.Since(start)
	if code != 1 || out != "" || strings.Count(errOut, "\n") != 1 || !strings.HasPrefix(errOut, "quotactl: redis at "+name+": ") ||
		!strings.Contains(errOut, "unavailable") || strings.Contains(errOut, ":pw@") {
		t.Errorf("quotactl %v with nothing at %s: exit %d, stdout %q, stderr %q; want exit 1 and one line naming the address", args, addr, code, out, errOut)
	}
	if took > overall+time.Second {
		t.Errorf("quotactl %v took %v, want at most %v", args, took, overall)
	}
	t.Logf("quotactl %v: exit %d after %v: %s", args, code, took.Round(time.Millisecond), strings.TrimSpace(errOut))
}

func TestShellLine(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"quotactl", "resume", "api.example.com"}, "quotactl resume api.example.com"},
		{[]string{"quotactl", "resume", "my bucket"}, "quotactl resume 'my bucket'"},
		{[]string{"quotactl", "limit", "it's", "off"}, `quotactl limit 'it'\''s' off`},
		{[]string{"quotactl", "resume", "$(rm -rf /)"}, "quotactl resume '$(rm -rf /)'"},
		{[]string{"quotactl", "resume", ""}, "quotactl resume ''"},
	} {
		if got := shellLine(tc.args...); got != tc.want {
			t.Errorf("shellLine(%q) = %s, want %s", tc.args, got, tc.want)
		}
	}
}
