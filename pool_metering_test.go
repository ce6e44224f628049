package quota

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sharedquota/quota/internal/llmfake"
	"github.com/sharedquota/quota/internal/redistest"
)

// A metered pool: three Anthropic deployments, each a fake of its own
// whose output tokens a, b and c allow 16,000, 8,000 and 4,000 a second
// (a minute's limits, sixty times faster), each deployment's Limits in
// the fleet at 95% of its own. A fake's output bucket holds one and a half
// seconds of its rate: the fleet's burst leaves it 5% of a second, which
// requests granted apart and bunched on their way by a loaded machine's
// stalls overdrew (3 429s beside other tests). Three Transports WithMetering and WithPool,
// 8 goroutines each, send requests of max_tokens 1,000 for 5 s: the fleet
// uses at least 0.9 of the deployments' summed output tokens from 2 s in,
// with no 429, one pool take and at most one settle a request. The
// negative control: the fleet's Limits at the deployments' sum on each
// deployment meets 429s.
func TestPoolMetered(t *testing.T) {
	redistest.Long(t)
	srv := redistest.Start(t)
	run := func(t *testing.T, scale float64, d time.Duration) (used float64, refused, requests int, ops map[string]int) {
		output := map[string]float64{"a": 16000, "b": 8000, "c": 4000}
		fakes := map[string]*llmfake.Server{}
		hosts := map[string]string{}
		lims := map[string][]Limit{}
		for d, out := range output {
			p := &llmfake.Server{Kind: llmfake.Anthropic, Latency: 100 * time.Millisecond, Limits: llmfake.Limits{
				Requests:     llmfake.Bucket{Rate: 200, Burst: 200},
				InputTokens:  llmfake.Bucket{Rate: 400000, Burst: 400000},
				OutputTokens: llmfake.Bucket{Rate: out, Burst: 1.5 * out},
			}}
			s := httptest.NewServer(p)
			defer s.Close()
			u, _ := url.Parse(s.URL)
			fakes[d], hosts[d] = p, u.Host
			o := Limit{Rate: out * scale, Burst: out * scale}
			lims[d] = []Limit{{Rate: 190, Burst: 190}, {Rate: 380000, Burst: 380000}, o}
		}
		m := LLMProfiles.Anthropic(Limit{Rate: 1, Burst: 1}, Limit{Rate: 1, Burst: 1}) // each deployment has its own
		if m.Meters[1].Name != outputTokens {
			t.Fatalf("the Anthropic profile's Meters are %v, want input then output", m.Meters)
		}
		route := func(req *http.Request, d string) *http.Request {
			r := req.Clone(req.Context())
			r.URL.Host, r.Host = hosts[d], hosts[d]
			return r
		}
		cmds := newCmdCounter()
		var trs []*Transport
		for range 3 {
			rdb := srv.Client(t)
			rdb.AddHook(cmds)
			trs = append(trs, NewTransport(rdb, PerSecond(1), WithKey(Fixed("llm")), WithMetering(m),
				WithPool(route, lims), WithBase(&http.Transport{MaxIdleConnsPerHost: 8})))
		}
		ctx, cancel := context.WithCancel(context.Background()) // no deadline: a caller waits its turn
		defer time.AfterFunc(d, cancel).Stop()
		start := time.Now()
		var wg sync.WaitGroup
		var seq atomic.Int64
		for g := range 24 {
			client := &http.Client{Transport: trs[g%3]}
			wg.Go(func() {
				for ctx.Err() == nil {
					body := llmRequest("anthropic", int(seq.Add(1)), 1000, false)
					req, _ := http.NewRequestWithContext(ctx, "POST", "http://pool.invalid/v1/messages", bytes.NewReader(body))
					req.Header.Set("Content-Type", "application/json")
					resp, err := client.Do(req)
					if err != nil {
						continue // the context ended
					}
					io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
				}
			})
		}
		wg.Wait()
		from, to := start.Add(d*2/5), start.Add(d-300*time.Millisecond) // from 2 s to 4.7 s of 5
		byDeployment := map[string]float64{}
		for d, p := range fakes {
			for _, rec := range p.Records() {
				if !rec.At.Before(from) && rec.At.Before(to) {
					byDeployment[d] += float64(rec.Output)
				}
			}
			refused += p.Refused()
			requests += len(p.Records()) + p.Refused()
			used += byDeployment[d]
		}
		used /= to.Sub(from).Seconds() * 28000
		ops = cmds.byOp()
		t.Logf("scale %.2f: %.3f of the deployments' output tokens (tokens by deployment %v in %v), %d requests, %d refused with 429; script calls %v",
			scale, used, byDeployment, to.Sub(from), requests, refused, ops)
		return used, refused, requests, ops
	}
	used, refused, requests, ops := run(t, 0.95, 5*time.Second)
	if used < 0.9 {
		t.Errorf("the fleet used %.3f of the deployments' output tokens, want at least 0.9", used)
	}
	if refused > 0 {
		t.Errorf("%d requests refused with 429, want none", refused)
	}
	if ops["pool"] < requests || ops["pool"] > requests+24 || ops["take"] > 0 {
		t.Errorf("%d requests made script calls %v, want one pool take each", requests, ops)
	}
	if ops["adjust"] > requests {
		t.Errorf("%d requests made %d settle calls, want at most one each", requests, ops["adjust"])
	}
	// The negative control: each deployment's output Limit at the sum.
	if _, refused, _, _ := run(t, 1.5, 2*time.Second); refused == 0 {
		t.Errorf("a fleet above the deployments' limits met no 429")
	}
}
