package control

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// The control record's reply is parsed strictly: a field that does not
// read as a number fails the read rather than passing as no control.
func TestControlRecordParsing(t *testing.T) {
	cmd := redis.NewCmd(context.Background())
	cmd.SetVal([]any{"1000000", "x", "1", "", "", "", "", "", "", "", "", "", "", "", ""})
	if _, err := Parse(cmd); err == nil {
		t.Error("an override rate of x parsed")
	}
	cmd.SetVal([]any{"1000000", "2", "4", "500000", "forever", "10 5", "3", "1700000.5", "900000", "operator", "800000", "5", "500000 0", "7 0 12", "950000 3 0 0 4 5 6"})
	r, err := Parse(cmd)
	if err != nil || !slices.Equal(r.Back, []int64{7, 0, 12}) || r.Until != -1 || r.Override == nil || *r.Override != (Limit{Rate: 2, Burst: 4}) || r.Seen == nil || r.Users != 3 || r.Tat != 1700000 ||
		r.changed != 900000 || r.Source != "operator" || r.pivot != 800000 || r.prev != 5 || r.during != (Pause{500000, 0}) ||
		r.PushAt != 950000 || !slices.Equal(r.Pushes, []int64{3, 0, 0, 4, 5, 6}) {
		t.Errorf("parsed %+v, %v", r, err)
	}
	cmd.SetVal([]any{"1000000", "", "", "500000", "forever", "", "", "", "", "", "", "", "", "0", ""})
	if _, err := Parse(cmd); err != nil {
		t.Errorf("a record of a pause alone: %v", err)
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", "", "", "", "", ""})
	if _, err := Parse(cmd); err == nil {
		t.Error("a reply of 14 fields parsed")
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", "", "", "", "", "1 x", ""})
	if _, err := Parse(cmd); err == nil {
		t.Error("a give-back of x parsed")
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", "", "", "", "", "0", "1 x"})
	if _, err := Parse(cmd); err == nil {
		t.Error("a push of x parsed")
	}
	// A record's times, whoever wrote them, stay within a century of the
	// server's clock, without overflowing a Duration.
	cmd.SetVal([]any{"1000000", "", "", "1", "9223372036854775807", "", "", "", "-9223372036854775808", "", "-9223372036854775808", "1", "", "", ""})
	r, err = Parse(cmd)
	if err != nil {
		t.Fatal(err)
	}
	sent := time.Now()
	st := r.state(sent)
	if end, _, paused := st.PausedAt(sent); !paused || end.Before(sent.Add(99*365*24*time.Hour)) {
		t.Errorf("a pause until the end of int64 µs: paused %v until %v, want a century on", paused, end)
	}
	if st.pivot.After(sent) || st.pivot.Before(sent.Add(-101*365*24*time.Hour)) {
		t.Errorf("a pivot at the start of int64 µs read as %v", st.pivot)
	}
}
