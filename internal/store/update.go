package store

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/sharedquota/quota/internal/redisx"
)

// Refund hands back n of a take identified by its tats.
func (s *Store) Refund(ctx context.Context, b Bucket, n Cost, tats []int64) error {
	return s.update(ctx, b, update{op: "refund", n: n, tats: tats})
}

// Probe rewrites b as it is, to learn whether the server accepts writes.
func (s *Store) Probe(ctx context.Context, b Bucket) error {
	return s.update(ctx, b, update{op: "probe"})
}

// Resuming grants nothing from b before at (µs, on the scripts' clock),
// when the fleet leaves its local shares after an outage, to any Limiter,
// whether or not it saw the outage; of several such instants, the latest
// stands.
func (s *Store) Resuming(ctx context.Context, b Bucket, at int64) error {
	return s.update(ctx, b, update{op: "resuming", arg: at})
}

// Pause grants nothing from b for d, as a provider's Retry-After asks: the
// bucket's one pause ends then at the latest, and the change is announced
// on the control channel.
func (s *Store) Pause(ctx context.Context, b Bucket, d time.Duration) error {
	return s.update(ctx, b, update{op: "pause", arg: max(d.Microseconds(), 1), channel: s.channel})
}

// Lower leaves every layer of b at most remaining tokens, never raising it.
func (s *Store) Lower(ctx context.Context, b Bucket, remaining float64) error {
	for _, lim := range b.Lims {
		if remaining < lim.Burst {
			return s.update(ctx, b, update{op: "lower", n: Tokens(remaining)})
		}
	}
	return nil // no layer holds more than that
}

// LowerEach leaves layer i of b at most remaining[i] tokens, never raising
// it; a remaining below zero leaves its layer as it is.
func (s *Store) LowerEach(ctx context.Context, b Bucket, remaining []float64) error {
	for i, lim := range b.Lims {
		if remaining[i] >= 0 && remaining[i] < lim.Burst {
			return s.update(ctx, b, update{op: "lower", n: Cost{Each: remaining}})
		}
	}
	return nil // no layer holds more than that
}

// Adjust takes n more tokens from b's layers at once, or gives back what
// is below zero. A non-empty id makes it count once however often it is
// sent (a client's retry after a lost reply): the script remembers the ids
// of the last minute.
func (s *Store) Adjust(ctx context.Context, b Bucket, n Cost, id string) error {
	return s.AdjustLower(ctx, b, n, nil, id)
}

// AdjustLower is Adjust that then, in the same call, leaves layer i at
// most remaining[i] tokens, as LowerEach does; nil remaining lowers
// nothing.
func (s *Store) AdjustLower(ctx context.Context, b Bucket, n Cost, remaining []float64, id string) error {
	withIDs := b
	withIDs.Call = append(slices.Clip(b.Call), b.Keys[0]+SettledSuffix)
	return s.update(ctx, withIDs, update{op: "adjust", arg: id, n: n, remaining: remaining, channel: s.channel})
}

// A Refusal is a provider's refusal of a request, for the rates the
// fleet learns (see learn.lua).
type Refusal struct {
	Age   time.Duration // since the request was sent
	OK    float64       // the share of its process's requests the provider accepted lately
	Floor float64       // the least rate, a share of each Limit's rate
	Rise  float64       // the rise a second past the peak, likewise
	Why   string        // what the refusal was: "429", "503"; "" for a response that only bounds the rates
	Named []bool        // the layers it names, nil for none
	// Bounds are the rates the provider's RateLimit-Policy allows each
	// layer: 0 for as much as its Limit, below 0 when it says nothing of
	// the layer; nil for nothing at all.
	Bounds []float64
}

// Refuse cuts the rates the fleet learns of b's layers after r, once an
// overload, bounds them as r's Bounds say, and announces a cut on the
// control channel.
func (s *Store) Refuse(ctx context.Context, b Bucket, r Refusal) error {
	return s.update(ctx, b, update{op: "refuse", arg: max(r.Age.Microseconds(), 0), refusal: r, channel: s.channel})
}

