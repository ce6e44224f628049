package quota

import (
	"context"
	"fmt"
	"math"
	"net/http"

	"github.com/sharedquota/quota/internal/store"
)

// Tenants says how a bucket's rate is shared between the tenants its
// requests are for (see WithTenants). The zero value weighs every tenant
// 1 and keeps DefaultMaxTenants apart.
type Tenants struct {
	// Weights are the listed tenants' weights, each above 0: on a bucket
	// whose queue is full, a tenant with requests waiting gets rate x its
	// weight / the sum of the waiting tenants' weights.
	Weights map[string]float64
	// Default is the weight of a tenant not listed; 0 means 1.
	Default float64
	// Max is how many tenants not listed a bucket keeps apart; those that
	// come when as many have requests in the bucket's books share one
	// place, with the Default weight. 0 means DefaultMaxTenants.
	Max int
}

// WithTenants shares each bucket's rate between the tenants its requests
// are for, named by WithTenant or ContextWithTenant, by weight: while the
// bucket has a queue, each tenant with requests waiting is granted rate x
// weight / the sum of the waiting tenants' weights, across the fleet, and
// a tenant with nothing waiting leaves its share to the others. A request
// that names no tenant is the tenant "", with the Default weight.
//
// To do so, a bucket's queue is kept at most 250 ms long: the requests
// beyond it wait in their processes, the first of each tenant in each
// process asking Redis again when its tenant's turn and room in the queue
// are due (at most 250 ms later), so that a bucket that is saturated
// costs about two Redis calls a request. A tenant that stops leaves its
// share to the others within half a second. A request of a priority above
// 0 (see WithPriority) is not held: it is charged to its tenant's share.
// A settle (WithMetering, Reservation.Settle, WithSettle) charges or gives
// back the difference between what a request reserved and what it used,
// so that the tenants share what they use.
// While Redis is unavailable, a local share (FallbackLocal) serves its
// callers first come, first served.
//
// Give every Limiter of the fleet the same Tenants: each request carries
// its tenant's weight. It panics on a weight that is not above 0 and
// finite, or a Default or Max below 0.
func WithTenants(t Tenants) Option {
	for name, w := range t.Weights {
		if !(w > 0) || math.IsInf(w, 0) {
			panic(fmt.Sprintf("quota: WithTenants: tenant %q's weight is %v, want above 0", name, w))
		}
	}
	if !(t.Default >= 0) || math.IsInf(t.Default, 0) || t.Max < 0 {
		panic(fmt.Sprintf("quota: WithTenants: Default %v and Max %d, want neither below 0", t.Default, t.Max))
	}
	if t.Default == 0 {
		t.Default = 1
	}
	if t.Max == 0 {
		t.Max = DefaultMaxTenants
	}
	return limiterOpt(func(c *config) { c.tenants = &t })
}

// WithTenant names each request's tenant, for the shares of WithTenants.
// Without it, a request is for its context's tenant (see
// ContextWithTenant). It panics if f is nil.
func WithTenant(f func(*http.Request) string) TransportOption {
	if f == nil {
		panic("quota: WithTenant(nil)")
	}
	return transportOpt(func(c *transportConfig) { c.tenant = f })
}

type tenantKey struct{}

// ContextWithTenant returns a copy of ctx whose tokens are for tenant (see
// WithTenants): for a Limiter's Wait, WaitN, Allow, AllowN and Reserve,
// and for a Transport's requests without WithTenant. On a Limiter without
// WithTenants, the tenants weigh 1 each.
func ContextWithTenant(ctx context.Context, tenant string) context.Context {
	return context.WithValue(ctx, tenantKey{}, tenant)
}

// tenantOf returns the tenant ctx names, and whether it names one.
func tenantOf(ctx context.Context) (string, bool) {
	t, ok := ctx.Value(tenantKey{}).(string)
	return t, ok
}

// weigh sets what o asks for its tenant, under the Limiter's Tenants:
// nothing when neither names one.
func (l *Limiter) weigh(ctx context.Context, o *ask) {
	if !o.tenantSet {
		o.tenant, o.tenantSet = tenantOf(ctx)
	}
	t := l.cfg.tenants
	if t == nil {
		if !o.tenantSet {
			return
		}
		t = &Tenants{Default: 1, Max: DefaultMaxTenants}
	}
	o.tenantSet = true
	if w, ok := t.Weights[o.tenant]; ok {
		o.weight, o.tenantCap, o.listed = w, 0, true
		return
	}
	o.weight, o.tenantCap = t.Default, t.Max
}

// charge makes c, the adjust of a settle of o that found it used used,
// charge o's tenant what its take cost more, or give back what it cost
// less, so that the tenants share what they used, not what they reserved.
func (l *Limiter) charge(ctx context.Context, b bucket, o ask, used store.Cost, c *store.Cost) {
	if l.weigh(ctx, &o); o.weight <= 0 || l.off(charges) {
		return
	}
	c.Tenant, c.Weight, c.TenantCap = o.tenant, o.weight, o.tenantCap
	c.Charge = float64((b.CostTime(used) - b.CostTime(o.cost())).Microseconds())
}
