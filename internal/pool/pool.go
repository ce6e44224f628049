// Package pool names and checks the deployments of a pool: several
// buckets, each with limits of its own, any of which may serve a request
// (see internal/store's TakePool, which chooses among them in Redis).
package pool

import (
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/sharedquota/quota/internal/store"
)

// A Pool is the deployments of a pool, in order of their names: their
// Limits, the first layers of their buckets, which of them are last
// resorts, and how a request is sent to one (see quota.WithPool).
type Pool struct {
	Names []string
	Lims  [][]store.Limit
	Last  []bool
	Route func(req *http.Request, deployment string) *http.Request
}

// A Take is one request's take from a pool, and the deployment it chose.
type Take struct {
	*Pool
	Chosen int
	Name   string            // the pool's, once sent
	Cands  []store.Candidate // its deployments, as its last turn read them
}

// Take returns a new take from p, nil for a nil p.
func (p *Pool) Take() *Take {
	if p == nil {
		return nil
	}
	return &Take{Pool: p}
}

// Call returns the KEYS and ARGV of a take of n with a longest wait of
// maxWait, for a script that runs one inside its own (internal/slots): of
// bucket b's own take, or, on a pool's Take, of its pool's from Cands.
func (t *Take) Call(s *store.Store, b store.Bucket, n store.Cost, maxWait time.Duration) ([]string, []any) {
	if t == nil {
		return s.TakeCall(b, n, maxWait)
	}
	return s.PoolCall(t.Cands, n, maxWait)
}

// Decode reads the reply v of the take of a Call: b's, or, on a pool's
// Take, the pool's, noting the deployment it chose.
func (t *Take) Decode(b store.Bucket, v []int64) (g store.Grant, err error) {
	if t == nil {
		return store.Decode(b, v)
	}
	g, t.Chosen, err = store.DecodePool(t.Cands, v)
	return g, err
}

// MaxName bounds a deployment's name.
const MaxName = 64

// New returns the pool of the deployments named names, of which those
// named in last are last resorts, or why there can be no such pool: no
// deployment, a name empty, too long or holding a brace, a last resort
// that is no deployment or named twice, every deployment a last resort,
// route nil. Its Lims are for the caller to fill.
func New(names, last []string, route func(*http.Request, string) *http.Request) (Pool, error) {
	if len(names) == 0 {
		return Pool{}, errors.New("no deployments")
	}
	if route == nil {
		return Pool{}, errors.New("no route")
	}
	p := Pool{Names: slices.Sorted(slices.Values(names)), Last: make([]bool, len(names)), Route: route}
	for i, n := range p.Names {
		switch {
		case n == "" || len(n) > MaxName:
			return Pool{}, fmt.Errorf("deployment %q: a deployment's name has 1 to %d bytes", n, MaxName)
		case strings.ContainsAny(n, "{}"):
			return Pool{}, fmt.Errorf("deployment %q: a deployment's name holds no braces", n)
		case i > 0 && p.Names[i-1] == n:
			return Pool{}, fmt.Errorf("deployment %q named twice", n)
		}
	}
	for _, n := range last {
		i, ok := slices.BinarySearch(p.Names, n)
		switch {
		case !ok:
			return Pool{}, fmt.Errorf("last resort %q is not one of the deployments %q", n, p.Names)
		case p.Last[i]:
			return Pool{}, fmt.Errorf("last resort %q named twice", n)
		}
		p.Last[i] = true
	}
	if !slices.Contains(p.Last, false) {
		return Pool{}, fmt.Errorf("every deployment is a last resort: name the ones to spill over to only")
	}
	return p, nil
}

// Bucket returns the name of the bucket of deployment d of the pool
// called name: "name}{d", whose key, prefix{name}{d}, has the pool's
// name as its hash tag, as every deployment of the pool has. It fails
// for a pool name that would leave no room for the deployment's within
// the bucket names that store.Key keeps whole.
func Bucket(name, d string) (string, error) {
	if name == "" {
		return "", errors.New("empty bucket name")
	}
	if len(name)+2+len(d) > store.MaxNameLen {
		return "", fmt.Errorf("pool %.20q...: a pool's name has at most %d bytes with its deployments' names", name, store.MaxNameLen-2)
	}
	return name + "}{" + d, nil
}

// Fit panics, saying which, when a deployment has more Limits than the
// layers of its pool's buckets.
func (p *Pool) Fit(layers int) {
	for i, d := range p.Names {
		if len(p.Lims[i]) > layers {
			panic(fmt.Sprintf("quota: WithPool: deployment %q has %d Limits, more than the %d layers of the Transport's "+
				"buckets (its Limit, then those of WithLayers or of the Metering's Meters)", d, len(p.Lims[i]), layers))
		}
	}
}

// Buckets returns the buckets of the deployments of the pool called name,
// under prefix, in the order of Names: each has layers and meters, with
// the deployment's Limits in place of the first.
func (p *Pool) Buckets(prefix, name string, layers []store.Limit, meters []string) ([]store.Candidate, error) {
	cs := make([]store.Candidate, len(p.Names))
	for i, d := range p.Names {
		n, err := Bucket(name, d)
		if err != nil {
			return nil, err
		}
		lims := append(slices.Clone(p.Lims[i]), layers[len(p.Lims[i]):]...)
		cs[i] = store.Candidate{Bucket: store.New(prefix, n, lims, meters...), Last: p.Last[i]}
	}
	return cs, nil
}

// Send returns the bucket of the chosen deployment of the pool called
// name, which the take has checked, and req for that deployment.
func (t *Take) Send(name string, req *http.Request) (string, *http.Request) {
	d := t.Names[t.Chosen]
	t.Name = name
	return name + "}{" + d, t.Route(req, d)
}
