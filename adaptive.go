package quota

import "github.com/sharedquota/quota/internal/adapt"

// Adaptive makes a Transport learn the provider's real limit for the
// whole fleet (WithAdaptive): each Limit is the most its layer may reach,
// and the rate in force, learned in the bucket's control record between
// Floor and that Limit, is every process's. A refusal cuts it once an
// overload, however many processes see one; while callers queue and none
// comes, it rises, once an interval for the fleet. An override (SetLimit)
// wins, and freezes the first layer's learning. See docs/adaptive.md.
type Adaptive struct {
	// Floor is the least rate, a share of each Limit's rate: 0.05 if 0.
	Floor float64
	// Rise is how fast the rate rises past its last cut, a share of each
	// Limit's rate a second that doubles every second: 0.02 if 0.
	Rise float64
	// Refusals are the statuses that say too many requests: 429 when
	// empty. nginx's limit_req answers 503.
	Refusals []int
}

// WithAdaptive makes the Transport learn the provider's real limit below
// its Limits (see Adaptive). A refusal that names a Meter (its Remaining
// below one) cuts that Meter; one that names none, the layers whose
// callers queue, else the first. A Retry-After still pauses the bucket.
// It panics if a is invalid: a Floor outside [0, 1), a Rise outside
// [0, 1], a refusal status outside 400 to 599.
func WithAdaptive(a Adaptive) TransportOption {
	c, err := adapt.Config{Floor: a.Floor, Rise: a.Rise, Refusals: a.Refusals}.Check()
	if err != nil {
		panic("quota: WithAdaptive: " + err.Error())
	}
	return transportOpt(func(tc *transportConfig) { tc.adapt = adapt.New(c) })
}
