package redistest

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"slices"
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
// 16384 slots assigned and ok, the nodes agree on which are masters and
// which replicate which, every master serving slots has replicasPerMaster
// replicas, and every replica is in sync (see [Cluster.WaitInSync]).
//
// Nodes run with --cluster-node-timeout 2000, so a killed master is failed
// over by its replica within a few seconds, provided the replica is in
// sync. Redis Cluster needs at least three masters. The test is skipped (or
// fails, see [Start]) if redis-server or redis-cli is missing.
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

	ready := func(ctx context.Context) error { return c.ready(ctx, masters, replicasPerMaster) }
	if err := waitFor(clusterReadyTimeout, 50*time.Millisecond, ready); err != nil {
		tb.Fatalf("redistest: cluster did not become ready: %v\nredis-cli output:\n%s", err, out)
	}
	for _, s := range c.nodes {
		s.settle = func() error {
			return waitFor(clusterReadyTimeout, pollInterval, func(ctx context.Context) error {
				return c.rejoined(ctx, s)
			})
		}
	}
	return c
}

// ready checks the cluster StartCluster built: every node sees all slots
// served, the nodes agree on a topology of masters masters serving slots
// with replicasPerMaster replicas each, and every replica is in sync.
func (c *Cluster) ready(ctx context.Context, masters, replicasPerMaster int) error {
	if err := c.healthy(ctx); err != nil {
		return err
	}
	topo, err := c.agreed(ctx)
	if err != nil {
		return err
	}
	serving := topo.serving()
	if len(serving) != masters {
		return fmt.Errorf("%d masters serve slots, want %d", len(serving), masters)
	}
	for _, m := range serving {
		if got := len(topo.replicas[m]); got != replicasPerMaster {
			return fmt.Errorf("master %s has %d replicas, want %d", m.Addr(), got, replicasPerMaster)
		}
	}
	if replicasPerMaster == 0 {
		return nil
	}
	return topo.inSync(ctx, serving)
}

// healthy checks that every node sees a complete, healthy cluster.
func (c *Cluster) healthy(ctx context.Context) error {
	for _, s := range c.nodes {
		if err := nodeHealthy(ctx, s.Addr(), len(c.nodes)); err != nil {
			return err
		}
	}
	return nil
}

// nodeHealthy checks that the node at addr sees a complete, healthy
// cluster of n nodes.
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
	return nil
}

// WaitInSync waits until the masters serving keys (every master serving
// slots if no key is given) can be failed over, and fails the test if that
// does not happen within 30 s. It is meant to be called right before a
// test kills such a master. A master can be failed over when:
//
//   - every running, unpaused node answers and they all agree on which nodes
//     are masters and which master each replica follows, none of them
//     flagging a running node as failing (fail, fail?), unreachable
//     (noaddr) or unknown (handshake);
//   - the master has at least one running replica;
//   - each of its running replicas has its link to the master up
//     (master_link_status:up, no sync in progress), is listed by the master
//     as an online replica, and has processed the whole replication stream
//     the master had produced when the check began (slave_repl_offset at
//     least the master's master_repl_offset).
//
// The last condition matters most: a replica that has not completed its
// first sync has no replication offset and counts as disconnected since
// forever, so Redis refuses to fail over to it ("Disconnected from master
// for longer than allowed"), and the killed master's slots stay unserved.
// On an idle cluster the offsets are then equal; under a steady stream of
// writes the replica is at most the writes of the last moments behind.
func (c *Cluster) WaitInSync(keys ...string) {
	c.tb.Helper()
	err := waitFor(clusterReadyTimeout, pollInterval, func(ctx context.Context) error {
		topo, err := c.agreed(ctx)
		if err != nil {
			return err
		}
		masters := topo.serving()
		if len(keys) > 0 {
			masters = nil
			for _, key := range keys {
				m, err := topo.masterFor(ctx, key)
				if err != nil {
					return err
				}
				masters = append(masters, m)
			}
		}
		return topo.inSync(ctx, masters)
	})
	if err != nil {
		c.tb.Fatalf("redistest: cluster replicas not in sync: %v", err)
	}
}

// rejoined checks that the restarted node s is back: the running nodes
// agree on its role, and its master (or s itself, if it is a master) has
// its running replicas in sync.
func (c *Cluster) rejoined(ctx context.Context, s *Server) error {
	topo, err := c.agreed(ctx)
	if err != nil {
		return err
	}
	if m := topo.masterOf[s]; m != nil {
		return replicationInSync(ctx, m, []*Server{s})
	}
	return replicationInSync(ctx, s, topo.replicas[s])
}

