package redistest

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// replicationInSync checks that every server in replicas replicates master
// and has caught up with it:
//
//   - master has the master role and lists the replica with state=online;
//   - the replica has the slave role, follows master's port, has its link
//     up (master_link_status:up) and no sync in progress;
//   - the replica's slave_repl_offset is at least the master_repl_offset
//     that master reported at the start of the check, so the replica holds
//     everything master had written by then.
//
// A replica that never completed a sync fails the check. Redis refuses to
// promote such a replica: Redis Cluster counts it as disconnected since
// forever (its data is too old, see cluster-replica-validity-factor), and
// Sentinel skips replicas whose link has long been down.
func replicationInSync(ctx context.Context, master *Server, replicas []*Server) error {
	mc := adminClient(master.Addr())
	defer mc.Close()
	minfo, err := mc.Info(ctx, "replication").Result()
	if err != nil {
		return fmt.Errorf("%s: INFO replication: %w", master.Addr(), err)
	}
	if role := infoField(minfo, "role"); role != "master" {
		return fmt.Errorf("%s: role is %q, want master", master.Addr(), role)
	}
	want, err := strconv.ParseInt(infoField(minfo, "master_repl_offset"), 10, 64)
	if err != nil {
		return fmt.Errorf("%s: master_repl_offset: %w", master.Addr(), err)
	}
	for _, r := range replicas {
		if st := listedReplicaState(minfo, r.Port()); st != "online" {
			return fmt.Errorf("master %s lists replica %s with state %q, want online", master.Addr(), r.Addr(), st)
		}
		rc := adminClient(r.Addr())
		rinfo, err := rc.Info(ctx, "replication").Result()
		rc.Close()
		if err != nil {
			return fmt.Errorf("%s: INFO replication: %w", r.Addr(), err)
		}
		if role := infoField(rinfo, "role"); role != "slave" {
			return fmt.Errorf("%s: role is %q, want a replica of %s", r.Addr(), role, master.Addr())
		}
		if port := infoField(rinfo, "master_port"); port != strconv.Itoa(master.Port()) {
			return fmt.Errorf("%s: replicates port %s, want %s", r.Addr(), port, master.Addr())
		}
		if st := infoField(rinfo, "master_link_status"); st != "up" {
			return fmt.Errorf("replica %s: master_link_status is %q", r.Addr(), st)
		}
		if infoField(rinfo, "master_sync_in_progress") != "0" {
			return fmt.Errorf("replica %s: sync in progress", r.Addr())
		}
		got, err := strconv.ParseInt(infoField(rinfo, "slave_repl_offset"), 10, 64)
		if err != nil {
			return fmt.Errorf("%s: slave_repl_offset: %w", r.Addr(), err)
		}
		if got < want {
			return fmt.Errorf("replica %s: slave_repl_offset %d behind master %s's master_repl_offset %d", r.Addr(), got, master.Addr(), want)
		}
	}
	return nil
}

// listedReplicaState returns the state (online, wait_bgsave, send_bulk...)
// with which an INFO replication reply of a master lists the replica on
// port, or "" if it does not list it. The lines read
//
//	slave0:ip=127.0.0.1,port=7001,state=online,offset=1234,lag=0
func listedReplicaState(info string, port int) string {
	for _, line := range strings.Split(info, "\n") {
		name, fields, ok := strings.Cut(strings.TrimSpace(line), ":")
		n, isSlave := strings.CutPrefix(name, "slave")
		if _, err := strconv.Atoi(n); !ok || !isSlave || err != nil {
			continue
		}
		var p, state string
		for _, kv := range strings.Split(fields, ",") {
			k, v, _ := strings.Cut(kv, "=")
			switch k {
			case "port":
				p = v
			case "state":
				state = v
			}
		}
		if p == strconv.Itoa(port) {
			return state
		}
	}
	return ""
}
