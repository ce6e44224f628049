package main

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/sharedquota/quota"
	"github.com/sharedquota/quota/internal/redistest"
)

// namesOnEveryMaster returns perMaster bucket names for each master of c,
// sorted, and how many masters serve them: names whose keys' hash slots
// fall on each master in turn.
func namesOnEveryMaster(t *testing.T, c *redistest.Cluster, perMaster int) []string {
	t.Helper()
	count := map[*redistest.Server]int{}
	var names []string
	for i := 0; len(names) < 3*perMaster && i < 1000; i++ {
		name := fmt.Sprintf("b%d.example.com", i)
		m := c.MasterFor(bucketKey(quota.DefaultPrefix, name))
		if count[m] < perMaster {
			count[m]++
			names = append(names, name)
		}
	}
	if len(count) < 3 {
		t.Fatalf("the buckets %q fall on %d masters, want 3", names, len(count))
	}
	slices.Sort(names)
	return names
}

// TestClusterNode: -redis naming one node of a Cluster, as host:port or
// in a URL, is the Cluster, as redis-cli -c takes it: list prints the
// buckets of every master once, and status, limit, pause and resume reach
// a bucket whichever master serves it.
func TestClusterNode(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	c := redistest.StartCluster(t, 3, 0)
	ctx := context.Background()
	l := quota.NewLimiter(c.Client(t))
	names := namesOnEveryMaster(t, c, 2)
	for _, name := range names {
		if err := l.SetLimit(ctx, name, quota.PerSecond(4)); err != nil {
			t.Fatal(err)
		}
	}
	want, _ := json.Marshal(func() []listed {
		var b []listed
		for _, name := range names {
			b = append(b, listed{Name: name})
		}
		return b
	}())

	for _, node := range c.Nodes() {
		for _, spec := range []string{node.Addr(), "redis://" + node.Addr(), "redis://" + node.Addr() + "/0"} {
			if out := mustRun(t, nil, "-redis", spec, "list", "-json"); out != string(want)+"\n" {
				t.Errorf("quotactl -redis %s list -json = %s, want the buckets of every master: %s", spec, out, want)
			}
			if out := mustRun(t, nil, "-redis", spec, "list"); out != strings.Join(names, "\n")+"\n" {
				t.Errorf("quotactl -redis %s list = %q, want %q", spec, out, names)
			}
		}
		// REDIS_URL too.
		if out := mustRun(t, map[string]string{"REDIS_URL": "redis://" + node.Addr()}, "list", "-json"); out != string(want)+"\n" {
			t.Errorf("REDIS_URL=redis://%s quotactl list -json = %s, want %s", node.Addr(), out, want)
		}
	}

	// Every operation through one node, on every bucket: no MOVED, and no
	// warning, since each bucket has its record.
	node := c.Nodes()[0].Addr()
	for _, name := range names {
		out := mustRun(t, nil, "-redis", node, "status", name, "-json")
		if m, err := decode(out); err != nil || m["name"] != name || !jsonEqual(m["override"], map[string]float64{"rate": 4, "burst": 12}) {
			t.Errorf("quotactl -redis %s status %s = %s, %v; want its override of 4/s", node, name, out, err)
		}
		mustRun(t, nil, "-redis", node, "limit", name, "3/s", "2")
		mustRun(t, nil, "-redis", node, "pause", name, "forever")
		st, err := l.Status(ctx, name)
		if err != nil || st.Override == nil || *st.Override != (quota.Limit{Rate: 3, Burst: 2}) || !st.Paused {
			t.Errorf("after quotactl -redis %s limit and pause %s: Status = %+v, %v", node, name, st, err)
		}
		mustRun(t, nil, "-redis", node, "resume", name)
		mustRun(t, nil, "-redis", node, "limit", name, "off")
		if st, err := l.Status(ctx, name); err != nil || st.Override != nil || st.Paused {
			t.Errorf("after quotactl -redis %s resume and limit off %s: Status = %+v, %v", node, name, st, err)
		}
	}

	// A Cluster has database 0 only.
	code, out, errOut := quotaRun(nil, "-redis", "redis://"+node+"/2", "list")
	if code != 2 || out != "" || !strings.HasPrefix(errOut, "quotactl: bad -redis: database 2 of a Redis Cluster: ") {
		t.Errorf("quotactl -redis redis://%s/2 list: exit %d, stdout %q, stderr %q; want exit 2 and the reason", node, code, out, errOut)
	}

	// A user who may not run INFO, as the package's ACL has it, tells a
	// Cluster from HELLO, which Redis lets every user run. One who may not
	// run CLUSTER SLOTS either, which a Cluster client needs, learns that.
	for _, s := range c.Nodes() {
		if err := s.Client(t).Do(ctx, "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info").Err(); err != nil {
			t.Fatal(err)
		}
		if err := s.Client(t).Do(ctx, "ACL", "SETUSER", "noslots", "on", ">pw", "~*", "&*", "+@all", "-info", "-cluster").Err(); err != nil {
			t.Fatal(err)
		}
	}
	for _, name := range names {
		mustRun(t, nil, "-redis", "redis://noinfo:pw@"+node, "status", name)
	}
	if out := mustRun(t, nil, "-redis", "redis://noinfo:pw@"+node, "list", "-json"); out != string(want)+"\n" {
		t.Errorf("quotactl list -json as a user without INFO = %s, want %s", out, want)
	}
	code, out, errOut = quotaRun(nil, "-redis", "redis://noslots:pw@"+node, "status", names[0])
	if code != 1 || out != "" || strings.Count(errOut, "\n") != 1 || !strings.Contains(errOut, "'cluster|slots'") || strings.Contains(errOut, ":pw@") {
		t.Errorf("quotactl status as a user without CLUSTER SLOTS: exit %d, stdout %q, stderr %q; want exit 1 and the command refused", code, out, errOut)
	}
}

// TestPlainWithoutInfo: on a plain server, a user who may not run INFO
// works as before: quotactl takes the server for a plain one.
func TestPlainWithoutInfo(t *testing.T) {
	srv := redistest.Start(t)
	ctx := context.Background()
	if err := srv.Client(t).Do(ctx, "ACL", "SETUSER", "noinfo", "on", ">pw", "~*", "&*", "+@all", "-info").Err(); err != nil {
		t.Fatal(err)
	}
	url := "redis://noinfo:pw@" + srv.Addr()
	mustRunNew(t, nil, "-redis", url, "limit", "api.example.com", "5/s")
	if out := mustRun(t, nil, "-redis", url, "list"); out != "api.example.com\n" {
		t.Errorf("quotactl list as a user without INFO = %q", out)
	}
	if out := mustRun(t, nil, "-redis", url, "status", "api.example.com"); !strings.Contains(out, "limit    5/s, burst 15 (override)") {
		t.Errorf("quotactl status as a user without INFO = %q", out)
	}
}
