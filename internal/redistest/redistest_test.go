package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

func TestStartSetGet(t *testing.T) {
	t.Parallel()
	s := Start(t)
	if s.Port() < minPort || s.Port() > maxPort {
		t.Fatalf("port %d outside [%d, %d]", s.Port(), minPort, maxPort)
	}
	if want := fmt.Sprintf("127.0.0.1:%d", s.Port()); s.Addr() != want {
		t.Fatalf("Addr() = %q, want %q", s.Addr(), want)
	}
	ctx := context.Background()
	c := s.Client(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET = %q, %v; want v", got, err)
	}
}

func TestStartExtraArgs(t *testing.T) {
	t.Parallel()
	s := Start(t, "--maxmemory", "10mb")
	got, err := s.Client(t).ConfigGet(context.Background(), "maxmemory").Result()
	if err != nil {
		t.Fatalf("CONFIG GET: %v", err)
	}
	if got["maxmemory"] != "10485760" {
		t.Fatalf("maxmemory = %q, want 10485760", got["maxmemory"])
	}
}

func TestKillRestart(t *testing.T) {
	Long(t)
	t.Parallel()
	s := Start(t)
	ctx := context.Background()
	c := s.Client(t, func(o *redis.Options) { o.MaxRetries = -1 })
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	port := s.Port()

	s.Kill()
	if s.Running() {
		t.Fatal("Running() after Kill")
	}
	if err := c.Get(ctx, "k").Err(); err == nil {
		t.Fatal("GET on a killed server succeeded")
	}
	if _, err := net.DialTimeout("tcp", s.Addr(), time.Second); err == nil {
		t.Fatal("dial to a killed server succeeded")
	}
	s.Kill() // killing twice is a no-op

	s.Restart()
	if s.Port() != port {
		t.Fatalf("port changed across Restart: %d -> %d", port, s.Port())
	}
	if err := c.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("GET after restart: err = %v, want redis.Nil (data gone)", err)
	}
	if err := c.Set(ctx, "k", "v2", 0).Err(); err != nil {
		t.Fatalf("SET after restart: %v", err)
	}

	s.Restart() // restart of a running server
	if err := c.Get(ctx, "k").Err(); !errors.Is(err, redis.Nil) {
		t.Fatalf("GET after second restart: err = %v, want redis.Nil", err)
	}
}

func TestPauseResume(t *testing.T) {
	t.Parallel()
	s := Start(t)
	ctx := context.Background()
	c := s.Client(t, func(o *redis.Options) {
		o.ReadTimeout = 200 * time.Millisecond
		o.MaxRetries = -1
	})
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}

	s.Pause()
	s.Pause() // pausing twice is a no-op
	if !s.Paused() {
		t.Fatal("Paused() = false after Pause")
	}
	start := time.Now()
	err := c.Get(ctx, "k").Err()
	var nerr net.Error
	if !errors.As(err, &nerr) || !nerr.Timeout() {
		t.Fatalf("GET while paused: err = %v, want a timeout", err)
	}
	if d := time.Since(start); d < 150*time.Millisecond || d > 5*time.Second {
		t.Fatalf("GET while paused returned after %v, want about 200ms", d)
	}

	s.Resume()
	s.Resume() // resuming twice is a no-op
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET after resume = %q, %v; want v", got, err)
	}

	// Killing a paused server works too.
	s.Pause()
	s.Kill()
	s.Restart()
	if err := c.Ping(ctx).Err(); err != nil {
		t.Fatalf("PING after pause, kill, restart: %v", err)
	}
}

