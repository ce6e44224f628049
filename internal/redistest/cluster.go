package redistest

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

const (
	// clusterCreateTimeout bounds the redis-cli --cluster create run.
	clusterCreateTimeout = 60 * time.Second
	// clusterReadyTimeout bounds the wait for a healthy cluster.
	clusterReadyTimeout = 30 * time.Second
	// clusterSlots is the number of hash slots in a Redis Cluster.
	clusterSlots = 16384
)

// Cluster is a Redis Cluster of real redis-server processes started by
// [StartCluster]. Its nodes are killed when the test finishes.
type Cluster struct {
	tb    testing.TB
	nodes []*Server
}

// StartCluster starts masters*(1+replicasPerMaster) cluster-enabled
// redis-server processes, joins them with
//
//	redis-cli --cluster create ADDRS... --cluster-replicas R --cluster-yes
//
// and waits (up to 30 s) until every node reports cluster_state:ok with all
// 16384 slots assigned and ok, knows every other node, and every replica's
// link to its master is up.
//
// Nodes run with --cluster-node-timeout 2000, so a killed master is failed
// over by its replica within a few seconds. Redis Cluster needs at least
// three masters. The test is skipped (or fails, see [Start]) if
// redis-server or redis-cli is missing.
func StartCluster(tb testing.TB, masters, replicasPerMaster int) *Cluster {
	tb.Helper()
	if masters < 3 {
		tb.Fatalf("redistest: a Redis Cluster needs at least 3 masters, got %d", masters)
	}
	if replicasPerMaster < 0 {
		tb.Fatalf("redistest: negative replicasPerMaster %d", replicasPerMaster)
	}
	lookBinary(tb, "redis-server", serverInstallHint())
	cli := lookBinary(tb, "redis-cli", serverInstallHint())

	n := masters * (1 + replicasPerMaster)
	c := &Cluster{tb: tb}
	for i := 0; i < n; i++ {
		c.nodes = append(c.nodes, Start(tb,
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes-"+strconv.Itoa(i)+".conf",
			"--cluster-node-timeout", "2000",
			"--cluster-announce-ip", "127.0.0.1",
			"--repl-diskless-sync-delay", "0",
		))
	}

	args := append([]string{"--cluster", "create"}, c.Addrs()...)
	args = append(args, "--cluster-replicas", strconv.Itoa(replicasPerMaster), "--cluster-yes")
	ctx, cancel := context.WithTimeout(context.Background(), clusterCreateTimeout)
	defer cancel()
	out, err := exec.CommandContext(ctx, cli, args...).CombinedOutput()
	if err != nil {
		tb.Fatalf("redistest: redis-cli %s: %v\n%s", strings.Join(args, " "), err, out)
	}

	if err := waitFor(clusterReadyTimeout, 50*time.Millisecond, c.healthy); err != nil {
		tb.Fatalf("redistest: cluster did not become ready: %v\nredis-cli output:\n%s", err, out)
	}
	return c
}

// healthy checks every node's view of the cluster.
func (c *Cluster) healthy(ctx context.Context) error {
	for _, s := range c.nodes {
		if err := nodeHealthy(ctx, s.Addr(), len(c.nodes)); err != nil {
			return err
		}
	}
	return nil
}

// nodeHealthy checks that the node at addr sees a complete, healthy
// cluster of n nodes and, if it is a replica, is linked to its master.
func nodeHealthy(ctx context.Context, addr string, n int) error {
	cl := adminClient(addr)
	defer cl.Close()
	info, err := cl.ClusterInfo(ctx).Result()
	if err != nil {
		return fmt.Errorf("%s: CLUSTER INFO: %w", addr, err)
	}
	want := map[string]string{
		"cluster_state":          "ok",
		"cluster_slots_assigned": strconv.Itoa(clusterSlots),
		"cluster_slots_ok":       strconv.Itoa(clusterSlots),
		"cluster_known_nodes":    strconv.Itoa(n),
	}
	for field, v := range want {
		if got := infoField(info, field); got != v {
			return fmt.Errorf("%s: %s is %q, want %q", addr, field, got, v)
		}
	}
	repl, err := cl.Info(ctx, "replication").Result()
	if err != nil {
		return fmt.Errorf("%s: INFO replication: %w", addr, err)
	}
	if infoField(repl, "role") == "slave" {
		if st := infoField(repl, "master_link_status"); st != "up" {
			return fmt.Errorf("%s: replica master_link_status is %q", addr, st)
		}
	}
	return nil
}

// Addrs returns the addresses of all nodes, masters and replicas, in start
// order.
func (c *Cluster) Addrs() []string {
	addrs := make([]string, len(c.nodes))
	for i, s := range c.nodes {
		addrs[i] = s.Addr()
	}
	return addrs
}

