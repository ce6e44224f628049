package main

import (
	"context"
	"sync/atomic"

	"github.com/redis/go-redis/v9"
)

// countHook counts the commands a client sends, pipelined or not, except
// those that set up a connection.
type countHook struct{ n *atomic.Int64 }

func (countHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h countHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.count(cmd)
		return next(ctx, cmd)
	}
}

func (h countHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			h.count(cmd)
		}
		return next(ctx, cmds)
	}
}

func (h countHook) count(cmd redis.Cmder) {
	switch cmd.Name() {
	case "hello", "client", "auth", "select", "readonly":
	default:
		h.n.Add(1)
	}
}
