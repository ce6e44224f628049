package redistest

import (
	"context"
	"errors"
	"fmt"
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

// sentinelReadyTimeout bounds each wait in StartSentinel.
const sentinelReadyTimeout = 20 * time.Second

// Sentinel is a master, one replica and one redis-sentinel monitoring them,
// started by [StartSentinel]. All processes are killed when the test
// finishes.
//
// The sentinel runs with quorum 1, down-after-milliseconds 1000 and
// failover-timeout 5000, so after [Server.Kill] on the master the replica is
// promoted within a few seconds.
type Sentinel struct {
	master    *Server
	replica   *Server
	sentinels []*Server
}

// StartSentinel starts a master, a replica of it (--replicaof) and one
// redis-sentinel monitoring the master as "quota-master". It returns once
// the replica is in sync and the sentinel reports the master and the
// replica. The sentinel's configuration file lives in its own temporary
// directory, since sentinel rewrites it.
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
		return replicaInSync(ctx, master, replica)
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

	s := &Sentinel{master: master, replica: replica, sentinels: []*Server{sent}}
	if err := waitFor(sentinelReadyTimeout, 50*time.Millisecond, s.ready); err != nil {
		tb.Fatalf("redistest: sentinel %s not ready: %v", sent.Addr(), err)
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

// replicaInSync checks that replica has finished syncing from master and
// that master lists it as online.
func replicaInSync(ctx context.Context, master, replica *Server) error {
	rc := adminClient(replica.Addr())
	defer rc.Close()
	info, err := rc.Info(ctx, "replication").Result()
	if err != nil {
		return err
	}
	if st := infoField(info, "master_link_status"); st != "up" {
		return fmt.Errorf("replica master_link_status is %q", st)
	}
	if infoField(info, "master_sync_in_progress") != "0" {
		return errors.New("replica sync in progress")
	}
	mc := adminClient(master.Addr())
	defer mc.Close()
	info, err = mc.Info(ctx, "replication").Result()
	if err != nil {
		return err
	}
	if got := infoField(info, "slave0"); got == "" {
		return errors.New("master lists no replica")
	}
	return nil
}

// ready checks that every sentinel names the master and knows the replica
// as a healthy replica.
func (s *Sentinel) ready(ctx context.Context) error {
	for _, sent := range s.sentinels {
		sc := redis.NewSentinelClient(&redis.Options{
			Addr:        sent.Addr(),
			DialTimeout: queryTimeout, ReadTimeout: queryTimeout, WriteTimeout: queryTimeout,
			MaxRetries: -1, DisableIdentity: true,
		})
		err := sentinelReady(ctx, sc, s.master.Addr(), s.replica.Port())
		sc.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", sent.Addr(), err)
		}
	}
	return nil
}

func sentinelReady(ctx context.Context, sc *redis.SentinelClient, masterAddr string, replicaPort int) error {
	addr, err := sc.GetMasterAddrByName(ctx, SentinelMasterName).Result()
	if err != nil {
		return fmt.Errorf("SENTINEL GET-MASTER-ADDR-BY-NAME: %w", err)
	}
	if len(addr) != 2 || addr[0]+":"+addr[1] != masterAddr {
		return fmt.Errorf("sentinel reports master %v, want %s", addr, masterAddr)
	}
	replicas, err := sc.Replicas(ctx, SentinelMasterName).Result()
	if err != nil {
		return fmt.Errorf("SENTINEL REPLICAS: %w", err)
	}
	for _, r := range replicas {
		if r["port"] == strconv.Itoa(replicaPort) && r["flags"] == "slave" && r["master-link-status"] == "ok" {
			return nil
		}
	}
	return fmt.Errorf("sentinel does not list replica port %d as healthy: %v", replicaPort, replicas)
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
// become a replica (or be dead); ask the sentinel for the current master.
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