// TestLaunchOnTakenPort checks that a launch on a port another server
// already answers on fails as a port in use (so that Start picks another
// port) instead of taking the other server's PONG for its own.
func TestLaunchOnTakenPort(t *testing.T) {
	t.Parallel()
	s := Start(t)
	other := newServer(t, lookBinary(t, "redis-server", serverInstallHint()), t.TempDir(), func(port int) ([]string, error) {
		return []string{"--port", strconv.Itoa(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"}, nil
	})
	other.mu.Lock()
	err := other.launchLocked(s.Port())
	other.port = 0 // the port is s's: other's cleanup must not release it
	other.mu.Unlock()
	if !errors.Is(err, errPortInUse) {
		t.Fatalf("launch on the port of %s: err = %v, want errPortInUse", s.Addr(), err)
	}
}

func TestCluster(t *testing.T) {
	Long(t)
	t.Parallel()
	start := time.Now()
	cl := StartCluster(t, 3, 1)
	t.Logf("cluster of %d nodes ready in %v", len(cl.Nodes()), time.Since(start))
	if len(cl.Nodes()) != 6 || len(cl.Addrs()) != 6 {
		t.Fatalf("got %d nodes, %d addrs; want 6", len(cl.Nodes()), len(cl.Addrs()))
	}
	for _, n := range cl.Nodes() {
		if n.Port() > maxPort {
			t.Fatalf("node port %d above %d", n.Port(), maxPort)
		}
	}

	ctx := context.Background()
	c := cl.Client(t)
	for i := range 100 {
		key := fmt.Sprintf("key:%d", i)
		if err := c.Set(ctx, key, i, 0).Err(); err != nil {
			t.Fatalf("SET %s: %v", key, err)
		}
	}

	masters := map[string]bool{}
	for i := range 100 {
		key := fmt.Sprintf("key:%d", i)
		m := cl.MasterFor(key)
		masters[m.Addr()] = true
		// A plain client on the master reads the key without MOVED.
		got, err := m.Client(t).Get(ctx, key).Int()
		if err != nil || got != i {
			t.Fatalf("GET %s on %s = %d, %v; want %d", key, m.Addr(), got, err, i)
		}
	}
	if len(masters) != 3 {
		t.Fatalf("100 keys landed on %d masters, want 3", len(masters))
	}

	// Kill the master of key:0 while a client keeps writing to its slot,
	// once its replica is in sync: the replica takes over the slot with the
	// data, and the restarted node rejoins the cluster as its replica.
	stop := make(chan struct{})
	writes := make(chan int)
	go func() {
		n := 0
		for {
			select {
			case <-stop:
				writes <- n
				return
			default:
			}
			ctx, cancel := context.WithTimeout(ctx, time.Second)
			if c.Incr(ctx, "{key:0}:writes").Err() == nil {
				n++
			}
			cancel()
		}
	}()
	began := time.Now()
	cl.WaitInSync("key:0")
	t.Logf("replicas of key:0's master in sync after %v, under writes", time.Since(began))
	old := cl.MasterFor("key:0")
	old.Kill()
	killed := time.Now()
	var promoted *Server
	if err := waitFor(20*time.Second, 100*time.Millisecond, func(context.Context) error {
		m, err := cl.LookupMaster("key:0")
		if err != nil {
			return err
		}
		if m == old {
			return errors.New("killed master still serves key:0")
		}
		promoted = m
		return nil
	}); err != nil {
		t.Fatalf("failover: %v", err)
	}
	t.Logf("replica %s took over from %s in %v", promoted.Addr(), old.Addr(), time.Since(killed))
	close(stop)
	t.Logf("%d writes acknowledged before the failover", <-writes)
	if got, err := promoted.Client(t).Get(ctx, "key:0").Int(); err != nil || got != 0 {
		t.Fatalf("GET key:0 on the promoted replica = %d, %v; want 0", got, err)
	}
	// A connection refused from the dead master does not make go-redis
	// reload its slot map (only MOVED does, or the 60 s default
	// ClusterStateReloadInterval), so ask for a reload explicitly.
	if err := waitFor(10*time.Second, 100*time.Millisecond, func(ctx context.Context) error {
		c.ReloadState(ctx)
		return c.Set(ctx, "key:0", "after", 0).Err()
	}); err != nil {
		t.Fatalf("SET through the cluster client after failover: %v", err)
	}
	// Restart returns once the node has rejoined as the promoted node's
	// replica and caught up with it.
	old.Restart()
	t.Logf("%s back as a replica in sync %v after the kill", old.Addr(), time.Since(killed))
	if got := replicaOf(t, old); got != promoted.Port() {
		t.Fatalf("after restart %s replicates port %d, want %s", old.Addr(), got, promoted.Addr())
	}
	if err := cl.healthy(ctx); err != nil {
		t.Fatalf("cluster after restarting %s: %v", old.Addr(), err)
	}
	if m := cl.MasterFor("key:0"); m != promoted {
		t.Fatalf("after restart MasterFor(key:0) = %s, want %s", m.Addr(), promoted.Addr())
	}
	cl.WaitInSync()
	t.Logf("cluster healthy and in sync again %v after the kill", time.Since(killed))
}

func TestSentinel(t *testing.T) {
	Long(t)
	t.Parallel()
	start := time.Now()
	s := StartSentinel(t)
	t.Logf("sentinel setup ready in %v", time.Since(start))
	if s.MasterName() != "quota-master" {
		t.Fatalf("MasterName() = %q", s.MasterName())
	}
	if len(s.SentinelAddrs()) == 0 {
		t.Fatal("no sentinel addresses")
	}

	ctx := context.Background()
	c := s.FailoverClient(t)
	if err := c.Set(ctx, "k", "v", 0).Err(); err != nil {
		t.Fatalf("SET: %v", err)
	}
	if got, err := c.Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET = %q, %v; want v", got, err)
	}
	// The write went to the master and replicates to the replica.
	if got, err := s.Master().Client(t).Get(ctx, "k").Result(); err != nil || got != "v" {
		t.Fatalf("GET on master = %q, %v; want v", got, err)
	}
	rc := s.Replica().Client(t)
	if err := waitFor(5*time.Second, 20*time.Millisecond, func(ctx context.Context) error {
		got, err := rc.Get(ctx, "k").Result()
		if err != nil {
			return err
		}
		if got != "v" {
			return fmt.Errorf("replica has %q", got)
		}
		return nil
	}); err != nil {
		t.Fatalf("replica: %v", err)
	}

	// Kill the master once the replica is in sync: the sentinel promotes
	// the replica and the failover client follows it.
	began := time.Now()
	s.WaitInSync()
	t.Logf("replica in sync after %v", time.Since(began))
	if m := s.CurrentMaster(); m != s.Master() {
		t.Fatalf("CurrentMaster() = %s, want %s", m.Addr(), s.Master().Addr())
	}
	s.Master().Kill()
	killed := time.Now()
	sc := redis.NewSentinelClient(&redis.Options{Addr: s.SentinelAddrs()[0]})
	defer sc.Close()
	if err := waitFor(20*time.Second, 100*time.Millisecond, func(ctx context.Context) error {
		addr, err := sc.GetMasterAddrByName(ctx, s.MasterName()).Result()
		if err != nil {
			return err
		}
		if got := net.JoinHostPort(addr[0], addr[1]); got != s.Replica().Addr() {
			return fmt.Errorf("sentinel reports master %s", got)
		}
		return c.Set(ctx, "k", "after", 0).Err()
	}); err != nil {
		t.Fatalf("failover: %v", err)
	}
	t.Logf("failover to %s done %v after the kill", s.Replica().Addr(), time.Since(killed))
	if got, err := rc.Get(ctx, "k").Result(); err != nil || got != "after" {
		t.Fatalf("GET on promoted replica = %q, %v; want after", got, err)
	}
	if m := s.CurrentMaster(); m != s.Replica() {
		t.Fatalf("after failover CurrentMaster() = %s, want %s", m.Addr(), s.Replica().Addr())
	}

}

// replicaOf returns the port of the master that s replicates, or 0 if s is
// a master.
func replicaOf(t *testing.T, s *Server) int {
	t.Helper()
	info, err := s.Client(t).Info(context.Background(), "replication").Result()
	if err != nil {
		t.Fatalf("INFO replication on %s: %v", s.Addr(), err)
	}
	if infoField(info, "role") != "slave" {
		return 0
	}
	port, err := strconv.Atoi(infoField(info, "master_port"))
	if err != nil {
		t.Fatalf("%s: master_port: %v", s.Addr(), err)
	}
	return port
}

func TestSlotOwner(t *testing.T) {
	nodes := `aaaa 127.0.0.1:30009@31009 master,fail - 0 0 1 connected 10923
07c37dfeb235213a872192d90877d0cd55635b91 127.0.0.1:30004@31004,host4 slave e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 0 1426238317239 4 connected
67ed2db8d677e59ec4a4cefb06858cf2a1a89fa1 127.0.0.1:30002@31002 master - 0 1426238316232 2 connected 5461-10922
292f8b365bb7edb5e285caf0b7e6ddc7265d2f4f 127.0.0.1:30003@31003 master - 0 1426238318243 3 connected 10923-16383 [123->-abc]
e7d1eecce10fd6bb5eb35b9f99a514335d9ba9ca 127.0.0.1:30001@31001 myself,master - 0 0 1 connected 0-5460
`
	for _, tc := range []struct {
		slot, port int
		ok         bool
	}{
		{0, 30001, true}, {5460, 30001, true}, {5461, 30002, true},
		{7000, 30002, true}, {10923, 30003, true}, {16383, 30003, true}, {16384, 0, false},
	} {
		port, ok := slotOwner(nodes, tc.slot)
		if port != tc.port || ok != tc.ok {
			t.Errorf("slotOwner(%d) = %d, %v; want %d, %v", tc.slot, port, ok, tc.port, tc.ok)
		}
	}

	// A master that answered with another node ID at its address is
	// flagged noaddr and loses its address: it serves no key.
	noaddr := "bbbb :0@0 master,fail?,noaddr - 1 1 2 disconnected 0-5460\n"
	if port, ok := slotOwner(noaddr, 42); ok {
		t.Errorf("slotOwner on a noaddr master = %d, want none", port)
	}
	if got, want := describeSlot(noaddr, 42), `it is served by bbbb at ":0" flagged master,fail?,noaddr (link disconnected)`; got != want {
		t.Errorf("describeSlot = %q, want %q", got, want)
	}
	if got, want := describeSlot(nodes, 16384), "no node serves it"; got != want {
		t.Errorf("describeSlot(16384) = %q, want %q", got, want)
	}
}

// portHelperEnv names the port that TestPortLockHelperProcess, run as a
// child of TestPortsReservedAcrossProcesses, tries to lock.
const portHelperEnv = "REDISTEST_HELPER_LOCK_PORT"

// TestPortsReservedAcrossProcesses checks that a port reserved by this
// test binary cannot be reserved by another process until it is released.
func TestPortsReservedAcrossProcesses(t *testing.T) {
	Long(t)
	p, err := reservePort()
	if err != nil {
		t.Fatal(err)
	}
	released := false
	defer func() {
		if !released {
			releasePort(p)
		}
	}()
	tryLock := func(port int) string {
		t.Helper()
		cmd := exec.Command(os.Args[0], "-test.run=^TestPortLockHelperProcess$", "-test.v")
		cmd.Env = append(os.Environ(), portHelperEnv+"="+strconv.Itoa(port))
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("helper process: %v\n%s", err, out)
		}
		for _, line := range strings.Split(string(out), "\n") {
			if v, ok := strings.CutPrefix(strings.TrimSpace(line), "lock:"); ok {
				return v
			}
		}
		t.Fatalf("helper process printed no result:\n%s", out)
		return ""
	}
	if got := tryLock(p); got != "busy" {
		t.Fatalf("another process locking reserved port %d: %s, want busy", p, got)
	}
	if got := tryLock(p + busPortOffset); got != "busy" {
		t.Fatalf("another process locking reserved bus port %d: %s, want busy", p+busPortOffset, got)
	}
	releasePort(p)
	released = true
	if got := tryLock(p); got != "locked" {
		t.Fatalf("another process locking released port %d: %s, want locked", p, got)
	}
}

