// Package store owns the protocol of a bucket in Redis: its keys
// (keys.go), its scripts, one for each kind of call (scripts.go: the take,
// script.lua; the other updates of the layers, update.lua; the control
// record's operations, record.lua), and a typed codec for each: the
// take's callers and Grants (take.go), the updates (update.go), the
// record's operations and Records (record.go), each written to the named
// ARGV its script reads. A Store runs them, and shares the script calls
// of the takes of one bucket (batch.go).
package store

import (
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/sharedquota/quota/internal/daily"
	"github.com/sharedquota/quota/internal/redisx"
)

// A Store runs the bucket's scripts on Redis, one typed method for each
// operation.
type Store struct {
	takeScript   *redisx.Script // script.lua
	updateScript *redisx.Script // update.lua
	recordScript *redisx.Script // record.lua
	poolScript   *redisx.Script // pool.lua, around script.lua
	argv         argvCache
	clock        func() time.Time // nil: the server's clock
	cluster      bool             // the client follows Cluster redirections
	channel      string           // the control channel, which announces changes
	batches      *batches         // nil: every take a call of its own
}

// Options are a Store's settings.
type Options struct {
	Channel  string           // on which the scripts announce changes
	Clock    func() time.Time // the callers' clock; nil: the server's
	MaxWait  time.Duration    // the wait most takes accept, kept formatted
	Batching bool             // the takes of one bucket share calls
	Hold     bool             // a take on a bucket with a queue holds its call for the takes after it
}

// NewStore returns the Store of the buckets in rdb.
func NewStore(rdb redis.Scripter, o Options) *Store {
	s := &Store{
		takeScript:   redisx.NewScript(rdb, takeSource),
		updateScript: redisx.NewScript(rdb, updateSource),
		recordScript: redisx.NewScript(rdb, recordSource),
		poolScript:   redisx.NewScript(rdb, poolSource),
		clock:        o.Clock,
		channel:      o.Channel,
		cluster:      redisx.IsCluster(rdb),
	}
	if o.Batching {
		s.batches = &batches{hold: o.Hold}
	}
	s.argv.init(o.MaxWait)
	return s
}

// Client returns the client the scripts run on.
func (s *Store) Client() redis.Scripter { return s.takeScript.Client() }

// TakeScript returns the take's script, which every request runs.
func (s *Store) TakeScript() *redisx.Script { return s.takeScript }

// Cluster reports whether the client follows Cluster redirections.
func (s *Store) Cluster() bool { return s.cluster }

// Now returns the ARGV the scripts read as the time: empty for the
// server's clock, the callers' clock in microseconds otherwise.
func (s *Store) Now() string { return redisx.Now(s.clock) }

// limit returns lim's rate and burst as the scripts read them: a daily
// Limit's rate is its spec, its reset instants around now on the
// callers' clock (see daily.Spec).
func (s *Store) limit(lim Limit) (rate, burst any) {
	if lim.Zone == nil {
		return s.argv.limit(lim)
	}
	now := time.Now()
	if s.clock != nil {
		now = s.clock()
	}
	return daily.Spec(now, lim.Burst, lim.Reset, lim.Zone), redisx.Num(lim.Burst)
}
