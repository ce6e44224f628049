-- quota: the instant the fleet's Limiters leave their local shares
-- together after an outage, for FallbackLocal.
--
-- KEYS[1]  the fleet's resume key: the instant (us, server clock), while
--          an outage is ending.
-- ARGV[1]  how long after the first Limiter that finds Redis again the
--          fleet resumes, in microseconds: longer than the longest
--          interval between two probes of any Limiter.
-- ARGV[2]  now in microseconds, or "" to use the server's clock (TIME).
--
-- Reply: {microseconds from now until the fleet resumes the shared bucket,
-- zero or less when it already has; the instant}. The first caller sets
-- the instant; the key lingers one more ARGV[1] after it, then expires.

local now = clock(ARGV[2]) -- the prelude's (internal/redisx)
local delay = tonumber(ARGV[1])
local at = tonumber(redis.call('GET', KEYS[1]))
if not at then
  at = now + delay
  redis.call('SET', KEYS[1], at, 'PX', math.ceil(2 * delay / 1000))
end
return {at - now, at}
