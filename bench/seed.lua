-- KEYS[1] = bucket key
-- ARGV[1] = capacity, ARGV[2] = refill per second
-- ARGV[3] = now (seconds, float), ARGV[4] = tokens requested
local capacity  = tonumber(ARGV[1])
local rate      = tonumber(ARGV[2])
local now       = tonumber(ARGV[3])
local requested = tonumber(ARGV[4])

local state = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(state[1])
local ts     = tonumber(state[2])
if tokens == nil then
  tokens = capacity
  ts = now
end

-- Lazy refill: credit whatever has accrued since the last call.
local elapsed = math.max(0, now - ts)
tokens = math.min(capacity, tokens + elapsed * rate)

local allowed = tokens >= requested
local wait = 0
if allowed then
  tokens = tokens - requested
else
  wait = (requested - tokens) / rate
end

redis.call('HMSET', KEYS[1], 'tokens', tokens, 'ts', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / rate) * 2)
return { allowed and 1 or 0, tostring(wait) }
