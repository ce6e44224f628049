package store

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/redistest"
)

// timelineCases are sequences of what moves a bucket's queue, each run on a
// real server by TestTimelineAgreesWithTheScript. A step is "take N" (N
// takes of one token), "wait D", "pause D" (a provider's), "hold D" or
// "hold forever" (an operator's), "resume", "limit RATE BURST", "clear",
// or "give N" (a settle that gives N tokens back).
var timelineCases = [][]string{
	{"take 6", "pause 1s", "wait 1.5s", "pause 1s"},
	{"take 6", "pause 1s", "wait 300ms", "pause 2s", "wait 100ms", "pause 500ms"},
	{"take 6", "hold forever", "wait 500ms", "resume", "take 2", "hold forever", "wait 200ms", "resume"},
	{"take 6", "hold 2s", "wait 500ms", "limit 5 1", "wait 100ms", "hold 2s"},
	{"take 6", "limit 20 1", "wait 100ms", "clear", "take 3", "limit 4 2"},
	{"take 6", "pause 1s", "give 2", "wait 1.2s", "give 1"},
	{"take 6", "give 2", "limit 5 1", "give 1", "take 2", "pause 1s", "clear"},
	{"take 6", "hold forever", "give 3", "wait 300ms", "resume", "give 1"},
	{"take 4", "hold 1s", "wait 200ms", "resume", "limit 2 1", "take 2", "hold 300ms"},
}

// TestTimelineAgreesWithTheScript runs each of timelineCases on a real
// server with a clock of its own and checks, after every step, that the
// timeline the record replies (Anchor, the Go side) puts the
// bucket's last grant where the script's own queue has it: its due time,
// the layer's tat less its full time. Right after a take, the position
// the script replied is the one Go finds from the anchor.
func TestTimelineAgreesWithTheScript(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for ci, steps := range timelineCases {
		t.Run(strconv.Itoa(ci), func(t *testing.T) {
			var now atomic.Int64
			now.Store(time.Now().Truncate(time.Second).UnixNano())
			s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
			b := New("quota:", fmt.Sprintf("timeline-%d", ci), []Limit{{Rate: 10, Burst: 1}})
			ctl := b.Call[len(b.Call)-1]
			if err := rdb.HSet(ctx, ctl, "seen", "10 1").Err(); err != nil { // as the Limiters' reads write it
				t.Fatal(err)
			}
			read := func() Record {
				t.Helper()
				r, err := s.Record(ctx, b.Keys, RecordOp{Op: "read", ID: "test", Limit: Limit{Rate: 10, Burst: 1}})
				if err != nil {
					t.Fatal(err)
				}
				return r
			}
			record := func(op RecordOp) {
				t.Helper()
				if _, err := s.Record(ctx, b.Keys, op); err != nil {
					t.Fatal(err)
				}
			}
			var last Grant // the bucket's last grant
			for _, step := range steps {
				f := strings.Fields(step)
				switch f[0] {
				case "take":
					n, _ := strconv.Atoi(f[1])
					for range n {
						g, err := s.takeOne(ctx, b, Tokens(1), time.Hour)
						if err != nil || !g.Granted() {
							t.Fatalf("%s: %+v, %v", step, g, err)
						}
						if g.Wait > 0 {
							last = g
							due := g.Now + g.Wait.Microseconds()
							a := read().Anchors[0]
							if p := a.Position(due); math.Abs(p-g.Pos[0]) > 1 {
								t.Errorf("%s: the script replied position %v, Go finds %v from %+v", step, g.Pos[0], p, a)
							}
						}
					}
				case "wait":
					d, _ := time.ParseDuration(f[1])
					now.Add(int64(d))
				case "pause":
					d, _ := time.ParseDuration(f[1])
					if err := s.Pause(ctx, b, d); err != nil {
						t.Fatal(err)
					}
				case "hold":
					d := Forever
					if f[1] != "forever" {
						d, _ = time.ParseDuration(f[1])
					}
					record(RecordOp{Op: "hold", Hold: d})
				case "resume":
					record(RecordOp{Op: "resume"})
				case "limit":
					rate, _ := strconv.ParseFloat(f[1], 64)
					burst, _ := strconv.ParseFloat(f[2], 64)
					record(RecordOp{Op: "limit", Limit: Limit{Rate: rate, Burst: burst}})
				case "clear":
					record(RecordOp{Op: "clear"})
				case "give":
					n, _ := strconv.ParseFloat(f[1], 64)
					if err := s.Adjust(ctx, b, Cost{N: -n}, ""); err != nil {
						t.Fatal(err)
					}
				default:
					t.Fatalf("a step %q", step)
				}
				if last.Pos == nil {
					continue
				}
				r := read()
				if r.Ev < last.Ev {
					t.Fatalf("%s: the record's count %d is behind the take's %d", step, r.Ev, last.Ev)
				}
				rate, burst := 10.0, 1.0
				if r.Override != nil {
					rate, burst = r.Override.Rate, r.Override.Burst
				}
				tat, err := rdb.Get(ctx, b.Keys[0]).Float64()
				if err != nil {
					continue // the layer is full: no grant is pending
				}
				script := int64(tat - burst/rate*1e6) // the tail's due time, as the script has it
				forever := r.Since != 0 && r.Until == -1
				if script <= r.Now && !forever {
					continue // no longer pending
				}
				goDue := r.Anchors[0].Due(last.Pos[0])
				if forever {
					if goDue < r.Since {
						t.Errorf("%s: under a pause with no end since %d, the last grant falls due at %d", step, r.Since, goDue)
					}
					continue
				}
				if d := goDue - script; d < -2 || d > 2 {
					t.Errorf("%s: the timeline has the last grant due at %+dµs from now, the script at %+dµs (anchor %+v, position %v)",
						step, goDue-r.Now, script-r.Now, r.Anchors[0], last.Pos[0])
				}
			}
		})
	}
}

