package redistest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// SentinelMasterName is the name under which [StartSentinel]'s sentinel
// monitors the master.
const SentinelMasterName = "quota-master"

const (
	// sentinelReadyTimeout bounds each wait in StartSentinel and
	// [Sentinel.WaitInSync].
	sentinelReadyTimeout = 20 * time.Second
	// sentinelRejoinTimeout bounds the wait after restarting a server of a
	// Sentinel setup. An old master that comes back after a failover is
	// turned into a replica by the sentinel only once two of its INFO
	// replies, sent every 10 s, have reported it as a master at least 8 s
	// apart (4 times the 2 s hello period): about 10 s after the restart,
	// and then it has to sync.
	sentinelRejoinTimeout = 40 * time.Second
)

// Sentinel is a master, one replica and one redis-sentinel monitoring them,
// started by [StartSentinel]. All processes are killed when the test
// finishes.
//
// The sentinel runs with quorum 1, down-after-milliseconds 1000 and
// failover-timeout 5000, so after [Server.Kill] on the master the replica is
// promoted within a few seconds.
type Sentinel struct {
	tb        testing.TB
	master    *Server
	replica   *Server
	sentinels []*Server
}

// StartSentinel starts a master, a replica of it (--replicaof) and one
// redis-sentinel monitoring the master as "quota-master". It returns once
// the replica is in sync and the sentinel reports the master and the
// replica, as [Sentinel.WaitInSync] checks. The sentinel's configuration
// file lives in its own temporary directory, since sentinel rewrites it.
//
// The test is skipped (or fails, see [Start]) if redis-server or
// redis-sentinel is missing.
func StartSentinel(tb testing.TB) *Sentinel {
	tb.Helper()
	lookBinary(tb, "redis-server", serverInstallHint())
	sentinelBin := lookBinary(tb, "redis-sentinel", sentinelInstallHint())

	// Diskless sync normally waits 5 s for more replicas; don't.
	fast := []string{"--repl-diskless-sync-delay", "0"}
	master := Start(tb, fast...)
	replica := Start(tb, append([]string{"--replicaof", "127.0.0.1", strconv.Itoa(master.Port())}, fast...)...)

	// Start the sentinel only once the master lists the replica, so that
	// the sentinel's first INFO to the master already discovers it instead
	// of after the 10 s INFO period.
	if err := waitFor(sentinelReadyTimeout, 50*time.Millisecond, func(ctx context.Context) error {
		return replicationInSync(ctx, master, []*Server{replica})
	}); err != nil {
		tb.Fatalf("redistest: replica %s did not sync with %s: %v", replica.Addr(), master.Addr(), err)
	}

	dir := tb.TempDir()
	conf := filepath.Join(dir, "sentinel.conf")
	confPort := 0
	sent := newServer(tb, sentinelBin, dir, func(port int) ([]string, error) {
		// Write the configuration for a new port only: on restart the file
		// sentinel rewrote (its id, the current master) is kept.
		if port != confPort {
			if err := writeSentinelConf(conf, dir, port, master.Port()); err != nil {
				return nil, err
			}
			confPort = port
		}
		return []string{conf}, nil
	})
	sent.startFresh()

	s := &Sentinel{tb: tb, master: master, replica: replica, sentinels: []*Server{sent}}
	if err := waitFor(sentinelReadyTimeout, 50*time.Millisecond, s.inSync); err != nil {
		tb.Fatalf("redistest: sentinel %s not ready: %v", sent.Addr(), err)
	}
	for _, srv := range []*Server{master, replica, sent} {
		srv.settle = func() error { return waitFor(sentinelRejoinTimeout, pollInterval, s.inSync) }
	}
	return s
}

// writeSentinelConf writes a sentinel configuration monitoring the master on
// masterPort.
func writeSentinelConf(path, dir string, port, masterPort int) error {
	conf := fmt.Sprintf(`port %d
bind 127.0.0.1
daemonize no
dir %q
sentinel monitor %s 127.0.0.1 %d 1
sentinel down-after-milliseconds %s 1000
sentinel failover-timeout %s 5000
sentinel parallel-syncs %s 1
`, port, dir, SentinelMasterName, masterPort, SentinelMasterName, SentinelMasterName, SentinelMasterName)
	return os.WriteFile(path, []byte(conf), 0o644)
}

// WaitInSync waits until the master that the sentinels currently report
// can be failed over, and fails the test if that does not happen within
// 20 s. It is meant to be called right before a test kills the master
// (which, after a failover, is [Sentinel.CurrentMaster], not necessarily
// [Sentinel.Master]). The master can be failed over when:
//
//   - every running, unpaused sentinel reports the same master, one of the
//     two servers, and does not flag it as down;
//   - the other server is running, is a replica of that master with its
//     link up, is listed by the master as online, and has processed the
//     whole replication stream the master had produced when the check began
//     (slave_repl_offset at least the master's master_repl_offset);
//   - every such sentinel lists that replica without a down or
//     disconnected flag.
//
// A replica that has not finished its first sync would otherwise be
// promoted with none of the master's data, or skipped by the sentinel.
func (s *Sentinel) WaitInSync() {
	s.tb.Helper()
	if err := waitFor(sentinelReadyTimeout, pollInterval, s.inSync); err != nil {
		s.tb.Fatalf("redistest: sentinel replica not in sync: %v", err)
	}
}

// CurrentMaster returns the server that the sentinels currently report as
// master: [Sentinel.Master] until a failover, [Sentinel.Replica] after
// one. It fails the test if the sentinels cannot tell or disagree.
func (s *Sentinel) CurrentMaster() *Server {
	s.tb.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), queryTimeout)
	defer cancel()
	m, _, err := s.current(ctx)
	if err != nil {
		s.tb.Fatalf("redistest: %v", err)
	}
	return m
}

