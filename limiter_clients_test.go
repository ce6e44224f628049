package quota

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota/internal/control"
	"github.com/sharedquota/quota/internal/redistest"
	"github.com/sharedquota/quota/internal/store"
)

// Tests of the Limiter on each kind of Redis client and deployment
// NewLimiter accepts (limiter.go), split from limiter_test.go: Cluster,
// Ring and Sentinel failover clients, a failover of the master under a
// fleet, and TLS. Each runs on real redis-server processes.

// slowLimit grants one token and the next one 100 s later, so that a bucket
// key written by one Wait outlives the test and a second Wait within a
// short deadline is refused.
var slowLimit = Limit{Rate: 0.01, Burst: 1}

// bucketNames returns n bucket names, one of them longer than store.MaxNameLen
// and one that begins with "}", which would leave a plain hash tag empty.
func bucketNames(n int) []string {
	names := []string{"tenant-" + strings.Repeat("x", 2*store.MaxNameLen), "}tenant-brace.example.com"}
	for i := 2; i < n; i++ {
		names = append(names, fmt.Sprintf("tenant-%02d.example.com", i))
	}
	return names
}

// takeAndRefuse takes the only token of name's slowLimit bucket, then checks
// that a second Wait within a short deadline is refused because the bucket
// is empty: the state written by the first Wait is found again.
func takeAndRefuse(t *testing.T, l *Limiter, name string) {
	t.Helper()
	ctx := context.Background()
	if err := l.Wait(ctx, name, slowLimit); err != nil {
		t.Fatalf("Wait(%.40q): %v", name, err)
	}
	short, cancel := context.WithTimeout(ctx, 5*time.Second) // refused at once: the token is 100 s away
	defer cancel()
	if err := l.Wait(short, name, slowLimit); !errors.Is(err, ErrWouldExceedDeadline) {
		t.Fatalf("second Wait(%.40q) on an empty bucket: err = %v, want ErrWouldExceedDeadline", name, err)
	}
}