// topology is what the running, unpaused nodes of a cluster agree on.
type topology struct {
	live     []*Server             // running, unpaused nodes, in start order
	masterOf map[*Server]*Server   // live replica -> its master
	replicas map[*Server][]*Server // master -> its live replicas
	slots    map[*Server]bool      // live masters serving slots
	nodes    string                // CLUSTER NODES of the first live node
	asked    *Server               // the node that answered nodes
}

// serving returns the live masters that serve slots, in start order.
func (t *topology) serving() []*Server {
	var ms []*Server
	for _, s := range t.live {
		if t.slots[s] {
			ms = append(ms, s)
		}
	}
	return ms
}

// masterFor returns the live master serving key's slot.
func (t *topology) masterFor(ctx context.Context, key string) (*Server, error) {
	cl := adminClient(t.asked.Addr())
	defer cl.Close()
	slot, err := cl.ClusterKeySlot(ctx, key).Result()
	if err != nil {
		return nil, fmt.Errorf("%s: CLUSTER KEYSLOT: %w", t.asked.Addr(), err)
	}
	port, ok := slotOwner(t.nodes, int(slot))
	if ok {
		for _, m := range t.serving() {
			if m.Port() == port {
				return m, nil
			}
		}
	}
	return nil, fmt.Errorf("no running master serves slot %d of key %q: %s", slot, key, describeSlot(t.nodes, int(slot)))
}

// inSync checks that every master in masters has at least one live replica
// and that all of them are in sync (see replicationInSync).
func (t *topology) inSync(ctx context.Context, masters []*Server) error {
	for _, m := range masters {
		if len(t.replicas[m]) == 0 {
			return fmt.Errorf("master %s has no running replica that could take over", m.Addr())
		}
		if err := replicationInSync(ctx, m, t.replicas[m]); err != nil {
			return err
		}
	}
	return nil
}

// agreed asks every running, unpaused node for CLUSTER NODES and returns
// the topology they agree on. It fails if a node does not answer, if the
// views differ about the role or the master of a running node, if any view
// flags a running node as failing, unreachable or still in handshake, or
// if a view lists a node that is not part of this cluster.
func (c *Cluster) agreed(ctx context.Context) (*topology, error) {
	t := &topology{
		masterOf: map[*Server]*Server{},
		replicas: map[*Server][]*Server{},
		slots:    map[*Server]bool{},
	}
	for _, s := range c.nodes {
		if s.Running() && !s.Paused() {
			t.live = append(t.live, s)
		}
	}
	if len(t.live) == 0 {
		return nil, errors.New("no node is running")
	}
	var first map[*Server]string
	for _, s := range t.live {
		cl := adminClient(s.Addr())
		reply, err := cl.ClusterNodes(ctx).Result()
		cl.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: CLUSTER NODES: %w", s.Addr(), err)
		}
		roles, err := c.roles(s, reply, t.live)
		if err != nil {
			return nil, err
		}
		if first == nil {
			first, t.nodes, t.asked = roles, reply, s
			continue
		}
		for _, n := range t.live {
			if roles[n] != first[n] {
				return nil, fmt.Errorf("%s sees %s as %s, %s sees it as %s",
					t.asked.Addr(), n.Addr(), first[n], s.Addr(), roles[n])
			}
		}
	}
	// Read the topology off the first view, now known to be shared.
	entries := map[string]nodeEntry{}
	for _, e := range parseNodes(t.nodes) {
		entries[e.id] = e
	}
	for _, e := range parseNodes(t.nodes) {
		n := c.byPort(e.port)
		if n == nil || !slices.Contains(t.live, n) {
			continue
		}
		if e.isMaster() {
			t.slots[n] = len(e.slots) > 0
			continue
		}
		m := c.byPort(entries[e.master].port)
		t.masterOf[n] = m
		t.replicas[m] = append(t.replicas[m], n)
	}
	return t, nil
}