// current asks every running, unpaused sentinel for the master and returns
// it and the other server.
func (s *Sentinel) current(ctx context.Context) (master, replica *Server, err error) {
	var addr string
	for _, sent := range s.sentinels {
		if !sent.Running() || sent.Paused() {
			continue
		}
		sc := sentinelClient(sent.Addr())
		a, err := sc.GetMasterAddrByName(ctx, SentinelMasterName).Result()
		sc.Close()
		if err != nil {
			return nil, nil, fmt.Errorf("sentinel %s: SENTINEL GET-MASTER-ADDR-BY-NAME: %w", sent.Addr(), err)
		}
		if len(a) != 2 {
			return nil, nil, fmt.Errorf("sentinel %s reports master %v", sent.Addr(), a)
		}
		got := net.JoinHostPort(a[0], a[1])
		if addr != "" && got != addr {
			return nil, nil, fmt.Errorf("sentinels disagree on the master: %s and %s", addr, got)
		}
		addr = got
	}
	switch addr {
	case "":
		return nil, nil, errors.New("no sentinel is running")
	case s.master.Addr():
		return s.master, s.replica, nil
	case s.replica.Addr():
		return s.replica, s.master, nil
	}
	return nil, nil, fmt.Errorf("sentinels report master %s, which is neither %s nor %s", addr, s.master.Addr(), s.replica.Addr())
}

// inSync is the check of WaitInSync.
func (s *Sentinel) inSync(ctx context.Context) error {
	master, replica, err := s.current(ctx)
	if err != nil {
		return err
	}
	for _, srv := range []*Server{master, replica} {
		if !srv.Running() || srv.Paused() {
			return fmt.Errorf("%s is not running", srv.Addr())
		}
	}
	if err := replicationInSync(ctx, master, []*Server{replica}); err != nil {
		return err
	}
	for _, sent := range s.sentinels {
		if !sent.Running() || sent.Paused() {
			continue
		}
		sc := sentinelClient(sent.Addr())
		err := sentinelSees(ctx, sc, replica.Port())
		sc.Close()
		if err != nil {
			return fmt.Errorf("sentinel %s: %w", sent.Addr(), err)
		}
	}
	return nil
}

// sentinelClient returns a short-lived client for helper queries to the
// sentinel at addr.
func sentinelClient(addr string) *redis.SentinelClient {
	return redis.NewSentinelClient(&redis.Options{
		Addr:        addr,
		DialTimeout: queryTimeout, ReadTimeout: queryTimeout, WriteTimeout: queryTimeout,
		MaxRetries: -1, PoolSize: 1, DisableIdentity: true,
	})
}

// sentinelSees checks that the sentinel does not flag the master as down
// and lists the replica on replicaPort as a reachable replica.
func sentinelSees(ctx context.Context, sc *redis.SentinelClient, replicaPort int) error {
	m, err := sc.Master(ctx, SentinelMasterName).Result()
	if err != nil {
		return fmt.Errorf("SENTINEL MASTER: %w", err)
	}
	if m["flags"] != "master" {
		return fmt.Errorf("master %s:%s flagged %s", m["ip"], m["port"], m["flags"])
	}
	replicas, err := sc.Replicas(ctx, SentinelMasterName).Result()
	if err != nil {
		return fmt.Errorf("SENTINEL REPLICAS: %w", err)
	}
	for _, r := range replicas {
		if r["port"] != strconv.Itoa(replicaPort) {
			continue
		}
		if r["flags"] != "slave" {
			return fmt.Errorf("replica %s:%s flagged %s", r["ip"], r["port"], r["flags"])
		}
		return nil
	}
	return fmt.Errorf("sentinel does not list replica port %d: %v", replicaPort, replicas)
}

// MasterName returns the name under which the sentinel monitors the master,
// "quota-master".
func (s *Sentinel) MasterName() string { return SentinelMasterName }

// SentinelAddrs returns the sentinels' addresses.
func (s *Sentinel) SentinelAddrs() []string {
	addrs := make([]string, len(s.sentinels))
	for i, sent := range s.sentinels {
		addrs[i] = sent.Addr()
	}
	return addrs
}

// Sentinels returns the sentinel processes, for fault injection on the
// sentinels themselves.
func (s *Sentinel) Sentinels() []*Server {
	return append([]*Server(nil), s.sentinels...)
}

// Master returns the server started as master. After a failover it may have
// become a replica (or be dead); [Sentinel.CurrentMaster] returns the
// current master.
func (s *Sentinel) Master() *Server { return s.master }

// Replica returns the server started as replica. After a failover it may
// have become the master.
func (s *Sentinel) Replica() *Server { return s.replica }

// FailoverClient returns a go-redis client that finds the master through
// the sentinels (redis.NewFailoverClient). Each opts function may adjust
// the options before the client is created (MasterName and SentinelAddrs
// are preset). The client is closed when the test finishes, before the
// servers are killed.
func (s *Sentinel) FailoverClient(tb testing.TB, opts ...func(*redis.FailoverOptions)) *redis.Client {
	tb.Helper()
	o := &redis.FailoverOptions{
		MasterName:    SentinelMasterName,
		SentinelAddrs: s.SentinelAddrs(),
	}
	for _, f := range opts {
		f(o)
	}
	c := redis.NewFailoverClient(o)
	tb.Cleanup(func() { _ = c.Close() })
	return c
}