// slotOwners returns, from CLUSTER SHARDS, a function that maps a slot to
// the address of the master serving it.
func slotOwners(t *testing.T, cc *redis.ClusterClient) func(slot int64) string {
	t.Helper()
	shards, err := cc.ClusterShards(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return func(slot int64) string {
		for _, sh := range shards {
			for _, r := range sh.Slots {
				if slot < r.Start || slot > r.End {
					continue
				}
				for _, n := range sh.Nodes {
					if n.Role == "master" {
						return net.JoinHostPort(n.IP, strconv.FormatInt(n.Port, 10))
					}
				}
			}
		}
		return ""
	}
}

func TestClusterClient(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 1)
	cc, admin := cluster.Client(t), cluster.Client(t)
	cmds := newCmdCounter()
	cc.AddHook(cmds)
	l := NewLimiter(cc)
	ctx := context.Background()
	owner := slotOwners(t, admin)

	// Buckets of many names spread over the slots and the masters; each
	// bucket's key lives on the master serving its slot.
	names := bucketNames(60)
	slots := map[int64]bool{}
	onMaster := map[string]int{} // master address: bucket keys it serves
	direct := map[string]*redis.Client{}
	for _, name := range names {
		rkey, err := bucketKey(l.cfg.prefix, name)
		if err != nil {
			t.Fatal(err)
		}
		slot, err := admin.ClusterKeySlot(ctx, rkey).Result()
		if err != nil {
			t.Fatal(err)
		}
		tagSlot, err := admin.ClusterKeySlot(ctx, hashTag(rkey)).Result()
		if err != nil {
			t.Fatal(err)
		}
		if slot != tagSlot {
			t.Errorf("%.40q: key in slot %d, its hash tag %.40q in slot %d", rkey, slot, hashTag(rkey), tagSlot)
		}
		master := cluster.MasterFor(rkey)
		if got := owner(slot); got != master.Addr() {
			t.Errorf("%.40q: slot %d served by %s per CLUSTER SHARDS, by %s per CLUSTER NODES", rkey, slot, got, master.Addr())
		}
		slots[slot] = true
		onMaster[master.Addr()]++
		if direct[master.Addr()] == nil {
			direct[master.Addr()] = master.Client(t)
		}

		takeAndRefuse(t, l, name)
		if n, err := direct[master.Addr()].Exists(ctx, rkey, rkey+control.Suffix).Result(); err != nil || n != 2 {
			t.Errorf("%.40q: EXISTS of it and its control record on its master %s = %d, %v; want 2", rkey, master.Addr(), n, err)
		}
	}
	t.Logf("%d buckets in %d slots, keys per master %v; the Limiter sent %v", len(names), len(slots), onMaster, cmds)
	if len(onMaster) < 3 {
		t.Errorf("%d buckets landed on %d masters, want all 3", len(names), len(onMaster))
	}
	for addr, c := range direct {
		if n, err := c.DBSize(ctx).Result(); err != nil || int(n) != 2*onMaster[addr] {
			t.Errorf("master %s holds %d keys (%v), want the %d bucket keys it serves and their control records", addr, n, err, onMaster[addr])
		}
	}
	// Each master learns each script from its first call there, the
	// record's from the first read of a control record it serves, the
	// take's from the first take: the first call of a script sends it
	// whole (EVAL), and the first on each other master is an EVALSHA that
	// finds NOSCRIPT, and an EVAL. Every Wait is then one EVALSHA.
	if waits, masters := 2*len(names), len(onMaster); cmds.get("eval") > masters || cmds.get("control eval") > masters ||
		cmds.get("evalsha") < waits-1 || cmds.total() > waits+masters {
		t.Errorf("%d Waits sent %v; want at most %d eval of each script, %d evalsha and nothing else", waits, cmds, masters, waits)
	}

	// The swarm property on one bucket, through the cluster client.
	lim := Limit{Rate: 10, Burst: 5}
	cc.AddHook(dueHook{})
	warm(t, cc, "cluster-swarm", 20)
	grants, err := swarm(ctx, 20, time.Now(), 3*time.Second, func(ctx context.Context) error {
		return l.Wait(ctx, "cluster-swarm", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	checkSwarm(t, grants, lim, 3*time.Second)
}

func TestNoScriptOnCluster(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 1)
	cc := cluster.Client(t)
	cmds := newCmdCounter()
	cc.AddHook(cmds)
	logs := &logRecorder{}
	l := NewLimiter(cc, WithLogger(slog.New(logs)))
	ctx := context.Background()

	masters := map[string]bool{}
	names := bucketNames(30)
	for _, name := range names {
		rkey, _ := bucketKey(l.cfg.prefix, name)
		masters[cluster.MasterFor(rkey).Addr()] = true
		takeAndRefuse(t, l, name)
	}
	if len(masters) < 3 {
		t.Fatalf("%d buckets landed on %d masters, want all 3", len(names), len(masters))
	}

	flush := func() {
		t.Helper()
		err := cc.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
			if err := m.ScriptFlush(ctx).Err(); err != nil {
				return err
			}
			if ok, err := m.ScriptExists(ctx, l.store.TakeScript().SHA()).Result(); err != nil || ok[0] {
				return fmt.Errorf("%s: SCRIPT EXISTS after SCRIPT FLUSH = %v, %v", m.Options().Addr, ok, err)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		cmds.reset()
	}

	// One by one: each master answers its first EVALSHA with NOSCRIPT, the
	// EVAL that follows caches the script there again.
	flush()
	for _, name := range names {
		short, cancel := context.WithTimeout(ctx, 5*time.Second) // refused at once: the token is 100 s away
		err := l.Wait(short, name, slowLimit)
		cancel()
		if !errors.Is(err, ErrWouldExceedDeadline) {
			t.Fatalf("Wait(%.40q) after SCRIPT FLUSH on an empty bucket: err = %v, want ErrWouldExceedDeadline", name, err)
		}
		if err := l.Wait(ctx, name+"/after-flush", slowLimit); err != nil {
			t.Fatalf("Wait(%.40q) after SCRIPT FLUSH: %v", name+"/after-flush", err)
		}
	}
	waits := 2 * len(names)
	t.Logf("%d sequential Waits after SCRIPT FLUSH on every master: %v", waits, cmds)
	// The first call on each master, a take or a read of a control
	// record, falls back to EVAL; one of each may, if they cross.
	if evals := cmds.get("eval") + cmds.get("control eval"); evals < 1 || evals > 2*len(masters) {
		t.Errorf("%d EVAL fallbacks, want one per master that lost the script, 1 to %d", evals, 2*len(masters))
	}
	if cmds.get("evalsha") != waits || cmds.get("script load") != 0 {
		t.Errorf("%d Waits sent %v, want one evalsha each and no script load", waits, cmds)
	}

	// At once: concurrent first callers on a master may each fall back to
	// EVAL, and every Wait still succeeds.
	flush()
	const goroutines, each = 20, 5
	var wg sync.WaitGroup
	errs := make(chan error, goroutines)
	for g := range goroutines {
		wg.Go(func() {
			for i := range each {
				if err := l.Wait(ctx, fmt.Sprintf("concurrent-%d-%d", g, i), slowLimit); err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("concurrent Wait after SCRIPT FLUSH: %v", err)
	}
	t.Logf("%d concurrent Waits after SCRIPT FLUSH on every master: %v", goroutines*each, cmds)
	if evals := cmds.get("eval") + cmds.get("control eval"); evals < 1 || evals > goroutines {
		t.Errorf("%d EVAL fallbacks, want 1 to %d", evals, goroutines)
	}
	if l.Mode() != ModeShared || logs.String() != "" {
		t.Errorf("SCRIPT FLUSH changed the mode to %v:\n%s", l.Mode(), logs)
	}
}

func TestClusterAcrossProcesses(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 1)
	lim := Limit{Rate: 10, Burst: 5}
	const procs = 3
	reports := runWorkers(t, procs, workerSpec{Cluster: cluster.Addrs(), Key: "cluster-procs", Limit: lim, Goroutines: 10, Duration: 3 * time.Second})
	var grants, cmds int64
	for i, r := range reports {
		t.Logf("cluster worker %d: %d grants, %d commands", i, len(r.Grants), r.Commands)
		grants += int64(len(r.Grants))
		cmds += r.Commands
	}
	// Each Wait is one command: the first of each process an EVAL that
	// sends the script, every other one an EVALSHA.
	if cmds > grants {
		t.Errorf("%d commands for %d grants in %d processes, want at most one per grant", cmds, grants, procs)
	}
	checkSwarm(t, mergeStamps(reports), lim, 3*time.Second)
}

func TestRingClient(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	a, b := redistest.Start(t), redistest.Start(t)
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": a.Addr(), "b": b.Addr()}})
	t.Cleanup(func() { _ = ring.Close() })
	cmds := newCmdCounter()
	ring.AddHook(cmds)
	l := NewLimiter(ring)
	ctx := context.Background()
	shards := map[string]*redis.Client{"a": a.Client(t), "b": b.Client(t)}

	// Each bucket's key lives on exactly one shard with its control
	// record, and both shards hold some.
	names := bucketNames(60)
	onShard := map[string]int{}
	for _, name := range names {
		takeAndRefuse(t, l, name)
		rkey, _ := bucketKey(l.cfg.prefix, name)
		var on []string
		for shard, c := range shards {
			switch n, err := c.Exists(ctx, rkey, rkey+control.Suffix).Result(); {
			case err != nil:
				t.Fatal(err)
			case n == 2:
				on = append(on, shard)
			case n == 1:
				t.Errorf("%.40q and its control record are on different shards", rkey)
			}
		}
		if len(on) != 1 {
			t.Fatalf("%.40q is on shards %v, want exactly one", rkey, on)
		}
		onShard[on[0]]++
	}
	t.Logf("%d buckets, keys per shard %v; commands: %v", len(names), onShard, cmds)
	for shard, c := range shards {
		if n, err := c.DBSize(ctx).Result(); err != nil || int(n) != 2*onShard[shard] || n == 0 {
			t.Errorf("shard %s holds %d keys (%v), want the %d bucket keys found there and their control records, and some", shard, n, err, onShard[shard])
		}
	}
	// Each shard learns each script from its first call there (see
	// TestClusterClient).
	if waits := 2 * len(names); cmds.get("evalsha") < waits-1 || cmds.get("evalsha")+cmds.get("eval") > waits+len(shards) ||
		cmds.get("eval") > len(shards) || cmds.get("control eval") > len(shards) {
		t.Errorf("%d Waits sent %v; want %d evalsha and at most %d eval of each script", waits, cmds, waits, len(shards))
	}

	lim := Limit{Rate: 10, Burst: 5}
	ring.AddHook(dueHook{})
	warm(t, ring, "ring-swarm", 20)
	grants, err := swarm(ctx, 20, time.Now(), 3*time.Second, func(ctx context.Context) error {
		return l.Wait(ctx, "ring-swarm", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	checkSwarm(t, grants, lim, 3*time.Second)

	// Announcements from buckets on every shard reach the Limiter: it
	// listens on each shard, whose PUBLISH reaches only its own.
	operator := NewLimiter(ring)
	heardOn := map[string]time.Duration{}
	for _, name := range names[2:] {
		rkey, _ := bucketKey(l.cfg.prefix, name)
		shard := ""
		for s, c := range shards {
			if n, _ := c.Exists(ctx, rkey).Result(); n == 1 {
				shard = s
			}
		}
		if _, done := heardOn[shard]; done || shard == "" {
			continue
		}
		if err := operator.Pause(ctx, name, time.Minute); err != nil {
			t.Fatal(err)
		}
		e := l.controls.Lookup(rkey)
		heardOn[shard] = eventually(t, 5*time.Second, "the pause on shard "+shard, func() bool {
			_, _, paused := e.Load().PausedAt(time.Now())
			return paused
		})
	}
	t.Logf("a pause on each shard known to the Limiter after %v", heardOn)
	for shard, d := range heardOn {
		if d > 500*time.Millisecond {
			t.Errorf("a pause of a bucket on shard %s was known after %v: not by its announcement", shard, d)
		}
	}
	if len(heardOn) != 2 {
		t.Errorf("pauses on %d shards, want both", len(heardOn))
	}
}

func TestFailoverClient(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	sentinel := redistest.StartSentinel(t)
	rdb := sentinel.FailoverClient(t)
	l := NewLimiter(rdb)
	ctx := context.Background()

	// The bucket is written on the master and replicated, TIME and all.
	takeAndRefuse(t, l, "failover-slow")
	rkey, _ := bucketKey(l.cfg.prefix, "failover-slow")
	want, err := sentinel.Master().Client(t).Get(ctx, rkey).Result()
	if err != nil {
		t.Fatalf("GET %s on the master: %v", rkey, err)
	}
	replica := sentinel.Replica().Client(t)
	start := time.Now()
	for {
		got, err := replica.Get(ctx, rkey).Result()
		if err == nil && got == want {
			break
		}
		if time.Since(start) > 3*time.Second {
			t.Fatalf("replica has %s = %q (%v) 3s later, master %q", rkey, got, err, want)
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("bucket written on the master reached the replica within %v", time.Since(start).Round(time.Millisecond))

	lim := Limit{Rate: 10, Burst: 5}
	rdb.AddHook(dueHook{})
	warm(t, rdb, "failover-swarm", 20)
	grants, err := swarm(ctx, 20, time.Now(), 2*time.Second, func(ctx context.Context) error {
		return l.Wait(ctx, "failover-swarm", lim)
	})
	if err != nil {
		t.Fatal(err)
	}
	checkSwarm(t, grants, lim, 2*time.Second)
}

// failover runs the workers for a while, calls kill with the Redis key of
// the provider's bucket, and reports the gap until every worker is back on
// the shared bucket. The provider sees at most Burst + Rate in any second,
// around the failover too, plus the local shares' bursts and a jitter
// allowance.
func failover(t *testing.T, ws []worker, kill func(rkey string)) {
	t.Helper()
	prov := newProvider(t)
	name, err := Host(httptest.NewRequest("GET", prov.URL, nil))
	if err != nil {
		t.Fatal(err)
	}
	rkey, _ := bucketKey(ws[0].tr.Limiter().cfg.prefix, name)
	lim := ws[0].tr.limit
	stop := make(chan struct{})
	done := make(chan []result)
	start := time.Now()
	go func() { done <- drive(ws, 5, prov.URL, stop) }()

	time.Sleep(1500 * time.Millisecond)
	kill(rkey)
	killed := time.Now()
	var gap time.Duration
	for i, w := range ws {
		for w.logs.Count(slog.LevelInfo, "available again") == 0 {
			if time.Since(killed) > 30*time.Second {
				t.Fatalf("worker %d: not back on the shared bucket 30s after the kill (mode %v):\n%s", i, w.tr.Limiter().Mode(), w.logs)
			}
			time.Sleep(time.Millisecond)
		}
		r, _ := w.logs.Last("available again")
		up := r.Time.Sub(killed)
		gap = max(gap, up)
		t.Logf("worker %d: outage found %v and shared again %v after the kill",
			i, logTime(t, w.logs, "Redis unavailable").Sub(killed), up)
	}
	time.Sleep(1500 * time.Millisecond)
	close(stop)
	res := <-done
	end := time.Now()

	failed := 0
	for _, r := range res {
		if r.err != nil {
			failed++
		}
	}
	all := prov.between(start, end)
	during := prov.between(killed, killed.Add(gap))
	localBursts := len(ws) * int(max(1, lim.Burst/float64(len(ws))))
	got, limit := maxInWindow(all, time.Second), bound(lim, time.Second)+localBursts+int(lim.Rate/10)+1
	around := maxInWindow(prov.between(killed.Add(-time.Second), killed.Add(gap+time.Second)), time.Second)
	t.Logf("gap %v: the provider got %d requests during it, %d in all, at most %d in any 1s window, %d around the failover (bound %d); %d requests failed",
		gap.Round(time.Millisecond), len(during), len(all), got, around, limit, failed)
	if got > limit {
		t.Errorf("%d requests in a 1s window, bound %d; per 100ms: %v", got, limit, histogram(all, start, 100*time.Millisecond))
	}
	if failed > 0 {
		t.Errorf("%d requests failed under FallbackLocal", failed)
	}
	if after := prov.between(end.Add(-time.Second), end); len(after) < int(0.5*lim.Rate) {
		t.Errorf("%d requests in the last second, want the shared bucket's rate", len(after))
	}
	checkTransitions(t, ws, slog.LevelWarn)
}

func TestClusterFailover(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	cluster := redistest.StartCluster(t, 3, 1)
	ws := newWorkersOn(t, 4, Limit{Rate: 20, Burst: 8}, FallbackLocal(4), func() redis.Scripter {
		return cluster.Client(t, func(o *redis.ClusterOptions) {
			o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
			o.MaxRetries, o.DialerRetries, o.ContextTimeoutEnabled = -1, 1, true
		})
	})
	failover(t, ws, func(rkey string) {
		cluster.WaitInSync(rkey) // a replica that has not caught up cannot take over
		cluster.MasterFor(rkey).Kill()
	})
}

func TestSentinelFailover(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	s := redistest.StartSentinel(t)
	ws := newWorkersOn(t, 4, Limit{Rate: 20, Burst: 8}, FallbackLocal(4), func() redis.Scripter {
		return s.FailoverClient(t, func(o *redis.FailoverOptions) {
			o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond, 500*time.Millisecond
			o.MaxRetries, o.DialerRetries, o.ContextTimeoutEnabled = -1, 1, true
		})
	})
	failover(t, ws, func(string) {
		s.WaitInSync()
		s.CurrentMaster().Kill()
	})
}

// TestTLS runs the Limiter over TLS to a redis-server with a throwaway
// certificate, and checks that a client that does not trust it gets no
// tokens.
func TestTLS(t *testing.T) {
	redistest.Long(t)
	t.Parallel()
	dir := t.TempDir()
	ca, caKey := newCert(t, nil, nil, "quota test CA")
	leaf, leafKey := newCert(t, ca, caKey, "127.0.0.1")
	writePEM(t, filepath.Join(dir, "ca.crt"), "CERTIFICATE", ca.Raw)
	writePEM(t, filepath.Join(dir, "redis.crt"), "CERTIFICATE", leaf.Raw)
	der, err := x509.MarshalECPrivateKey(leafKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, filepath.Join(dir, "redis.key"), "EC PRIVATE KEY", der)

	port := freePort(t)
	redistest.Start(t,
		"--tls-port", strconv.Itoa(port),
		"--tls-cert-file", filepath.Join(dir, "redis.crt"),
		"--tls-key-file", filepath.Join(dir, "redis.key"),
		"--tls-ca-cert-file", filepath.Join(dir, "ca.crt"),
		"--tls-auth-clients", "no")
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))

	pool := x509.NewCertPool()
	pool.AddCert(ca)
	o := limiterOptions(addr)
	o.TLSConfig = &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	rdb := redis.NewClient(o)
	defer rdb.Close()
	l := NewLimiter(rdb)
	ctx := context.Background()
	for range 3 {
		if err := l.Wait(ctx, "tls", PerSecond(10)); err != nil {
			t.Fatalf("Wait over TLS: %v", err)
		}
	}

	untrusting := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1,
		TLSConfig: &tls.Config{MinVersion: tls.VersionTLS12}})
	defer untrusting.Close()
	err = NewLimiter(untrusting, WithLogger(discardLogger())).Wait(ctx, "tls", PerSecond(10))
	var verr *tls.CertificateVerificationError
	if !errors.Is(err, ErrUnavailable) || !errors.As(err, &verr) {
		t.Errorf("Wait with an untrusted certificate: err = %v, want ErrUnavailable carrying the verification error", err)
	}
}

// newCert makes a certificate for name, signed by parent, or a CA that
// signs itself when parent is nil.
func newCert(t *testing.T, parent *x509.Certificate, parentKey *ecdsa.PrivateKey, name string) (*x509.Certificate, *ecdsa.PrivateKey) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: name},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
	}
	if parent == nil {
		tmpl.IsCA, tmpl.BasicConstraintsValid = true, true
		tmpl.KeyUsage = x509.KeyUsageCertSign
		parent, parentKey = tmpl, key
	} else {
		tmpl.IPAddresses = []net.IP{net.ParseIP(name)}
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
		tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return cert, key
}

func writePEM(t *testing.T, path, kind string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}

// freePort returns a loopback port that was free a moment ago.
func freePort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}
