// Package provider is a stand-in for a rate-limited HTTP API: it enforces
// its own token bucket, answers 429 Too Many Requests with Retry-After beyond
// it, asks for a pause on demand, takes about as long as a real API to
// answer, and records when every request arrived so that a run can be judged
// from the provider's side.
package provider

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"time"

	"golang.org/x/time/rate"
)

// WarmUp is the query of a request that only opens a connection: the
// provider answers it at once and neither counts nor limits it.
const WarmUp = "warmup=1"

// Tolerance is how early a request may arrive before its token and still be
// accepted. A client that keeps exactly to the limit cannot keep to it to the
// microsecond at the provider: its requests travel, and one that travels a
// little faster than the one before arrives a little early. Real providers
// tolerate such jitter; this one tolerates 25 ms, so in any window W it
// accepts at most burst + rate x (W + 25 ms) requests.
const Tolerance = 25 * time.Millisecond

// WorkerHeader names the header in which a client may say which worker it
// is, so that arrivals can be told apart.
const WorkerHeader = "X-Demo-Worker"

// An Arrival is one request as the provider saw it.
type Arrival struct {
	At      time.Time
	Refused bool // answered 429
	Worker  int  // from WorkerHeader, 0 if absent
}

// A Provider is a fake API listening on a loopback port.
type Provider struct {
	url     string
	srv     *http.Server
	served  chan error
	latency time.Duration
	limit   rate.Limit
	burst   int

	mu       sync.Mutex
	lim      *rate.Limiter
	arrivals []Arrival // in order of arrival
	pause    *pauseAsk // the pause to ask of the next request, nil for none
}

// A pauseAsk is a pause AskPause asked for: the Retry-After to send and
// where to report the instant it was sent.
type pauseAsk struct {
	retryAfter int // seconds
	sent       chan time.Time
}

// Start starts a provider on a free loopback port that allows perSecond
// requests a second with the given burst, within Tolerance, and answers each request after
// about latency (uniformly between 0.75 and 1.25 times it).
func Start(perSecond float64, burst int, latency time.Duration) (*Provider, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("provider: %w", err)
	}
	p := &Provider{
		url:     "http://" + ln.Addr().String() + "/v1/search",
		served:  make(chan error, 1),
		latency: latency,
		limit:   rate.Limit(perSecond),
		burst:   burst,
	}
	p.Reset()
	p.srv = &http.Server{Handler: p, ReadHeaderTimeout: 5 * time.Second}
	go func() { p.served <- p.srv.Serve(ln) }()
	return p, nil
}

// URL returns the address of the provider's one endpoint.
func (p *Provider) URL() string { return p.url }

// Reset gives the provider a full bucket, as after a long idle time, so that
// every phase of a run meets the same provider, and forgets a pause asked
// for and not yet sent.
func (p *Provider) Reset() {
	p.mu.Lock()
	p.lim = rate.NewLimiter(p.limit, p.burst)
	p.pause = nil
	p.mu.Unlock()
}

// RetryAfter returns d as the provider writes it in Retry-After: in whole
// seconds, rounded up, at least 1.
func RetryAfter(d time.Duration) int {
	return int(math.Max(1, math.Ceil(d.Seconds())))
}

// AskPause makes the provider answer the next request with 429 Too Many
// Requests and Retry-After: RetryAfter(d), whatever its bucket holds, as a
// provider that sheds load does. That request takes no token. The channel
// receives the instant the 429 was sent, and nothing if the client went
// away before the answer.
func (p *Provider) AskPause(d time.Duration) <-chan time.Time {
	ask := &pauseAsk{retryAfter: RetryAfter(d), sent: make(chan time.Time, 1)}
	p.mu.Lock()
	p.pause = ask
	p.mu.Unlock()
	return ask.sent
}

// ServeHTTP records the request, checks it against the provider's limit
// with a golang.org/x/time/rate limiter and answers after the simulated
// latency: 200 with a small JSON body, or 429 with Retry-After in seconds,
// the pause AskPause asked for if there is one.
func (p *Provider) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.RawQuery == WarmUp {
		w.WriteHeader(http.StatusNoContent)
		return
	}
	p.mu.Lock()
	now := time.Now()
	ask := p.pause
	p.pause = nil
	allowed, retryAfter := false, 0
	if ask != nil {
		retryAfter = ask.retryAfter
	} else {
		res := p.lim.ReserveN(now, 1)
		retry := res.DelayFrom(now)
		allowed = retry <= Tolerance
		if !allowed {
			res.CancelAt(now)
			retryAfter = RetryAfter(retry)
		}
	}
	worker, _ := strconv.Atoi(r.Header.Get(WorkerHeader))
	p.arrivals = append(p.arrivals, Arrival{At: now, Refused: !allowed, Worker: worker})
	p.mu.Unlock()

	delay := time.Duration(float64(p.latency) * (0.75 + 0.5*rand.Float64()))
	select {
	case <-time.After(delay):
	case <-r.Context().Done():
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if !allowed {
		w.Header().Set("Retry-After", strconv.Itoa(retryAfter))
		w.WriteHeader(http.StatusTooManyRequests)
		fmt.Fprintln(w, `{"error":"rate limit exceeded"}`)
		if ask != nil {
			_ = http.NewResponseController(w).Flush()
			ask.sent <- time.Now()
		}
		return
	}
	fmt.Fprintln(w, `{"results":[]}`)
}

// Between returns the arrivals in [from, to).
func (p *Provider) Between(from, to time.Time) []Arrival {
	p.mu.Lock()
	defer p.mu.Unlock()
	i, j := p.index(from), p.index(to)
	return append([]Arrival(nil), p.arrivals[i:j]...)
}

// Count returns how many requests arrived in [from, to) and how many of
// them were refused.
func (p *Provider) Count(from, to time.Time) (arrived, refused int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, a := range p.arrivals[p.index(from):p.index(to)] {
		arrived++
		if a.Refused {
			refused++
		}
	}
	return arrived, refused
}

// index returns the position of the first arrival at or after t.
func (p *Provider) index(t time.Time) int {
	return sort.Search(len(p.arrivals), func(i int) bool { return !p.arrivals[i].At.Before(t) })
}

// Close stops the provider, cutting requests still in flight.
func (p *Provider) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	err := p.srv.Shutdown(ctx)
	if errors.Is(err, context.DeadlineExceeded) {
		err = p.srv.Close()
	}
	if serr := <-p.served; !errors.Is(serr, http.ErrServerClosed) && err == nil {
		err = serr
	}
	return err
}
