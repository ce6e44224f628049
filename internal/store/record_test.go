package store

import (
	"context"
	"slices"
	"testing"

	"github.com/redis/go-redis/v9"
)

// The control record's reply is parsed strictly: a field that does not
// read as a number fails the read rather than passing as no control.
func TestRecordParsing(t *testing.T) {
	cmd := redis.NewCmd(context.Background())
	cmd.SetVal([]any{"1000000", "x", "1", "", "", "", "", "", "", "", "", ""})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("an override rate of x parsed")
	}
	cmd.SetVal([]any{"1000000", "2", "4", "500000", "forever", "10 5", "3", "1700000.5", "operator", "9", "800000 12.5 2,0 0 1", "950000 3 0 0 4 5 6"})
	r, err := ParseRecord(cmd)
	if err != nil || r.Until != -1 || r.Override == nil || *r.Override != (Limit{Rate: 2, Burst: 4}) || r.Seen == nil || r.Users != 3 || r.Tat != 1700000 ||
		r.Source != "operator" || r.Ev != 9 || !slices.Equal(r.Anchors, []Anchor{{800000, 12.5, 2}, {0, 0, 1}}) ||
		r.PushAt != 950000 || !slices.Equal(r.Pushes, []int64{3, 0, 0, 4, 5, 6}) {
		t.Errorf("parsed %+v, %v", r, err)
	}
	cmd.SetVal([]any{"1000000", "", "", "500000", "forever", "", "", "", "", "0", "0 0 1", ""})
	if _, err := ParseRecord(cmd); err != nil {
		t.Errorf("a record of a pause alone: %v", err)
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", "", ""})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("a reply of 11 fields parsed")
	}
	for _, anchor := range []string{"1 x 1", "1 2", "1 2 0", "1 2 -1", "1 2 Inf", "NaN 0 1"} {
		cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", "1", anchor, ""})
		if _, err := ParseRecord(cmd); err == nil {
			t.Errorf("an anchor of %q parsed", anchor)
		}
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", "0", "0 0 1", "1 x"})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("a push of x parsed")
	}
}