// roles parses the CLUSTER NODES reply of node s and describes the role of
// every live node in it ("master", "master serving slots", "replica of
// ADDR"), checking the flags and links on the way.
func (c *Cluster) roles(s *Server, reply string, live []*Server) (map[*Server]string, error) {
	entries := parseNodes(reply)
	ids := map[string]nodeEntry{}
	for _, e := range entries {
		ids[e.id] = e
	}
	roles := map[*Server]string{}
	for _, e := range entries {
		if e.has("noaddr") {
			return nil, fmt.Errorf("%s: node %.8s is flagged %s: its address answered with another node ID", s.Addr(), e.id, strings.Join(e.flags, ","))
		}
		n := c.byPort(e.port)
		if n == nil {
			return nil, fmt.Errorf("%s: lists %s (%.8s), which is not a node of this cluster", s.Addr(), e.addr, e.id)
		}
		if !slices.Contains(live, n) {
			continue
		}
		for _, bad := range []string{"fail", "fail?", "handshake"} {
			if e.has(bad) {
				return nil, fmt.Errorf("%s: flags running node %s %s", s.Addr(), n.Addr(), strings.Join(e.flags, ","))
			}
		}
		if e.link != "connected" {
			return nil, fmt.Errorf("%s: its cluster bus link to %s is %s", s.Addr(), n.Addr(), e.link)
		}
		switch {
		case e.isMaster() && len(e.slots) > 0:
			roles[n] = "master serving slots"
		case e.isMaster():
			roles[n] = "master"
		default:
			m, ok := ids[e.master]
			if !ok {
				return nil, fmt.Errorf("%s: replica %s follows unknown node %.8s", s.Addr(), n.Addr(), e.master)
			}
			roles[n] = "replica of " + m.addr
		}
	}
	for _, n := range live {
		if _, ok := roles[n]; !ok {
			return nil, fmt.Errorf("%s: does not list running node %s", s.Addr(), n.Addr())
		}
	}
	return roles, nil
}

// byPort returns the node listening on port, or nil.
func (c *Cluster) byPort(port int) *Server {
	for _, s := range c.nodes {
		if s.Port() == port {
			return s
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
		return 0, fmt.Errorf("%s: no healthy master serves slot %d: %s", addr, slot, describeSlot(nodes, int(slot)))
	}
	return port, nil
}

// nodeEntry is one line of a CLUSTER NODES reply:
//
//	<id> <ip:port@cport[,hostname]> <flags> <master> <ping> <pong> <epoch> <link> <slot>...
//
// where a slot entry is "N", "N-M", or a bracketed migration marker.
type nodeEntry struct {
	id     string
	addr   string // ip:port
	port   int    // 0 for a node without address
	flags  []string
	master string // the master's ID for a replica, "-" otherwise
	link   string // "connected" or "disconnected"
	slots  []string
}

// has reports whether the entry carries flag.
func (e nodeEntry) has(flag string) bool { return slices.Contains(e.flags, flag) }

// isMaster reports whether the entry is flagged master.
func (e nodeEntry) isMaster() bool { return e.has("master") }

// serves reports whether the entry's slots cover slot.
func (e nodeEntry) serves(slot int) bool { return servesSlot(e.slots, slot) }

// parseNodes parses a CLUSTER NODES reply, skipping malformed lines.
func parseNodes(nodes string) []nodeEntry {
	var entries []nodeEntry
	for _, line := range strings.Split(nodes, "\n") {
		f := strings.Fields(line)
		if len(f) < 8 {
			continue
		}
		e := nodeEntry{id: f[0], flags: strings.Split(f[2], ","), master: f[3], link: f[7], slots: f[8:]}
		hostPort, _, _ := strings.Cut(f[1], "@")
		e.addr = hostPort
		if i := strings.LastIndexByte(hostPort, ':'); i >= 0 {
			e.port, _ = strconv.Atoi(hostPort[i+1:])
		}
		entries = append(entries, e)
	}
	return entries
}

// slotOwner parses a CLUSTER NODES reply and returns the port of the
// master, not flagged as failed or without address, that serves slot.
func slotOwner(nodes string, slot int) (int, bool) {
	for _, e := range parseNodes(nodes) {
		if !e.isMaster() || e.has("fail") || e.has("noaddr") || e.port == 0 {
			continue
		}
		if e.serves(slot) {
			return e.port, true
		}
	}
	return 0, false
}

// describeSlot says which node a CLUSTER NODES reply has serving slot, with
// its flags, for error messages.
func describeSlot(nodes string, slot int) string {
	for _, e := range parseNodes(nodes) {
		if e.serves(slot) {
			return fmt.Sprintf("it is served by %.8s at %q flagged %s (link %s)", e.id, e.addr, strings.Join(e.flags, ","), e.link)
		}
	}
	return "no node serves it"
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
