package pool

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/sharedquota/quota/internal/store"
)

// A deployment's bucket key has the pool's name as its hash tag, so that a
// Redis Cluster keeps a pool's deployments in one slot, and reads back as
// the bucket's name; a pool whose name leaves no room for a deployment's
// is refused rather than shortened into another slot.
func TestBucketSharesThePoolsHashTag(t *testing.T) {
	for _, pool := range []string{"gpt-4o", "api.openai.com", "a}b", strings.Repeat("p", store.MaxNameLen-2-len("eastus"))} {
		name, err := Bucket(pool, "eastus")
		if err != nil {
			t.Fatalf("pool %q: %v", pool, err)
		}
		key := store.Key("quota:", name)
		open := strings.IndexByte(key, '{')
		tag := key[open+1 : open+1+strings.IndexByte(key[open+1:], '}')]
		if want, _, _ := strings.Cut(pool, "}"); tag != want {
			t.Errorf("pool %q: key %q has hash tag %q, want %q", pool, key, tag, want)
		}
		if back, suffix, _, ok := store.ParseKey("quota:", key); !ok || back != name || suffix != "" {
			t.Errorf("key %q reads back as %q %q %v, want %q", key, back, suffix, ok, name)
		}
	}
	if _, err := Bucket(strings.Repeat("p", store.MaxNameLen), "eastus"); err == nil {
		t.Error("a pool name of MaxNameLen bytes was accepted")
	}
	if _, err := Bucket("", "eastus"); err == nil {
		t.Error("an empty pool name was accepted")
	}
}

// New orders the deployments by name and marks the last resorts.
func TestNewOrdersAndMarks(t *testing.T) {
	p, err := New([]string{"west", "east", "paygo"}, []string{"paygo"}, func(*http.Request, string) *http.Request { return nil })
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(p.Names, ",") != "east,paygo,west" || p.Last[0] || !p.Last[1] || p.Last[2] {
		t.Errorf("pool %v, last resorts %v", p.Names, p.Last)
	}
}

// A deployment's Limits are its bucket's first layers; the layers it does
// not name, and the meters, are the pool's. Fit refuses a deployment
// with more Limits than the layers.
func TestBucketsTakeTheDeploymentsLimitsFirst(t *testing.T) {
	p, err := New([]string{"b", "a"}, nil, func(r *http.Request, _ string) *http.Request { return r })
	if err != nil {
		t.Fatal(err)
	}
	p.Lims = [][]store.Limit{{{Rate: 1, Burst: 1}}, {{Rate: 2, Burst: 2}, {Rate: 20, Burst: 20}}}
	layers := []store.Limit{{Rate: 9, Burst: 9}, {Rate: 90, Burst: 90}, {Rate: 900, Burst: 900}}
	cs, err := p.Buckets("quota:", "llm", layers, []string{"requests", "input", "output"})
	if err != nil {
		t.Fatal(err)
	}
	want := [][]float64{{1, 90, 900}, {2, 20, 900}}
	for i, c := range cs {
		var got []float64
		for _, l := range c.Lims {
			got = append(got, l.Rate)
		}
		if c.Name != "llm}{"+p.Names[i] || len(c.Meters) != 3 || !slices.Equal(got, want[i]) {
			t.Errorf("deployment %s: bucket %q, rates %v, meters %v; want rates %v", p.Names[i], c.Name, got, c.Meters, want[i])
		}
	}
	p.Fit(2)
	defer func() {
		if r := fmt.Sprint(recover()); !strings.Contains(r, `deployment "b" has 2 Limits, more than the 1 layers`) {
			t.Errorf("Fit(1) panicked with %q", r)
		}
	}()
	p.Fit(1)
}
