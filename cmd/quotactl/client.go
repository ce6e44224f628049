package main

import (
	"errors"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// target is the Redis that -redis or REDIS_URL names: one server, or the
// nodes of a Cluster when they are several.
type target struct {
	src     string                // "-redis" or "REDIS_URL", for messages
	addr    string                // for messages, without a password
	opts    *redis.Options        // one server, which may be a node of a Cluster
	cluster *redis.ClusterOptions // a Cluster's nodes
}

// parseTarget returns the Redis that spec (the -redis flag) or the
// environment names.
func parseTarget(spec string, getenv func(string) string) (target, error) {
	t := target{src: "-redis"}
	if spec == "" {
		if u := getenv("REDIS_URL"); u != "" {
			t.src, spec = "REDIS_URL", u
		} else {
			spec = "localhost:6379"
		}
	}
	switch {
	case strings.HasPrefix(spec, "redis://") || strings.HasPrefix(spec, "rediss://"):
		o, err := redis.ParseURL(spec)
		if err != nil {
			var uerr *url.Error
			if errors.As(err, &uerr) {
				err = uerr.Err // url.Error quotes the URL, password and all
			}
			return target{}, badUsage("bad %s: %v", t.src, err)
		}
		timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
		t.opts, t.addr = o, o.Addr
		return t, nil
	case t.src == "REDIS_URL":
		return target{}, badUsage("bad REDIS_URL: want a redis:// or rediss:// URL")
	case strings.Contains(spec, "://"):
		return target{}, badUsage("bad -redis: want host:port, a comma-separated list of them, or a redis:// or rediss:// URL")
	case strings.Contains(spec, ","):
		addrs := strings.Split(spec, ",")
		for _, a := range addrs {
			if err := checkAddr(a); err != nil {
				return target{}, err
			}
		}
		o := &redis.ClusterOptions{Addrs: addrs}
		timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
		t.cluster, t.addr = o, spec
		return t, nil
	}
	if err := checkAddr(spec); err != nil {
		return target{}, err
	}
	o := &redis.Options{Addr: spec}
	timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
	t.opts, t.addr = o, spec
	return t, nil
}

func timeouts(dial, read, write *time.Duration, ctxTimeout *bool) {
	*dial, *read, *write, *ctxTimeout = dialTimeout, ioTimeout, ioTimeout, true
}

// checkAddr checks that a is host:port.
func checkAddr(a string) error {
	i := strings.LastIndex(a, ":")
	if i <= 0 {
		return badUsage("bad -redis address %q: want host:port", a)
	}
	if p, err := strconv.Atoi(a[i+1:]); err != nil || p <= 0 || p > 65535 {
		return badUsage("bad -redis address %q: want host:port", a)
	}
	return nil
}
