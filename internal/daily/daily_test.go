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
