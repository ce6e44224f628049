package slots

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redisx"
)

// acquireReply decodes the reply to an acquire or a try: whether the slot
// was granted, with the grant of its take, or how long until the first
// lease held ends.
func acquireReply(cmd *redis.Cmd) (granted bool, hint time.Duration, taken Taken, err error) {
	v, err := cmd.Slice()
	if err != nil {
		return false, 0, nil, err
	}
	if len(v) < 2 {
		return false, 0, nil, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	code, ok1 := v[0].(int64)
	us, ok2 := v[1].(int64)
	if !ok1 || !ok2 {
		return false, 0, nil, fmt.Errorf("%w: %v", redisx.ErrReply, v)
	}
	if code != 1 {
		return false, time.Duration(us) * time.Microsecond, nil, nil
	}
	if len(v) > 2 {
		g, _ := v[2].(string)
		if taken, err = parseTaken(g); err != nil {
			return false, 0, nil, err
		}
	}
	return true, 0, taken, nil
}

// parseTaken decodes a grant as the slot script writes it: integers joined
// by commas, nil for "".
func parseTaken(g string) (Taken, error) {
	if g == "" {
		return nil, nil
	}
	parts := strings.Split(g, ",")
	taken := make(Taken, len(parts))
	for i, p := range parts {
		v, err := strconv.ParseInt(p, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("%w: grant %q", redisx.ErrReply, g)
		}
		taken[i] = v
	}
	return taken, nil
}

// renewReply decodes the reply to a renewal of ids, the first holders of
// them holders: the hint and the states, and the grants of the waiters
// that hold a slot, in order.
func renewReply(reply []any, ids, holders int) (v []int64, grants []Taken, err error) {
	if len(reply) < 1+ids {
		return nil, nil, fmt.Errorf("%w: %d states for %d ids", redisx.ErrReply, len(reply)-1, ids)
	}
	v = make([]int64, 1+ids)
	handed := 0
	for i := range v {
		x, ok := reply[i].(int64)
		if !ok {
			return nil, nil, fmt.Errorf("%w: %v", redisx.ErrReply, reply)
		}
		v[i] = x
		if i > holders && x == slotHolds {
			handed++
		}
	}
	if len(reply) != 1+ids+handed {
		return nil, nil, fmt.Errorf("%w: %d grants for %d hand-offs", redisx.ErrReply, len(reply)-1-ids, handed)
	}
	for _, r := range reply[1+ids:] {
		g, _ := r.(string)
		t, err := parseTaken(g)
		if err != nil {
			t = nil
		}
		grants = append(grants, t)
	}
	return v, grants, nil
}
