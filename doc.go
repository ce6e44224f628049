// Package quota keeps a fleet of HTTP clients inside one provider's rate
// limit.
//
// A limiter inside each process sees only its own traffic: four workers each
// allowed 300 requests a minute send the provider 1,200. quota keeps one
// token bucket per provider in Redis and updates it with one atomic Lua
// script, so the provider sees the agreed rate however many workers run.
//
// Most users want a Transport, set as an http.Client's Transport:
//
//	rdb := redis.NewClient(&redis.Options{Addr: "localhost:6379"})
//	client := &http.Client{Transport: quota.NewTransport(rdb, quota.PerMinute(300))}
//
// Each request then waits for a token from the bucket of its host. A
// Limiter serves work that is not HTTP.
//
// Every acquisition costs one Redis round trip, however many callers
// contend: the script takes the tokens at once, letting the bucket run into
// debt, and replies how long until they accrue. The caller sleeps that long
// once and proceeds, so callers are served first come, first served across
// the fleet, and nobody polls.
package quota