// TestPortLockHelperProcess runs only as a child process of
// TestPortsReservedAcrossProcesses: it tries to lock the port it is given.
func TestPortLockHelperProcess(t *testing.T) {
	v := os.Getenv(portHelperEnv)
	if v == "" {
		t.Skip("helper process for TestPortsReservedAcrossProcesses")
	}
	port, err := strconv.Atoi(v)
	if err != nil {
		t.Fatal(err)
	}
	f, ok := lockPort(port)
	switch {
	case !ok:
		fmt.Println("lock:busy")
	case f == nil:
		fmt.Println("lock:unavailable")
	default:
		fmt.Println("lock:locked")
		f.Close()
	}
}

func TestListedReplicaState(t *testing.T) {
	info := "# Replication\r\nrole:master\r\nconnected_slaves:2\r\n" +
		"slave0:ip=127.0.0.1,port=7001,state=online,offset=1234,lag=0\r\n" +
		"slave1:ip=127.0.0.1,port=7002,state=wait_bgsave,offset=0,lag=0\r\n" +
		"master_repl_offset:1234\r\n"
	for port, want := range map[int]string{7001: "online", 7002: "wait_bgsave", 7003: ""} {
		if got := listedReplicaState(info, port); got != want {
			t.Errorf("listedReplicaState(%d) = %q, want %q", port, got, want)
		}
	}
	// A replica's own INFO has slave_* fields but lists no replica.
	if got := listedReplicaState("role:slave\r\nslave_repl_offset:7001\r\nslave_priority:100\r\n", 7001); got != "" {
		t.Errorf("listedReplicaState on a replica's INFO = %q, want none", got)
	}
}
