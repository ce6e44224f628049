package quota

import (
	"context"
	"fmt"
	"maps"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/store"
)

// Helpers shared by the package's tests.

// newMini starts a miniredis and returns it with a client and the client's
// command counter.
func newMini(t *testing.T) (*miniredis.Miniredis, *redis.Client, *cmdCounter) {
	t.Helper()
	mr := miniredis.RunT(t)
	rdb := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { rdb.Close() })
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	return mr, rdb, cmds
}

// cmdCounter is a go-redis hook that counts the commands a client sends,
// pipelined or not, by name ("evalsha", "eval", "script load", ...).
type cmdCounter struct {
	mu  sync.Mutex
	n   map[string]int
	ops map[string]int // the scripts' calls by operation (their ARGV[1])
}

func newCmdCounter() *cmdCounter { return &cmdCounter{n: map[string]int{}, ops: map[string]int{}} }

func (c *cmdCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *cmdCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.count(cmd)
		return next(ctx, cmd)
	}
}

func (c *cmdCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			c.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (c *cmdCounter) count(cmd redis.Cmder) {
	name := cmd.Name()
	switch name {
	case "hello", "client", "auth", "select", "readonly":
		return // setting up a connection
	}
	args := cmd.Args()
	if name == "script" && len(args) > 1 {
		name += " " + strings.ToLower(fmt.Sprint(args[1]))
	}
	if (name == "evalsha" || name == "eval") && len(args) > 3 && isRecordOp(args) {
		// A read of the control record (see controlReads), or its EVAL
		// fallback after NOSCRIPT.
		name = strings.TrimSuffix("control "+name, " evalsha")
	}
	op := scriptOp(cmd)
	c.mu.Lock()
	c.n[name]++
	if op != "" {
		c.ops[op]++
	}
	c.mu.Unlock()
}

// byOp returns the scripts' calls by operation.
func (c *cmdCounter) byOp() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.ops)
}

// isRecordOp tells whether the arguments of an EVALSHA or EVAL are a
// record operation (internal/store's record.lua): a read of the control record,
// or an operator's change to it.
func isRecordOp(args []any) bool {
	numkeys, err := strconv.Atoi(fmt.Sprint(args[2]))
	if err != nil || len(args) <= 3+numkeys || !strings.HasSuffix(fmt.Sprint(args[2+numkeys]), control.Suffix) {
		return false
	}
	switch fmt.Sprint(args[3+numkeys]) {
	case "read", "status", "limit", "clear", "hold", "resume":
		return true
	}
	return false
}

// get returns how many commands named name were sent.
func (c *cmdCounter) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n[name]
}

// total returns how many commands were sent, the control records' reads
// aside: a Limiter reads a bucket's record when it first uses it and once
// a second after, never per decision, and TestControlReadsAreBounded
// counts them.
func (c *cmdCounter) total() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for name, v := range c.n {
		if name != "control" && name != "control eval" {
			n += v
		}
	}
	return n
}

func (c *cmdCounter) reset() {
	c.mu.Lock()
	defer c.mu.Unlock()
	clear(c.n)
	clear(c.ops)
}

func (c *cmdCounter) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	var parts []string
	for name, v := range c.n {
		parts = append(parts, fmt.Sprintf("%s=%d", name, v))
	}
	slices.Sort(parts)
	return strings.Join(parts, " ")
}

// eventually polls cond every millisecond until it holds, and fails the
// test when it does not within d. It returns how long it took.
func eventually(t testing.TB, d time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > d {
			t.Fatalf("timed out after %v waiting for %s", d, what)
		}
		time.Sleep(time.Millisecond)
	}
	return time.Since(start)
}

// waitForMode waits up to d for l to be in mode m and returns how long it
// took.
func waitForMode(t testing.TB, l *Limiter, m Mode, d time.Duration) time.Duration {
	t.Helper()
	return eventually(t, d, "mode "+m.String(), func() bool { return l.Mode() == m })
}

// Grant instants. A take's reply says when the script granted its tokens,
// in the clock the script read (the server's, the same as this machine's,
// unless WithClock), to the microsecond: the exactness of the limiter,
// apart from when the caller happened to wake up.

// dueKey marks an acquisition's context with the *dueRecord that dueHook
// fills in.
type dueKey struct{}

