package store

import (
	"embed"
	"strings"
)

// The bucket's scripts, one for each kind of call, each the parts it
// needs joined in this order after the prelude (see core.lua): the take
// (script.lua), which every request runs; the other updates of the layers
// (update.lua); and the control record's operations (record.lua). Each is
// loaded as a script of its own, so that a take defines nothing that only
// the others use.
var (
	takeParts   = []string{"core.lua", "plain.lua", "layers.lua", "daily.lua", "classes.lua", "timeline.lua", "tenants.lua", "script.lua"}
	updateParts = []string{"core.lua", "layers.lua", "daily.lua", "classes.lua", "timeline.lua", "learn.lua", "tenants.lua", "update.lua"}
	recordParts = []string{"core.lua", "layers.lua", "daily.lua", "classes.lua", "timeline.lua", "learn.lua", "record.lua"}
)

//go:embed *.lua
var sources embed.FS

var (
	takeSource   = join(takeParts)
	updateSource = join(updateParts)
	recordSource = join(recordParts)
	// The pool's take (pool.lua) runs the take as a function of its own,
	// bucket, and is one itself, pooled, as it runs in internal/slots.
	poolFunc   = "local function pooled(KEYS, ARGV, longest)\n" + join([]string{"pool.lua"}) + "\nend\n"
	poolSource = "local function bucket(KEYS, ARGV)\n" + takeSource + "\nend\n" + poolFunc + "return pooled(KEYS, ARGV)\n"
)

// join returns the parts' sources, joined in order.
func join(parts []string) string {
	var b strings.Builder
	for _, name := range parts {
		part, err := sources.ReadFile(name)
		if err != nil {
			panic(err)
		}
		b.Write(part)
	}
	return b.String()
}

// TakeSource returns the take's script, without the prelude, for a
// script that runs a take inside its own (internal/slots): the source of
// its parts and nothing else. It reads KEYS and ARGV, and returns its
// reply.
func TakeSource() string { return takeSource }

// PoolSource returns the function pooled(KEYS, ARGV, longest), the pool's
// take (pool.lua), for a script that defines bucket(KEYS, ARGV) as
// TakeSource's and runs a pool's take inside its own (internal/slots):
// longest, when not nil, is the longest wait (µs, a string) of every
// candidate's take, in place of theirs.
func PoolSource() string { return poolFunc }
