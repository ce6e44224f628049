package main

import (
	"errors"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// client returns the Redis client that spec (the -redis flag) or the
// environment names, and its address for messages, without a password.
func client(spec string, getenv func(string) string) (redis.UniversalClient, string, error) {
	src := "-redis"
	if spec == "" {
		if u := getenv("REDIS_URL"); u != "" {
			src, spec = "REDIS_URL", u
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
			return nil, "", badUsage("bad %s: %v", src, err)
		}
		timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
		return redis.NewClient(o), o.Addr, nil
	case src == "REDIS_URL":
		return nil, "", badUsage("bad REDIS_URL: want a redis:// or rediss:// URL")
	case strings.Contains(spec, "://"):
		return nil, "", badUsage("bad -redis: want host:port, a comma-separated list of them, or a redis:// or rediss:// URL")
	case strings.Contains(spec, ","):
		addrs := strings.Split(spec, ",")
		for _, a := range addrs {
			if err := checkAddr(a); err != nil {
				return nil, "", err
			}
		}
		o := &redis.ClusterOptions{Addrs: addrs}
		timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
		return redis.NewClusterClient(o), spec, nil
	}
	if err := checkAddr(spec); err != nil {
		return nil, "", err
	}
	o := &redis.Options{Addr: spec}
	timeouts(&o.DialTimeout, &o.ReadTimeout, &o.WriteTimeout, &o.ContextTimeoutEnabled)
	return redis.NewClient(o), spec, nil
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
