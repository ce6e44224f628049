package main

import (
	"context"
	"strings"
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

// noControlHook answers the reads of quota's control records with a
// record that holds nothing, without sending them: a control read is an
// EVALSHA (or EVAL) whose first argument after the keys is "read" and
// whose last key, the record's, ends in ":ctl". Other commands go to Redis.
type noControlHook struct{}

func (noControlHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (noControlHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if c, ok := cmd.(*redis.Cmd); ok && isControlRead(c.Args()) {
			c.SetVal([]any{"0", "", "", "", "", "", "", "", "", "", ""})
			return nil
		}
		return next(ctx, cmd)
	}
}

func (noControlHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// isControlRead tells whether args are those of a read of a control record.
func isControlRead(args []any) bool {
	if len(args) < 4 {
		return false
	}
	switch args[0] {
	case "evalsha", "eval":
	default:
		return false
	}
	keys, ok := args[2].(int)
	if !ok || keys < 1 || len(args) <= 3+keys {
		return false
	}
	record, _ := args[2+keys].(string)
	return strings.HasSuffix(record, ":ctl") && args[3+keys] == "read"
}
