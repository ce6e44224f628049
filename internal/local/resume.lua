-- quota: the instant the fleet's Limiters leave their local shares
-- together after an outage, for FallbackLocal.
--
-- KEYS[1]  the fleet's resume key: the instant (us, server clock), while
--          an outage is ending.
-- ARGV[1]  how long after the first Limiter that finds Redis again the
--          fleet resumes, in microseconds: longer than the longest
--          interval between two probes of any Limiter.
-- ARGV[2]  now in microseconds, or "" to use the server's clock (TIME).
-- ARGV[3]  how long the key lingers after the instant, in microseconds:
--          longer than the slowest Limiter may take to find Redis after
--          the first did, so that it finds the instant past and resumes
--          with the fleet rather than record an instant of its own.
--
-- Reply: {microseconds from now until the fleet resumes the shared bucket,
-- zero or less when it already has; the instant}. The first caller sets
-- the instant; the key expires ARGV[3] after it.

local now = clock(ARGV[2]) -- the prelude's (internal/redisx)
local delay, linger = tonumber(ARGV[1]), tonumber(ARGV[3])
local at = tonumber(redis.call('GET', KEYS[1]))
if not at then
  at = now + delay
  redis.call('SET', KEYS[1], at, 'PX', math.ceil((delay + linger) / 1000))
end
return {at - now, at}