// dueRecord is what dueHook learned of an acquisition's granted take.
type dueRecord struct {
	Due     time.Time     // when the script granted the tokens; zero before a granted take
	Waited  bool          // the reply carried a wait, and Due follows from its tats
	Wait    time.Duration // the wait the reply reported
	Sent    time.Time     // when the take was sent
	Replied time.Time     // and when its reply arrived
	Now     time.Time     // the script's now, when the take carried the caller's clock (WithClock)
	Behind  time.Duration // how far the clock the script read runs behind this machine's; the caller sets it
	Asked   time.Time     // when the caller asked, if later than the swarm's call (workerSpec.Rest)

	granted chan struct{} // closed at the first granted take
}

// withDueRecord returns ctx marked with a new dueRecord, for dueHook.
func withDueRecord(ctx context.Context) (context.Context, *dueRecord) {
	rec := &dueRecord{granted: make(chan struct{})}
	return context.WithValue(ctx, dueKey{}, rec), rec
}

// dueRecordOf returns the dueRecord ctx is marked with, or nil.
func dueRecordOf(ctx context.Context) *dueRecord {
	rec, _ := ctx.Value(dueKey{}).(*dueRecord)
	return rec
}

// setDue records a grant at due; the first closes rec.granted.
func (rec *dueRecord) setDue(due time.Time, waited bool, wait time.Duration) {
	rec.Due, rec.Waited, rec.Wait = due, waited, wait
	select {
	case <-rec.granted:
	default:
		close(rec.granted)
	}
}

// dueHook is a go-redis hook that works out, from the reply of each take
// made under a context marked by withDueRecord, when the script granted
// the tokens (see takeDues), and records it there. A call that serves
// several callers' takes carries their contexts (callersKey), and each
// caller's record gets its own part of the reply. The hook runs in the
// goroutine that makes the call, before any caller sees the reply.
type dueHook struct{}

func (dueHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (dueHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		callers, _ := ctx.Value(store.CallersKey{}).([]context.Context)
		if callers == nil {
			callers = []context.Context{ctx}
		}
		recs := make([]*dueRecord, len(callers))
		marked := false
		for i, c := range callers {
			recs[i] = dueRecordOf(c)
			marked = marked || recs[i] != nil
		}
		if !marked {
			return next(ctx, cmd)
		}
		sent := time.Now()
		err := next(ctx, cmd)
		replied := time.Now()
		if err != nil {
			return err
		}
		tks := takeDues(cmd, sent)
		if len(tks) != len(recs) {
			return err
		}
		for i, rec := range recs {
			if rec != nil && tks[i].granted {
				tk := tks[i]
				rec.Sent, rec.Replied, rec.Now = sent, replied, tk.now
				rec.setDue(tk.due, tk.waited, tk.wait)
			}
		}
		return err
	}
}

func (dueHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// takeGrant is what a take's command and reply say of one caller's take.
type takeGrant struct {
	granted bool          // false for a refusal
	due     time.Time     // when the script granted the tokens
	wait    time.Duration // the wait the reply reported
	waited  bool          // the reply carried a wait, and due follows from its tats
	now     time.Time     // the caller's clock the take carried (WithClock), or zero
}

// takeDues returns what a take's command and reply say of each caller's
// take, in order: one for a take of its own, one a caller for a batch; nil
// for any other command. sent is when the command was sent.
//
// A take that waits replies {1, wait, tat_1, ..., tat_k}: tat_i is layer
// i's new theoretical arrival time, max(old tat_i, now) + n/rate_i. Layer
// i holds burst_i tokens again at tat_i less burst_i/rate_i. The layer
// that sets the wait had its old tat beyond the grant instant g, so g =
// tat_i - burst_i/rate_i for it, and for every other layer
// tat_j - burst_j/rate_j <= g (its own wait is no longer). So g is the
// largest tat_i - burst_i/rate_i: found here to within the microsecond to
// which the script floors the tats, never later. A batch replies such a
// table for each caller, one after another.
//
// A take granted at once replies 0 alone (a batch: 0 when every caller
// was, or a wait of 0 in its part), and g is the script's now, which the
// reply does not give. It is the caller's clock in ARGV[2] when the take
// carries one (WithClock); otherwise the server read its clock after the
// take was sent, and sent, never later, stands in for it.
func takeDues(cmd redis.Cmder, sent time.Time) []takeGrant {
	k, callers, argv, ok := takeCall(cmd)
	c, isCmd := cmd.(*redis.Cmd)
	if !ok || !isCmd {
		return nil
	}
	var now time.Time
	if s := fmt.Sprint(argv[1]); s != "" {
		us, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return nil
		}
		now = time.UnixMicro(us)
	}
	atOnce := takeGrant{granted: true, due: sent, now: now}
	if !now.IsZero() {
		atOnce.due = now
	}
	out := make([]takeGrant, callers)
	switch v := c.Val().(type) {
	case int64:
		if v != 0 {
			return nil
		}
		for i := range out {
			out[i] = atOnce
		}
		return out
	case []any:
		stride := 2 + 2*k                                                 // and the positions
		if rest := len(v) - stride*callers; rest < 2 || (rest-2)%k != 0 { // the timeline's count and now, and the pushes
			return nil
		}
		for j := range out {
			r := v[j*stride : (j+1)*stride]
			w, _ := r[1].(int64)
			switch {
			case r[0] != int64(1):
				continue // refused
			case w == 0 && callers > 1:
				out[j] = atOnce
				continue
			}
			tk := takeGrant{granted: true, now: now}
			for i := range k {
				tat, okTat := r[2+i].(int64)
				limits := len(argv) - 2*k // the layers' rates and bursts (script.lua)
				rate, err1 := strconv.ParseFloat(fmt.Sprint(argv[limits+2*i]), 64)
				burst, err2 := strconv.ParseFloat(fmt.Sprint(argv[limits+2*i+1]), 64)
				if !okTat || err1 != nil || err2 != nil {
					return nil
				}
				full := time.Duration(math.Round(burst / rate * float64(time.Second)))
				if g := time.UnixMicro(tat).Add(-full); i == 0 || g.After(tk.due) {
					tk.due = g
				}
			}
			tk.wait, tk.waited = time.Duration(w)*time.Microsecond, true
			out[j] = tk
		}
		return out
	}
	return nil
}

