package quota

import (
	"context"
	_ "embed"
	"fmt"
	"strconv"
	"time"
)

//go:embed script.lua
var bucketSource string

// The operations of the bucket script.
const (
	opTake   = "take"
	opRefund = "refund"
	opProbe  = "probe"
)

// reply is the decoded reply of the bucket script.
type reply struct {
	granted bool
	wait    time.Duration
	tat     int64 // microseconds; identifies a take for its refund
}

// bucketCall runs op of the bucket script on the Redis key rkey and returns
// the reply and the number of Redis round trips it took. arg is the take's
// longest acceptable wait or the refund's tat, in microseconds.
func (l *Limiter) bucketCall(ctx context.Context, rkey, op string, lim Limit, n float64, arg int64) (reply, int, error) {
	cmd, trips := l.bucket.run(ctx, []string{rkey},
		op,
		strconv.FormatFloat(lim.Rate, 'g', -1, 64),
		strconv.FormatFloat(lim.Burst, 'g', -1, 64),
		strconv.FormatFloat(n, 'g', -1, 64),
		arg,
		l.now(),
	)
	if err := cmd.Err(); err != nil {
		return reply{}, trips, err
	}
	v, err := cmd.Int64Slice()
	if err != nil || len(v) != 3 {
		return reply{}, trips, fmt.Errorf("%w: unexpected reply %v", ErrScript, cmd.Val())
	}
	return reply{granted: v[0] == 1, wait: time.Duration(v[1]) * time.Microsecond, tat: v[2]}, trips, nil
}

// now returns the ARGV the script reads as the time: empty for the server's
// clock, the caller's clock in microseconds with WithClock.
func (l *Limiter) now() string {
	if l.cfg.clock == nil {
		return ""
	}
	return strconv.FormatInt(l.cfg.clock().UnixMicro(), 10)
}