// An update is a call of the updates' script (update.lua).
type update struct {
	op        string  // refund, probe, pause, lower, adjust or resuming
	channel   string  // pause, adjust: announces the pause, or the give-backs
	arg       any     // pause: µs; resuming: the instant, µs; adjust: the settle's id
	n         Cost    // refund, adjust: the tokens, and the tenant; lower: the tokens that remain
	tats      []int64 // refund: the take's
	remaining []float64
	refusal   Refusal
}

// The updates' ARGV (update.lua), by name: the call's, then two for each
// layer from updateLayers on, its amount and its mark, then the layers'
// Limits.
const (
	updateOp      = iota // the operation
	updateNow            // now in µs, or "" for the server's clock
	updateUses           // "tenant" for an adjust that charges its tenant, "plain" otherwise
	updateChannel        // pause, adjust: announces the change
	updateArg            // pause: how long, µs; resuming: the instant, µs; adjust: the settle's id
	updateTenant         // adjust: the tenant its take was for
	updateWeight         // the tenant's weight, 0 for none
	updateCap            // the most tenants the bucket keeps apart
	updateCharge         // the µs the tenant is charged more
	updateLayers         // layer 1's amount and mark, then layer 2's, ...
)

// update runs u on b's layers; its reply, the layers' tats after it,
// tells nothing but its success.
func (s *Store) update(ctx context.Context, b Bucket, u update) error {
	k := len(b.Lims)
	args := make([]any, updateLayers, updateLayers+4*k)
	args[updateOp], args[updateNow], args[updateUses], args[updateChannel], args[updateArg] = u.op, s.Now(), usesPlain, u.channel, ""
	if u.arg != nil {
		args[updateArg] = u.arg
	}
	args[updateTenant], args[updateWeight], args[updateCap], args[updateCharge] = "", 0, 0, 0
	if u.op == "adjust" && u.n.Weight > 0 {
		args[updateUses] = usesTenant
		args[updateTenant], args[updateWeight], args[updateCap] = u.n.Tenant, redisx.Num(u.n.Weight), u.n.TenantCap
		args[updateCharge] = strconv.FormatFloat(u.n.Charge, 'f', 0, 64)
	}
	if u.op == "refuse" {
		r := u.refusal
		args[updateTenant], args[updateWeight], args[updateCap], args[updateCharge] = redisx.Num(r.OK), redisx.Num(r.Floor), redisx.Num(r.Rise), r.Why
	}
	for i := range b.Lims {
		var amount, mark any = 0, ""
		switch {
		case u.op == "refuse" && i < len(u.refusal.Named) && u.refusal.Named[i]:
			amount = 1
		case u.op != "probe" && u.op != "pause" && u.op != "resuming" && u.op != "refuse":
			amount = s.argv.tokens(u.n.Of(i))
		}
		switch {
		case u.op == "refuse" && i < len(u.refusal.Bounds) && u.refusal.Bounds[i] >= 0:
			mark = redisx.Num(u.refusal.Bounds[i])
		case u.op == "refund" && u.tats != nil:
			mark = u.tats[i]
		case u.op == "refund":
			mark = 0
		case u.remaining != nil:
			mark = redisx.Num(u.remaining[i])
		}
		args = append(args, amount, mark)
	}
	for _, lim := range b.Lims {
		rate, burst := s.limit(lim)
		args = append(args, rate, burst)
	}
	cmd, _ := s.updateScript.Run(ctx, b.Call, args...)
	if err := cmd.Err(); err != nil {
		return err
	}
	if v, err := cmd.Int64Slice(); err != nil || len(v) != k {
		return fmt.Errorf("%w: %v", redisx.ErrReply, cmd.Val())
	}
	return nil
}
