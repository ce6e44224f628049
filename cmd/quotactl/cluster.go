package main

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
	"github.com/sharedquota/quota"
)

// connect returns the client of t.
//
// One server is asked whether it is a node of a Cluster, as redis-cli -c
// finds out: INFO cluster's cluster_enabled:1, or, from a user who may
// not run INFO (the package's ACL allows no INFO), the mode of HELLO's
// reply. A node of a Cluster is the Cluster: a ClusterClient seeded with
// it finds the others, so that every bucket is reached whichever master
// serves it, and list scans every master. A server that refuses both
// questions is taken for a plain one.
func connect(ctx context.Context, t target) (redis.UniversalClient, error) {
	if t.cluster != nil {
		return redis.NewClusterClient(t.cluster), nil
	}
	ctx, cancel := context.WithTimeout(ctx, overall)
	defer cancel()
	c := redis.NewClient(t.opts)
	isCluster, err := clusterEnabled(ctx, c)
	switch {
	case err != nil && redis.HasErrorPrefix(err, "SELECT is not allowed in cluster mode"):
		c.Close()
		return nil, badUsage("bad %s: database %d of a Redis Cluster: a Cluster has database 0 only", t.src, t.opts.DB)
	case err != nil && errors.As(err, new(redis.Error)):
		return c, nil // refused both: the command's own calls tell why, if they fail
	case err != nil:
		c.Close()
		return nil, fmt.Errorf("%w: %w", quota.ErrUnavailable, err)
	case !isCluster:
		return c, nil
	}
	c.Close()
	return redis.NewClusterClient(clusterOptions(t.opts)), nil
}

// clusterEnabled reports whether c's server is a node of a Cluster: from
// INFO, else from HELLO.
func clusterEnabled(ctx context.Context, c *redis.Client) (bool, error) {
	info, err := c.Info(ctx, "cluster").Result()
	if err == nil {
		return infoField(info, "cluster_enabled") == "1", nil
	}
	if !errors.As(err, new(redis.Error)) || redis.HasErrorPrefix(err, "SELECT ") {
		return false, err
	}
	// HELLO without a version answers the connection's properties,
	// the server's mode among them: "standalone", "cluster" or
	// "sentinel"; as a map in RESP3, as a flat list in RESP2.
	reply, herr := c.Do(ctx, "HELLO").Result()
	if herr != nil {
		if errors.As(herr, new(redis.Error)) {
			return false, err // INFO's refusal
		}
		return false, herr
	}
	switch r := reply.(type) {
	case map[any]any:
		return r["mode"] == "cluster", nil
	case []any:
		for i := 0; i+1 < len(r); i += 2 {
			if r[i] == "mode" {
				return r[i+1] == "cluster", nil
			}
		}
	}
	return false, nil
}

// infoField returns the value of field in an INFO reply.
func infoField(info, field string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), field+":"); ok {
			return v
		}
	}
	return ""
}

// clusterOptions returns the options of a ClusterClient seeded with the
// server of o, which a URL may have set: the user, the password, TLS, the
// protocol, the timeouts, the retries and the pool.
func clusterOptions(o *redis.Options) *redis.ClusterOptions {
	return &redis.ClusterOptions{
		Addrs:                 []string{o.Addr},
		ClientName:            o.ClientName,
		Protocol:              o.Protocol,
		Username:              o.Username,
		Password:              o.Password,
		TLSConfig:             o.TLSConfig,
		MaxRetries:            o.MaxRetries,
		MinRetryBackoff:       o.MinRetryBackoff,
		MaxRetryBackoff:       o.MaxRetryBackoff,
		DialTimeout:           o.DialTimeout,
		ReadTimeout:           o.ReadTimeout,
		WriteTimeout:          o.WriteTimeout,
		ContextTimeoutEnabled: o.ContextTimeoutEnabled,
		PoolFIFO:              o.PoolFIFO,
		PoolSize:              o.PoolSize,
		PoolTimeout:           o.PoolTimeout,
		MinIdleConns:          o.MinIdleConns,
		MaxIdleConns:          o.MaxIdleConns,
		MaxActiveConns:        o.MaxActiveConns,
		ConnMaxIdleTime:       o.ConnMaxIdleTime,
		ConnMaxLifetime:       o.ConnMaxLifetime,
	}
}
