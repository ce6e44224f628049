package quota

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/redistest"
)

// llmMeters are three limits of one provider, as an LLM API meters them,
// slow enough that any shortfall is a wait of seconds.
var llmMeters = []Meter{
	{Name: "requests", Limit: Limit{Rate: 10, Burst: 10}},
	{Name: "input_tokens", Limit: Limit{Rate: 100, Burst: 1000}},
	{Name: "output_tokens", Limit: Limit{Rate: 50, Burst: 500}},
}

// TestReserveMeters: a reservation takes its own amount from each meter
// in one script call, all or nothing; a meter it asks nothing of does not
// hold it; a settle gives back what the reservation overcounted, in one
// call, once; a cancel gives back everything. On a stopped clock, a
// reservation with a 100 ms deadline is granted when every meter it asks
// of holds its amount, and refused at once, taking nothing, otherwise.
func TestReserveMeters(t *testing.T) {
	srv := redistest.Start(t)
	rdb := srv.Client(t)
	cmds := newCmdCounter()
	rdb.AddHook(cmds)
	clock := newStoppedClock()
	l := NewLimiter(rdb, WithClock(clock.Now))
	ctx := context.Background()
	reserve := func(in, out float64) (*Reservation, error) {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
		defer cancel()
		return l.Reserve(ctx, "llm", llmMeters, Usage{"requests": 1, "input_tokens": in, "output_tokens": out})
	}
	granted := func(what string, in, out float64) *Reservation {
		t.Helper()
		r, err := reserve(in, out)
		if err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		return r
	}
	refused := func(what string, in, out float64) {
		t.Helper()
		if _, err := reserve(in, out); !errors.Is(err, ErrWouldExceedDeadline) {
			t.Fatalf("%s: %v, want ErrWouldExceedDeadline", what, err)
		}
	}
	flush := func() {
		t.Helper()
		if err := l.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}

	r1 := granted("800 in, 400 out of full meters", 800, 400) // left: 200 in, 100 out
	takes := cmds.byOp()["take"]
	if takes != 1 {
		t.Errorf("a reservation of three meters made %d take calls, want 1 (%v)", takes, cmds.byOp())
	}
	refused("100 in, 400 out: the output meter holds 100", 100, 400)
	refused("300 in, 0 out: the input meter holds 200", 300, 0)
	granted("100 in, nothing out: the output meter does not hold it", 100, 0) // left: 100 in, 100 out

	r1.Settle(Usage{"output_tokens": 50}) // gives back 350 out
	r1.Settle(Usage{"output_tokens": 0})  // not counted: a reservation settles once
	flush()
	if n := cmds.byOp()["adjust"]; n != 1 {
		t.Errorf("two settles of one reservation made %d adjust calls, want 1", n)
	}
	r3 := granted("100 in, 400 out after the settle gave 350 back", 100, 400) // left: 0 in, 50 out
	refused("500 in with none left", 500, 0)
	r3.Cancel() // gives back 100 in, 400 out
	flush()
	granted("100 in, 450 out after the cancel", 100, 450)
	refused("the cancel counted once: 20 more in", 20, 0)
	if n := cmds.byOp()["take"]; n != 8 {
		t.Errorf("8 reservations made %d take calls, want 8", n)
	}

	// A reservation whose caller gives up while it waits hands back what
	// it took of each meter: 50 in, which would leave the meter owing
	// half a second, so that 5 more (50 ms) could not be had within 100
	// ms. (It waits, rather than being refused at once: it has no
	// deadline, and half a second is within MaxWait.)
	gaveUp, cancel := context.WithCancel(ctx)
	time.AfterFunc(30*time.Millisecond, cancel)
	if _, err := l.Reserve(gaveUp, "llm", llmMeters, Usage{"requests": 1, "input_tokens": 50}); !errors.Is(err, context.Canceled) {
		t.Fatalf("a reservation that waits past its deadline: %v", err)
	}
	time.Sleep(50 * time.Millisecond) // the refund goes in the background
	granted("5 in after a wait given up handed its 50 back", 5, 0)
}

