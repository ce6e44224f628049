-- quota: the fleet's roll call, for FallbackLocal(n).CountingWorkers().
--
-- KEYS[1]  the fleet's key, a sorted set of Limiter ids scored by the
--          instant (ms, server clock) their announcement lapses.
-- ARGV[1]  the id of the Limiter announcing itself.
-- ARGV[2]  how long the announcement lasts, in milliseconds.
-- ARGV[3]  now in microseconds, or "" to use the server's clock (TIME).
--
-- Reply: the number of Limiters whose announcement has not lapsed, the
-- caller included. The key expires with the last announcement.

local key = KEYS[1]
local ttl = tonumber(ARGV[2])
local now = math.floor(clock(ARGV[3]) / 1000) -- ms; the prelude's clock (internal/redisx)

redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
redis.call('ZADD', key, now + ttl, ARGV[1])
redis.call('PEXPIRE', key, ttl)
return redis.call('ZCARD', key)
