package quota

import (
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// The package's constants: its fixed names and bounds, a bucket's pauses,
// and the defaults of the options that tune a Limiter or a Transport.
const (
	// MaxPriority is the highest priority: priorities run from 0, the
	// default, to MaxPriority.
	MaxPriority = store.MaxClass
	// MeterRequests is the name of a metered Transport's first Meter: one
	// a request (or WithCost's), of the Limit the Transport is given (or
	// WithLimits'), which holds what its String says, as everywhere (see
	// Limit). Its bucket's override (SetLimit) and pause apply to it.
	MeterRequests = "requests"
	// ScopeName is the instrumentation scope of the package's spans and
	// metrics.
	ScopeName = "github.com/sharedquota/quota"

	// Forever, given to Pause, pauses a bucket until Resume.
	Forever time.Duration = store.Forever

	// Who set a bucket's pause, as Status reports it.
	PausedByProvider = "provider"
	PausedByOperator = "operator"

	// DefaultPrefix is the prefix of every Redis key the package writes
	// unless WithPrefix says otherwise.
	DefaultPrefix = "quota:"
	// DefaultMaxWait is the longest single sleep of a Wait whose context
	// has no deadline, unless WithMaxWait says otherwise.
	DefaultMaxWait = 5 * time.Second
	// DefaultMaxPause bounds the pause a provider's Retry-After puts on a
	// whole bucket unless WithMaxPause says otherwise.
	DefaultMaxPause = 5 * time.Minute
	// DefaultSlotLease is how long a concurrency slot outlives the last
	// sign of life of the process that holds it, unless WithSlotLease
	// says otherwise.
	DefaultSlotLease = 10 * time.Second
	// DefaultMaxTenants is how many tenants not listed in Tenants.Weights
	// a bucket keeps apart, unless Tenants.Max says otherwise.
	DefaultMaxTenants = 64
)
