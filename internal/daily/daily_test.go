package daily

import (
	"strings"
	"testing"
	"time"
)

// Resets gives four successive local resets, the first the last at or
// before an hour before t, across daylight-saving changes.
func TestResets(t *testing.T) {
	la, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		t.Skip(err)
	}
	local := func(s string) time.Time {
		tm, err := time.ParseInLocation(time.DateTime, s, la)
		if err != nil {
			t.Fatal(err)
		}
		return tm
	}
	for _, tc := range []struct {
		t    string
		at   time.Duration
		want [4]string
	}{
		{"2026-03-08 12:00:00", 0, [4]string{"2026-03-08 00:00:00", "2026-03-09 00:00:00", "2026-03-10 00:00:00", "2026-03-11 00:00:00"}},
		{"2026-03-08 00:30:00", 0, [4]string{"2026-03-07 00:00:00", "2026-03-08 00:00:00", "2026-03-09 00:00:00", "2026-03-10 00:00:00"}},
		{"2026-11-01 23:59:59", 0, [4]string{"2026-11-01 00:00:00", "2026-11-02 00:00:00", "2026-11-03 00:00:00", "2026-11-04 00:00:00"}},
		{"2026-06-01 09:00:00", 9*time.Hour + 30*time.Minute, [4]string{"2026-05-31 09:30:00", "2026-06-01 09:30:00", "2026-06-02 09:30:00", "2026-06-03 09:30:00"}},
	} {
		got := Resets(local(tc.t), tc.at, la)
		for i, w := range tc.want {
			if !got[i].Equal(local(w)) {
				t.Errorf("Resets(%s, %v): [%d] %v, want %s", tc.t, tc.at, i, got[i].In(la), w)
			}
		}
	}
	r := Resets(local("2026-03-08 12:00:00"), 0, la)
	if d := r[1].Sub(r[0]); d != 23*time.Hour {
		t.Errorf("the day daylight saving begins lasts %v, want 23h", d)
	}
	r = Resets(local("2026-11-01 12:00:00"), 0, la)
	if d := r[1].Sub(r[0]); d != 25*time.Hour {
		t.Errorf("the day daylight saving ends lasts %v, want 25h", d)
	}
}

func TestUnitAndSpec(t *testing.T) {
	for _, n := range []float64{1, 3, 1500, 1e6, MaxCount} {
		w := Unit(n)
		if w < 1 || w&(w-1) != 0 || float64(w)*n > float64(12*time.Hour/time.Microsecond) || float64(2*w)*n <= float64(12*time.Hour/time.Microsecond) {
			t.Errorf("Unit(%v) = %d: want the largest power of two at most 12h/n µs", n, w)
		}
	}
	spec := Spec(time.Date(2026, 1, 2, 3, 0, 0, 0, time.UTC), 4, 0, time.UTC)
	want := "d1767312000000000,1767398400000000,1767484800000000,1767571200000000,8589934592"
	if spec != want {
		t.Errorf("Spec: %s, want %s", spec, want)
	}
}

func TestCheckKeyString(t *testing.T) {
	for _, tc := range []struct {
		rate, n float64
		at      time.Duration
		loc     *time.Location
		want    string
	}{
		{0, 5, 0, nil, "Zone is nil"},
		{1, 5, 0, time.UTC, "not a rate"},
		{0, 0.5, 0, time.UTC, "count"},
		{0, 2 * MaxCount, 0, time.UTC, "count"},
		{0, 5, 24 * time.Hour, time.UTC, "Reset"},
		{0, 5, 0, time.UTC, ""},
	} {
		if got := Check(tc.rate, tc.n, tc.at, tc.loc); !strings.Contains(got, tc.want) || (tc.want == "") != (got == "") {
			t.Errorf("Check(%v, %v, %v, %v) = %q, want %q", tc.rate, tc.n, tc.at, tc.loc, got, tc.want)
		}
	}
	la := time.FixedZone("America/Los_Angeles", -8*3600)
	if got, want := Key(90*time.Minute+5*time.Second, la), "d013005@America.Los_Angeles"; got != want {
		t.Errorf("Key: %q, want %q", got, want)
	}
	if got, want := String(0, 1500, 0, la), "1500 a day from 00:00 America/Los_Angeles"; got != want {
		t.Errorf("String: %q, want %q", got, want)
	}
	if got, want := String(5, 15, 0, nil), "5/s burst 15"; got != want {
		t.Errorf("String: %q, want %q", got, want)
	}
}

// ParseKey reads back what Key writes: the time of day, to the
// nanosecond, and the zone.
func TestParseKey(t *testing.T) {
	la, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		t.Skip(err)
	}
	for _, tc := range []struct {
		at  time.Duration
		loc *time.Location
	}{
		{0, time.UTC},
		{23*time.Hour + 59*time.Minute, la},
		{7*time.Hour + 30*time.Second, la},
		{90*time.Second + 250*time.Millisecond, time.UTC},
		{time.Nanosecond, la},
	} {
		key := Key(tc.at, tc.loc)
		at, loc, err := ParseKey(key)
		if err != nil || at != tc.at || loc.String() != tc.loc.String() {
			t.Errorf("ParseKey(%q) = %v, %v, %v; want %v, %v", key, at, loc, err, tc.at, tc.loc)
		}
	}
	for _, bad := range []string{"", "d0000", "0000@UTC", "d00@UTC", "d2400@UTC", "dab00@UTC", "d0000x@UTC", "d0000@Nowhere.Land"} {
		if _, _, err := ParseKey(bad); err == nil {
			t.Errorf("ParseKey(%q): no error", bad)
		}
	}
}

// Count reads a key as daily.lua writes it: today's count, tomorrow's
// once today is spent, and nothing of a day that ended.
func TestCount(t *testing.T) {
	la, err := time.LoadLocation("America/Los_Angeles")
	if err != nil {
		t.Skip(err)
	}
	now := time.Date(2026, 3, 8, 12, 0, 0, 0, la) // a day of 23 hours
	end := time.Date(2026, 3, 9, 0, 0, 0, 0, la)
	next := time.Date(2026, 3, 10, 0, 0, 0, 0, la)
	const n = 1500
	w := float64(Unit(n))
	at := func(t time.Time, u float64) float64 { return float64(t.UnixMicro()) + u*w }
	for _, tc := range []struct {
		what            string
		v               float64
		today, tomorrow float64
	}{
		{"an empty key", 0, 0, 0},
		{"a day that ended", at(time.Date(2026, 3, 8, 0, 0, 0, 0, la), 700), 0, 0},
		{"today, 312 counted", at(end, 312), 312, 0},
		{"today spent", at(end, n), n, 0},
		{"tomorrow, 4 counted", at(next, 4), n, 4},
	} {
		today, tomorrow, ends := Count(tc.v, now, n, 0, la)
		if today != tc.today || tomorrow != tc.tomorrow || !ends.Equal(end) {
			t.Errorf("%s: %v, %v, %v; want %v, %v, %v", tc.what, today, tomorrow, ends, tc.today, tc.tomorrow, end)
		}
	}
}
