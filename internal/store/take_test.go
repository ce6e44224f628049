package store

import (
	"fmt"
	"testing"
	"time"
)

// The take's ARGV are where script.lua's header names them, whatever the
// callers' form: the slots' script (internal/slots) reads a take's clock
// from ARGV[2], its first caller's longest wait from ARGV[5] and its class
// from ARGV[6], and the layers' Limits are the last 2k.
func TestTakeArgsNamedSlots(t *testing.T) {
	s := NewStore(nil, Options{Channel: "ch", Clock: func() time.Time { return time.UnixMicro(42) }})
	b := New("quota:", "args", []Limit{{Rate: 10, Burst: 5}, {Rate: 100, Burst: 50}})
	for _, tc := range []struct {
		n    Cost
		form string
		argv []any // after the header
	}{
		{Tokens(2), "plain", []any{int64(7), "2", "2"}},
		{Cost{Each: []float64{1, 3}, Class: 2, Shares: []float64{0.25, 0, 0.5}}, "class", []any{int64(7), 2, "0.25 0", "1", "3"}},
		{Cost{N: 1, Class: 1, Tenant: "t", Weight: 2, TenantCap: 3, Since: 9}, "tenant", []any{int64(7), 1, "", "t", "2", 3, int64(9), "1", "1"}},
	} {
		args := s.takeArgs(b, caller{tc.n, 7 * time.Microsecond})
		want := append([]any{"take", "42", tc.form, ""}, tc.argv...)
		if tc.n.Class > 0 {
			want[takeChannel] = "ch"
		}
		want = append(want, "10", "5", "100", "50")
		if got := fmt.Sprintf("%#v", args); got != fmt.Sprintf("%#v", want) {
			t.Errorf("a take of %+v: ARGV %v, want %v", tc.n, args, want)
		}
	}
	if takeNow != 1 || takeCallers != 4 {
		t.Errorf("the take's clock is ARGV[%d] and its first caller's wait ARGV[%d], want ARGV[2] and ARGV[5]", takeNow+1, takeCallers+1)
	}
}

func TestCostTimeAndTatsMoved(t *testing.T) {
	b := New("quota:", "t", []Limit{{Rate: 10, Burst: 5}, {Rate: 1, Burst: 5}})
	if d := b.CostTime(Tokens(2)); d != 2*time.Second {
		t.Errorf("2 tokens take %v at the slowest layer's 1/s, want 2s", d)
	}
	if d := b.CostTime(Cost{Each: []float64{3, 0}}); d != 300*time.Millisecond {
		t.Errorf("3 of the first layer alone take %v, want 300ms", d)
	}
	g := Grant{Tats: []int64{100, 200}}
	if moved := g.TatsMoved(time.Millisecond); moved[0] != 1100 || moved[1] != 1200 || g.Tats[0] != 100 {
		t.Errorf("tats moved by 1ms: %v (the grant's now %v)", moved, g.Tats)
	}
	if moved := (Grant{}).TatsMoved(time.Second); moved != nil {
		t.Errorf("a grant without tats moved to %v", moved)
	}
}
