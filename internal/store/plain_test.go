package store

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/redisx"
)

// plain.lua serves the takes it serves as script.lua would: random calls
// of one to five plain callers on buckets of one layer, whose record holds
// an anchor and the timeline's count, and an ended pause, or a pause in
// force, classes or an override (which plain.lua leaves to script.lua),
// reply the same and leave the same layer with the take's script as
// without plain.lua.
func TestPlainTakeAgreesWithTheScript(t *testing.T) {
	rdb := redistest.Start(t).Client(t)
	ctx := context.Background()
	var general []string // the take's parts but plain.lua
	for _, p := range takeParts {
		if p != "plain.lua" {
			general = append(general, p)
		}
	}
	// Each take replies its reply, then its layer and the layer's time
	// to live as it leaves them (the key expires on the server's clock),
	// then how long the call took, in ms, by which the time to live may
	// differ on a loaded machine.
	wrap := func(src string) *redisx.Script {
		return redisx.NewScript(rdb, "local function take(KEYS, ARGV)\n"+src+"\nend\n"+
			"local t0 = redis.call('TIME')\n"+
			"local r = {take(KEYS, ARGV), redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1])}\n"+
			"local t1 = redis.call('TIME')\n"+
			"if #r == 3 then r[4] = math.ceil(((t1[1] - t0[1]) * 1000000 + t1[2] - t0[2]) / 1000) end\n"+
			"return r")
	}
	full, without := wrap(takeSource), wrap(join(general))
	r := rand.New(rand.NewPCG(7, 11))
	limits := [][2]string{{"10", "1"}, {"3", "5"}, {"1000000", "1000000000"}, {"0.7", "2"}}
	waits := []string{"0", "1000", "150000", "5000000"}
	amounts := []string{"1", "1", "2", "0.5", "0", "3"}
	for seq := range 40 {
		lim := limits[seq%len(limits)]
		keys := func(name string) []string {
			key := fmt.Sprintf("quota:{plain-%s-%d}", name, seq)
			return []string{key, key + ":ctl"}
		}
		a, b := keys("a"), keys("b")
		now := int64(1_700_000_000_000_000) + r.Int64N(1_000_000)
		record := []any{"seen", lim[0] + " " + lim[1], "a:", "1700000000000000 3 0.5", "ev", "4"}
		switch seq % 5 {
		case 1: // a pause that has ended
			record = append(record, "since", strconv.FormatInt(now-5e6, 10), "until", strconv.FormatInt(now-4e6, 10), "shifted", "1000000")
		case 2: // a pause in force
			record = append(record, "since", strconv.FormatInt(now-1e5, 10), "until", strconv.FormatInt(now+3e5, 10), "shifted", "0")
		case 3: // a priority class took from the bucket
			record = append(record, "pmax", "1", "t1:", strconv.FormatInt(now, 10), "p0:", "0")
		case 4: // an operator's override
			record = append(record, "rate", "4", "burst", "2")
		}
		var err error
		for _, ks := range [][]string{a, b} {
			if err = rdb.HSet(ctx, ks[1], record...).Err(); err != nil {
				t.Fatal(err)
			}
		}
		for step := range 30 {
			args := []any{"take", strconv.FormatInt(now, 10), "plain", ""}
			for range 1 + r.IntN(5) {
				args = append(args, waits[r.IntN(len(waits))], amounts[r.IntN(len(amounts))])
			}
			args = append(args, lim[0], lim[1])
			got, _ := full.Run(ctx, a, args...)
			want, _ := without.Run(ctx, b, args...)
			g, _ := got.Val().([]any)
			v, _ := want.Val().([]any)
			if len(g) == 4 && len(v) == 4 {
				// The time to live, in ms, is read a moment after the
				// SET that gave it, within the call.
				if d, slack := g[2].(int64)-v[2].(int64), 1+g[3].(int64)+v[3].(int64); d >= -slack && d <= slack {
					g[2] = v[2]
				}
				g, v = g[:3], v[:3]
			}
			if g, w := fmt.Sprint(g, got.Err()), fmt.Sprint(v, want.Err()); len(g) > 0 && g != w {
				t.Fatalf("sequence %d, step %d, ARGV %v: reply, layer and its ttl %v, want %v", seq, step, args, g, w)
			}
			if len(v) != 3 {
				continue // an error: neither wrote anything
			}
			// The next step starts from the same layer in both, however
			// long the server took meanwhile: the keys expire on its own
			// clock, not the callers'.
			layer, _ := v[1].(string)
			for _, key := range []string{a[0], b[0]} {
				if layer != "" {
					err = rdb.Set(ctx, key, layer, 0).Err()
				} else {
					err = rdb.Del(ctx, key).Err()
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			now += r.Int64N(300_000)
		}
	}
}