// takeCall reads the command of a take, as script.lua lays out its
// ARGV: the layers it takes from, the callers it serves and its ARGV; ok
// is false for any other command.
func takeCall(cmd redis.Cmder) (k, callers int, argv []any, ok bool) {
	if n := cmd.Name(); n != "evalsha" && n != "eval" {
		return 0, 0, nil, false
	}
	args := cmd.Args() // evalsha, sha, numkeys, keys..., argv...
	if len(args) < 3 {
		return 0, 0, nil, false
	}
	numkeys, err := strconv.Atoi(fmt.Sprint(args[2]))
	k = numkeys - 1 // the layers; the control record's key comes last
	if err != nil || k < 1 || len(args) < 3+numkeys+4 || fmt.Sprint(args[3+numkeys]) != "take" {
		return 0, 0, nil, false
	}
	argv = args[3+numkeys:]
	stride := map[string]int{"plain": 1 + k, "class": 3 + k, "tenant": 6 + k}[fmt.Sprint(argv[2])]
	if stride == 0 || (len(argv)-4-2*k)%stride != 0 || len(argv)-4-2*k < stride {
		return 0, 0, nil, false
	}
	return k, (len(argv) - 4 - 2*k) / stride, argv, true
}

// takeReplies returns the reply of a take for each caller it served, in
// order, each as a take of its own would have it: the reply itself for a
// take of one caller; for a batch, each caller's part of the reply, or
// the integer 0 for each when the batch replied 0. It returns nil for any
// other command or reply.
func takeReplies(cmd *redis.Cmd) []any {
	k, callers, _, ok := takeCall(cmd)
	if !ok {
		return nil
	}
	out := make([]any, callers)
	switch v := cmd.Val().(type) {
	case int64:
		for i := range out {
			out[i] = v
		}
		return out
	case []any:
		stride := 2 + 2*k                                                 // and the positions
		if rest := len(v) - stride*callers; rest < 2 || (rest-2)%k != 0 { // the timeline's count and now, and the pushes
			return nil
		}
		for i := range out {
			out[i] = v[i*stride : (i+1)*stride]
		}
		return out
	}
	return nil
}

// stoppedClock is a clock for WithClock that moves only when told to, so
// that a bucket accrues nothing while the machine is slow.
type stoppedClock struct {
	mu  sync.Mutex
	now time.Time
}

func newStoppedClock() *stoppedClock { return &stoppedClock{now: time.Now()} }

func (c *stoppedClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *stoppedClock) advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

// setProbeIdle makes the Limiters made until the test ends stop their
// breaker's probe after d without a request.
func setProbeIdle(t *testing.T, d time.Duration) {
	old := probeIdle
	probeIdle = d
	t.Cleanup(func() { probeIdle = old })
}