// Nodes returns all nodes in start order. Which of them are masters is
// decided by redis-cli and changes on failover; use [Cluster.MasterFor] to
// find the master serving a key.
func (c *Cluster) Nodes() []*Server {
	return append([]*Server(nil), c.nodes...)
}

// Client returns a go-redis cluster client seeded with every node's
// address. Each opts function may adjust the options before the client is
// created. The client is closed when the test finishes, before the nodes
// are killed.
func (c *Cluster) Client(tb testing.TB, opts ...func(*redis.ClusterOptions)) *redis.ClusterClient {
	tb.Helper()
	o := &redis.ClusterOptions{Addrs: c.Addrs()}
	for _, f := range opts {
		f(o)
	}
	cl := redis.NewClusterClient(o)
	tb.Cleanup(func() { _ = cl.Close() })
	return cl
}

// MasterFor returns the node currently serving key as master, as reported
// by [Cluster.LookupMaster]. It fails the test if no master is found.
func (c *Cluster) MasterFor(key string) *Server {
	c.tb.Helper()
	m, err := c.LookupMaster(key)
	if err != nil {
		c.tb.Fatalf("redistest: %v", err)
	}
	return m
}

// LookupMaster returns the node currently serving key as master. It asks
// the first running, unpaused node for CLUSTER KEYSLOT and CLUSTER NODES and
// moves on to the next node if that one cannot answer. Masters flagged as
// failed ("fail", not the tentative "fail?") are ignored, so during a
// failover it returns an error until a replica has taken over the slot.
// Unlike MasterFor it does not fail the test, which suits polling.
func (c *Cluster) LookupMaster(key string) (*Server, error) {
	var errs []string
	for _, s := range c.nodes {
		if !s.Running() || s.Paused() {
			continue
		}
		port, err := masterPortFor(s.Addr(), key)
		if err != nil {
			errs = append(errs, err.Error())
			continue
		}
		for _, m := range c.nodes {
			if m.Port() == port {
				return m, nil
			}
		}
		errs = append(errs, fmt.Sprintf("%s: master port %d is not a node of this cluster", s.Addr(), port))
	}
	if len(errs) == 0 {
		errs = append(errs, "no node is running")
	}
	return nil, fmt.Errorf("no master found for key %q: %s", key, strings.Join(errs, "; "))
}

// masterPortFor asks the node at addr which master serves key's slot and
// returns that master's port.
func masterPortFor(addr, key string) (int, error) {
	ctx, cancel := context.WithTimeout(context.Background(), queryTimeout)
	defer cancel()
	cl := adminClient(addr)
	defer cl.Close()
	slot, err := cl.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return 0, fmt.Errorf("%s: CLUSTER KEYSLOT: %w", addr, err)
	}
	nodes, err := cl.ClusterNodes(ctx).Result()
	if err != nil {
		return 0, fmt.Errorf("%s: CLUSTER NODES: %w", addr, err)
	}
	port, ok := slotOwner(nodes, int(slot))
	if !ok {
		return 0, fmt.Errorf("%s: no healthy master serves slot %d", addr, slot)
	}
	return port, nil
}

// slotOwner parses a CLUSTER NODES reply and returns the port of the
// master, not flagged as failed, that serves slot.
//
// Each line reads
//
//	<id> <ip:port@cport[,hostname]> <flags> <master> <ping> <pong> <epoch> <link> <slot>...
//
// where a slot entry is "N", "N-M", or a bracketed migration marker.
func slotOwner(nodes string, slot int) (int, bool) {
	for _, line := range strings.Split(nodes, "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		flags := strings.Split(f[2], ",")
		if !hasFlag(flags, "master") || hasFlag(flags, "fail") || hasFlag(flags, "noaddr") {
			continue
		}
		if !servesSlot(f[8:], slot) {
			continue
		}
		hostPort, _, _ := strings.Cut(f[1], "@")
		i := strings.LastIndexByte(hostPort, ':')
		if i < 0 {
			continue
		}
		port, err := strconv.Atoi(hostPort[i+1:])
		if err != nil {
			continue
		}
		return port, true
	}
	return 0, false
}

func hasFlag(flags []string, flag string) bool {
	for _, f := range flags {
		if f == flag {
			return true
		}
	}
	return false
}

// servesSlot reports whether the slot entries of a CLUSTER NODES line
// cover slot.
func servesSlot(entries []string, slot int) bool {
	for _, e := range entries {
		if strings.HasPrefix(e, "[") {
			continue
		}
		lo, hi, isRange := strings.Cut(e, "-")
		a, err := strconv.Atoi(lo)
		if err != nil {
			continue
		}
		b := a
		if isRange {
			if b, err = strconv.Atoi(hi); err != nil {
				continue
			}
		}
		if slot >= a && slot <= b {
			return true
		}
	}
	return false
}