// TestFullLayerThroughAPauseWithNoEnd: a layer that is full when a pause
// with no end begins, its key gone, owes nothing when the pause ends or
// its Limit changes meanwhile: the first take after the resume is granted
// at once, as after a pause of any length.
func TestFullLayerThroughAPauseWithNoEnd(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	ctx := context.Background()
	for _, between := range [][]RecordOp{nil, {{Op: "limit", Limit: Limit{Rate: 5, Burst: 5}}}} {
		var now atomic.Int64
		now.Store(time.Now().Truncate(time.Second).UnixNano())
		s := NewStore(rdb, Options{Clock: func() time.Time { return time.Unix(0, now.Load()) }})
		b := New("quota:", fmt.Sprintf("full-%d", len(between)), []Limit{{Rate: 10, Burst: 5}})
		record := func(op RecordOp) {
			t.Helper()
			if _, err := s.Record(ctx, b.Keys, op); err != nil {
				t.Fatal(err)
			}
		}
		record(RecordOp{Op: "read", ID: "test", Limit: Limit{Rate: 10, Burst: 5}})
		if g, err := s.takeOne(ctx, b, Tokens(1), time.Hour); err != nil || g.Wait != 0 {
			t.Fatalf("the first take: %+v, %v", g, err)
		}
		// Full again a second later, when the key expires (on the
		// server's clock, which the test's does not move).
		now.Add(int64(time.Second))
		if err := rdb.Del(ctx, b.Keys[0]).Err(); err != nil {
			t.Fatal(err)
		}
		record(RecordOp{Op: "hold", Hold: Forever})
		for _, op := range between {
			now.Add(int64(time.Second))
			record(op)
		}
		now.Add(int64(3 * time.Second))
		record(RecordOp{Op: "resume"})
		g, err := s.takeOne(ctx, b, Tokens(1), time.Hour)
		if err != nil || !g.Granted() || g.Wait != 0 {
			t.Errorf("%v: the first take after the resume of a full layer: %+v, %v; want it granted at once", between, g, err)
		}
	}
}