// TestReserveRefusesWhatCannotBe: invalid meters and amounts fail at once,
// without a call to Redis.
func TestReserveRefusesWhatCannotBe(t *testing.T) {
	_, rdb, cmds := newMini(t)
	l := NewLimiter(rdb)
	ctx := context.Background()
	lim := Limit{Rate: 10, Burst: 10}
	for _, c := range []struct {
		what   string
		meters []Meter
		use    Usage
		want   error
	}{
		{"no meters", nil, Usage{}, ErrInvalidLimit},
		{"an empty name", []Meter{{"", lim}}, Usage{"": 1}, ErrInvalidLimit},
		{"a name with a colon", []Meter{{"a:b", lim}}, Usage{"a:b": 1}, ErrInvalidLimit},
		{"a name twice", []Meter{{"a", lim}, {"a", lim}}, Usage{"a": 1}, ErrInvalidLimit},
		{"an invalid Limit", []Meter{{"a", Limit{}}}, Usage{"a": 1}, ErrInvalidLimit},
		{"a meter the bucket lacks", []Meter{{"a", lim}}, Usage{"a": 1, "b": 1}, ErrInvalidTokens},
		{"a negative amount", []Meter{{"a", lim}, {"b", lim}}, Usage{"a": 1, "b": -1}, ErrInvalidTokens},
		{"nothing asked", []Meter{{"a", lim}, {"b", lim}}, Usage{}, ErrInvalidTokens},
		{"more than a burst", []Meter{{"a", lim}, {"b", lim}}, Usage{"a": 1, "b": 11}, ErrExceedsBurst},
	} {
		if _, err := l.Reserve(ctx, "x", c.meters, c.use); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.what, err, c.want)
		}
	}
	if n := cmds.total(); n != 0 {
		t.Errorf("invalid reservations made %d calls to Redis (%v)", n, cmds)
	}
}

// TestGiveBackWakesSleepers: a settle that gives tokens back moves the
// queue behind it, and a caller asleep in it, in another Limiter, wakes
// that much sooner: B queues 1 s behind A's reservation of a whole burst,
// and A's settle, 100 ms in, gives it all back. B hears of it from the
// settle's announcement and goes at once; with the announcement lost, from
// its Limiter's next read of the record (every control.WaitRefresh, 0.5
// s). Without the settle it waits its whole second.
func TestGiveBackWakesSleepers(t *testing.T) {
	srv := redistest.Start(t)
	meters := []Meter{
		{Name: "requests", Limit: Limit{Rate: 100, Burst: 100}},
		{Name: "output_tokens", Limit: Limit{Rate: 1000, Burst: 1000}},
	}
	use := Usage{"requests": 1, "output_tokens": 1000}
	ctx := context.Background()
	for _, c := range []struct {
		settle, lost bool
		within       time.Duration
	}{
		{settle: true, within: 350 * time.Millisecond},
		{settle: true, lost: true, within: 800 * time.Millisecond},
		{},
	} {
		settle := c.settle
		name := fmt.Sprintf("give-back-%v-%v", c.settle, c.lost)
		rdbA := srv.Client(t)
		if c.lost {
			rdbA.AddHook(silentSettles{})
		}
		a, b := NewLimiter(rdbA), NewLimiter(srv.Client(t))
		r, err := a.Reserve(ctx, name, meters, use)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		if settle {
			time.AfterFunc(100*time.Millisecond, func() { r.Settle(Usage{"output_tokens": 0}) })
		}
		if _, err := b.Reserve(ctx, name, meters, use); err != nil {
			t.Fatal(err)
		}
		waited := time.Since(start)
		t.Logf("settle %v, announcement lost %v: B waited %v", settle, c.lost, waited.Round(time.Millisecond))
		switch {
		case settle && waited > c.within:
			t.Errorf("announcement lost %v: B waited %v though A gave its whole reservation back 100 ms in, want at most %v", c.lost, waited, c.within)
		case !settle && waited < 900*time.Millisecond:
			t.Errorf("control, no settle: B waited %v, want its whole second: the test measures nothing", waited)
		}
		if err := a.Flush(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// silentSettles sends settles without the channel that announces their
// give-backs, as if every announcement were lost.
type silentSettles struct{}

func (silentSettles) DialHook(next redis.DialHook) redis.DialHook { return next }

func (silentSettles) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if scriptOp(cmd) == "adjust" {
			args := cmd.Args() // evalsha, sha, numkeys, keys..., argv...
			numkeys, _ := strconv.Atoi(fmt.Sprint(args[2]))
			args[3+numkeys+2] = "" // ARGV[3], the channel (update.lua)
		}
		return next(ctx, cmd)
	}
}

func (silentSettles) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
