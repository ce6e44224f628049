package quota

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// Tests of the quotactl command (cmd/quotactl), built and run against real
// redis-server processes: its flags, warnings and exit statuses, and its
// commands changing a bucket under a running fleet.

// TestCLI runs the built quotactl as the user of the README's ACL line:
// flags after the subcommand, the warning of a bucket that Redis does not
// hold, and the exit statuses. list needs +scan, which that user lacks: it
// fails with exit 1 and the reason, and lists the buckets as a user who
// may scan. It builds the binary: make test runs it, not make check.
func TestCLI(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	srv := redistest.Start(t)
	admin := srv.Client(t)
	ctx := context.Background()
	if err := admin.Do(ctx, append([]any{"ACL", "SETUSER", "limiter"}, splitRule(aclLimiter)...)...).Err(); err != nil {
		t.Fatal(err)
	}
	bin := quotaBinary(t)
	url := "redis://limiter:limiter-secret@" + srv.Addr()
	l := NewLimiter(admin)
	if err := l.Wait(ctx, "api.example.com", PerSecond(10)); err != nil {
		t.Fatal(err)
	}

	code, out, errOut := quotaExec(t, bin, url, "status", "api.example.com", "-json")
	if code != 0 || errOut != "" || !strings.Contains(out, `"name":"api.example.com","limit":{"rate":10,"burst":30}`) {
		t.Errorf("quotactl status NAME -json: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	code, out, errOut = quotaExec(t, bin, url, "limit", "api.example.org", "300/min", "-json")
	const warning = `quotactl: warning: no bucket "api.example.org" under prefix "quota:" in Redis (a typo?); `
	if code != 0 || !strings.HasPrefix(errOut, warning) || strings.Count(errOut, "\n") != 1 ||
		out != `{"name":"api.example.org","action":"limit","override":{"rate":5,"burst":15}}`+"\n" {
		t.Errorf("quotactl limit on an unknown bucket: exit %d, stdout %q, stderr %q; want exit 0, the override and the warning", code, out, errOut)
	}
	if st, err := l.Status(ctx, "api.example.org"); err != nil || st.Override == nil || *st.Override != (Limit{Rate: 5, Burst: 15}) {
		t.Errorf("after quotactl limit on an unknown bucket, Status = %+v, %v", st, err)
	}

	code, out, errOut = quotaExec(t, bin, url, "list")
	if code != 1 || out != "" || !strings.HasPrefix(errOut, "quotactl: redis at "+srv.Addr()+": NOPERM") || !strings.Contains(errOut, "scan") {
		t.Errorf("quotactl list without +scan: exit %d, stdout %q, stderr %q; want exit 1 and NOPERM", code, out, errOut)
	}
	code, out, errOut = quotaExec(t, bin, "redis://"+srv.Addr(), "list")
	if code != 0 || errOut != "" || out != "api.example.com\napi.example.org\n" {
		t.Errorf("quotactl list: exit %d, stdout %q, stderr %q; want both buckets", code, out, errOut)
	}

	for _, args := range [][]string{{"status", "--", "-json", "x"}, {"limit", "x", "10/week"}, {"list", "-prefix"}} {
		code, out, errOut = quotaExec(t, bin, url, args...)
		if code != 2 || out != "" || !strings.HasSuffix(errOut, "\nrun 'quotactl -h' for usage\n") {
			t.Errorf("quotactl %q: exit %d, stdout %q, stderr %q; want exit 2 and the hint", args, code, out, errOut)
		}
	}
	if code, out, _ = quotaExec(t, bin, url, "list", "-h"); code != 0 || !strings.HasPrefix(out, "usage:\n  quotactl ") {
		t.Errorf("quotactl list -h: exit %d, stdout %q", code, out)
	}
}

// TestQuotaCommandsOnAFleet: three worker processes of ten goroutines send
// through Transports at 100/s to a counting provider, and the quota binary
// changes the bucket while they run: an override of 20/s and its removal,
// a pause of 2s, a pause forever and a resume, and status in between.
func TestQuotaCommandsOnAFleet(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	bin := quotaBinary(t)
	srv := redistest.Start(t)
	url := "redis://" + srv.Addr()
	prov := newProvider(t)
	name := strings.TrimPrefix(prov.URL, "http://")
	old, low := Limit{Rate: 100, Burst: 10}, Limit{Rate: 20, Burst: 5}
	const (
		procs      = 3
		goroutines = 10
		pause      = 2 * time.Second
	)
	w := startWorkers(t, procs, workerSpec{Addr: srv.Addr(), Key: name, URL: prov.URL, Limit: old,
		Goroutines: goroutines, Duration: 13 * time.Second})
	at := func(offset time.Duration) time.Time {
		time.Sleep(time.Until(w.start.Add(offset)))
		return time.Now()
	}
	status := func() map[string]any {
		t.Helper()
		_, out := quotaCmd(t, bin, url, "-json", "status", name)
		var st map[string]any
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("quota -json status printed %q: %v", out, err)
		}
		return st
	}

	// An override, and its removal.
	at(1500 * time.Millisecond)
	set, _ := quotaCmd(t, bin, url, "limit", name, "20/s", "5")
	at(3500 * time.Millisecond)
	overridden := status()
	cleared, _ := quotaCmd(t, bin, url, "limit", name, "off")

	// A pause of known length.
	pauseSent := at(5500 * time.Millisecond)
	paused, _ := quotaCmd(t, bin, url, "pause", name, pause.String())

	// A pause forever, and a resume.
	foreverSent := at(8500 * time.Millisecond)
	forever, _ := quotaCmd(t, bin, url, "pause", name, "forever")
	stopped := status()
	resumeSent := at(10 * time.Second)
	resumed, _ := quotaCmd(t, bin, url, "resume", name)
	w.wait(t)
	arrivals := prov.between(w.start, w.start.Add(w.spec.Duration+time.Minute))

	// limit: the old pace ends within a second, then 20/s, and limit off
	// brings back 100/s.
	last := lastRun(arrivals[:between(arrivals, w.start, cleared)], set, 100*time.Millisecond)
	slow := maxInWindow(inRange(arrivals, set.Add(time.Second), cleared), time.Second)
	fastFrom, fastTo := cleared.Add(time.Second), pauseSent
	fast := between(arrivals, fastFrom, fastTo)
	t.Logf("quota limit %s 20/s 5: the old pace ended %v after the command returned; at most %d arrivals in a second from 1s after it (bound %d); after limit off %d in %v (%.0f/s)",
		name, last.Sub(set).Round(time.Millisecond), slow, bound(low, time.Second), fast, fastTo.Sub(fastFrom).Round(time.Millisecond), float64(fast)/fastTo.Sub(fastFrom).Seconds())
	// A second for every Limiter to use it (one that missed the
	// announcement reads the record again within a second), and 100 ms
	// for a grant's way to the provider on a loaded machine (1.003s in a
	// CI run beside the other tests).
	if d := last.Sub(set); d > 1100*time.Millisecond {
		t.Errorf("the provider saw the old pace %v after quota limit returned, want at most a second and 100 ms", d)
	}
	if slow > bound(low, time.Second)+2 || slow < 15 {
		t.Errorf("%d arrivals in a second under the override, want %d at most and about 20", slow, bound(low, time.Second))
	}
	if want := 0.8 * old.Rate * fastTo.Sub(fastFrom).Seconds(); float64(fast) < want {
		t.Errorf("%d arrivals in %v after limit off, want about %.0f", fast, fastTo.Sub(fastFrom), want/0.8)
	}

	// pause 2s: nothing from 50 ms after the command returned until the
	// pause ends (2s after the command was sent at the earliest), then the
	// queue at its pace.
	during := inRange(arrivals, paused.Add(50*time.Millisecond), pauseSent.Add(pause))
	lastBefore := inRange(arrivals, pauseSent.Add(-time.Second), paused.Add(50*time.Millisecond))
	after := inRange(arrivals, pauseSent.Add(pause), foreverSent)
	t.Logf("quota pause %v: the command took %v; the last arrival before the pause %v after it returned; %d arrivals from 50ms after it returned until the pause ended",
		pause, paused.Sub(pauseSent).Round(time.Millisecond), lastOf(lastBefore).Sub(paused).Round(time.Millisecond), len(during))
	if len(during) > 0 {
		t.Errorf("%d arrivals during the pause, the first %v after quota pause returned", len(during), during[0].Sub(paused))
	}
	checkRestart(t, "the pause of "+pause.String()+" ended", after, pauseSent.Add(pause), paused.Add(pause), old)

	// pause forever, then resume.
	during = inRange(arrivals, forever.Add(50*time.Millisecond), resumeSent)
	lastBefore = inRange(arrivals, foreverSent.Add(-time.Second), forever.Add(50*time.Millisecond))
	after = inRange(arrivals, resumeSent, w.start.Add(w.spec.Duration))
	t.Logf("quota pause forever: the last arrival %v after the command returned; %d arrivals from 50ms after it until quota resume, %v later",
		lastOf(lastBefore).Sub(forever).Round(time.Millisecond), len(during), resumeSent.Sub(forever).Round(time.Millisecond))
	if len(during) > 0 {
		t.Errorf("%d arrivals while paused forever, the first %v after quota pause returned", len(during), during[0].Sub(forever))
	}
	checkRestart(t, "quota resume", after, resumeSent, resumed, old)

	// status said what was true.
	t.Logf("status under the override: %v", overridden)
	t.Logf("status paused forever: %v", stopped)
	if !jsonIs(overridden["override"], `{"burst":5,"rate":20}`) || !jsonIs(overridden["limit"], `{"burst":5,"rate":20}`) ||
		overridden["paused"] != false || overridden["workers"] != float64(procs) {
		t.Errorf("status under the override: %v", overridden)
	}
	if stopped["override"] != nil || !jsonIs(stopped["limit"], `{"burst":10,"rate":100}`) || stopped["paused"] != true ||
		stopped["paused_forever"] != true || stopped["paused_until"] != nil || stopped["workers"] != float64(procs) {
		t.Errorf("status while paused forever: %v", stopped)
	}
	if s, _ := stopped["paused_since"].(string); s == "" {
		t.Errorf("status while paused forever has no paused_since: %v", stopped)
	} else if since, err := time.Parse(time.RFC3339, s); err != nil || since.Before(foreverSent.Add(-time.Second)) || since.After(forever.Add(time.Second)) {
		t.Errorf("paused_since %q, want the time of quota pause forever, %v", s, forever.UTC())
	}
}

// checkRestart checks that arrivals restart after a pause ended, between
// from and to (when the command that ended it was sent and returned, or
// the earliest and latest the pause could end), at the bucket's pace, and
// logs how soon.
func checkRestart(t *testing.T, what string, after []time.Time, from, to time.Time, lim Limit) {
	t.Helper()
	if len(after) == 0 {
		t.Errorf("no arrival after %s", what)
		return
	}
	n := between(after, from, from.Add(time.Second))
	t.Logf("after %s: the first arrival %v after the earliest end, %v after the latest; %d arrivals in the second after it (bound %d)",
		what, after[0].Sub(from).Round(time.Millisecond), after[0].Sub(to).Round(time.Millisecond), n, bound(lim, time.Second))
	if d := after[0].Sub(to); d > 500*time.Millisecond {
		t.Errorf("the first arrival came %v after %s", d, what)
	}
	if n > bound(lim, time.Second)+5 || n < int(lim.Rate/2) {
		t.Errorf("%d arrivals in the second after %s, want about %v and at most %d", n, what, lim.Rate, bound(lim, time.Second))
	}
}

// inRange returns the sorted ts in [from, to).
func inRange(ts []time.Time, from, to time.Time) []time.Time {
	var out []time.Time
	for _, t := range ts {
		if !t.Before(from) && t.Before(to) {
			out = append(out, t)
		}
	}
	return out
}

func lastOf(ts []time.Time) time.Time {
	if len(ts) == 0 {
		return time.Time{}
	}
	return ts[len(ts)-1]
}

func jsonIs(v any, want string) bool {
	b, _ := json.Marshal(v)
	return string(b) == want
}
