-- quota: the fleet's roll call, for FallbackLocal(n).CountingWorkers().
--
-- KEYS[1]  the fleet's key, a sorted set of Limiter ids scored by the
--          instant (ms, server clock) their announcement lapses.
-- ARGV[1]  the id of the Limiter announcing itself.
-- ARGV[2]  how long the announcement lasts, in milliseconds.
-- ARGV[3]  now in milliseconds, or "" to use the server's clock (TIME).
--
-- Reply: the number of Limiters whose announcement has not lapsed, the
-- caller included. The key expires with the last announcement.

local key = KEYS[1]
local ttl = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
if not now then
  if redis.replicate_commands then
    redis.replicate_commands() -- lets TIME precede writes on Redis < 5
  end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
redis.call('ZADD', key, now + ttl, ARGV[1])
redis.call('PEXPIRE', key, ttl)
return redis.call('ZCARD', key)
