package store

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// The control record's reply is parsed strictly: a field that does not
// read as a number fails the read rather than passing as no control.
func TestRecordParsing(t *testing.T) {
	cmd := redis.NewCmd(context.Background())
	cmd.SetVal([]any{"1000000", "x", "1", "", "", "", "", "", "", "", ""})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("an override rate of x parsed")
	}
	cmd.SetVal([]any{"1000000", "2", "4", "500000", "forever", "10 5", "operator", "9", "800000 12.5 2,0 0 1", "950000 3 0 0 4 5 6", " 12.5"})
	r, err := ParseRecord(cmd)
	if err != nil || r.Until != -1 || r.Override == nil || *r.Override != (Limit{Rate: 2, Burst: 4}) || r.Seen == nil ||
		r.Source != "operator" || r.Ev != 9 || !slices.Equal(r.Anchors, []Anchor{{800000, 12.5, 2}, {0, 0, 1}}) ||
		r.PushAt != 950000 || !slices.Equal(r.Pushes, []int64{3, 0, 0, 4, 5, 6}) || !slices.Equal(r.Learned, []float64{0, 12.5}) {
		t.Errorf("parsed %+v, %v", r, err)
	}
	cmd.SetVal([]any{"1000000", "", "", "500000", "forever", "", "", "0", "0 0 1", "", ""})
	if _, err := ParseRecord(cmd); err != nil {
		t.Errorf("a record of a pause alone: %v", err)
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "", "", ""})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("a reply of 10 fields parsed")
	}
	for _, anchor := range []string{"1 x 1", "1 2", "1 2 0", "1 2 -1", "1 2 Inf", "NaN 0 1"} {
		cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "1", anchor, "", ""})
		if _, err := ParseRecord(cmd); err == nil {
			t.Errorf("an anchor of %q parsed", anchor)
		}
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "0", "0 0 1", "1 x", ""})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("a push of x parsed")
	}
	cmd.SetVal([]any{"1000000", "", "", "", "", "", "", "0", "0 0 1", "", "5 x"})
	if _, err := ParseRecord(cmd); err == nil {
		t.Error("a learned rate of x parsed")
	}
}

// The record keeps what each layer granted by second, from the reads of
// Limiters that tell of their seconds late, out of order and more than
// the history apart: a second is added to, a later one moves the others
// back, one beyond the history is dropped, and zeros are not kept.
func TestRecordTally(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	s := NewStore(rdb, Options{})
	ctx := context.Background()
	b := New("quota:", "tally", []Limit{{Rate: 10, Burst: 5}, {Rate: 100, Burst: 50}})
	read := func(grants string) {
		t.Helper()
		if _, err := s.Record(ctx, b.Keys, RecordOp{Op: "read", ID: "a", Limit: b.Lims[0], Layers: ":100/50", Grants: grants}); err != nil {
			t.Fatal(err)
		}
	}
	field := func(sfx string) string { return rdb.HGet(ctx, b.Keys[0]+ControlSuffix, "h:"+sfx).Val() }
	for _, c := range []struct {
		grants      string
		first, next string
	}{
		{"100 1 2", "100 1", "100 2"},
		{"100 1 0,101 2.5 0", "101 2.5 2", "100 2"},                // added to; a later second; a zero kept out
		{"98 3 3", "101 2.5 2 0 3", "100 2 0 3"},                   // an earlier one
		{"200 1 1", "200 1", "200 1"},                              // the others beyond the history
		{"137 5 0", "200 1" + strings.Repeat(" 0", 62) + " 5", ""}, // the oldest second kept
		{"136 7 0,201 1 0", "201 1 1", ""},                         // one beyond it; a later second moves the oldest out
	} {
		read(c.grants)
		if got := field(""); got != c.first {
			t.Errorf("after %q: the first layer's history %q, want %q", c.grants, got, c.first)
		}
		if c.next != "" {
			if got := field(":100/50"); got != c.next {
				t.Errorf("after %q: the second layer's history %q, want %q", c.grants, got, c.next)
			}
		}
	}
}
