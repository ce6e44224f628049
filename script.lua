-- quota: one token bucket per key, refilled, checked and taken in one call.
--
-- The bucket is kept as a single number, its theoretical arrival time (tat):
-- the instant, in microseconds, at which the bucket would be full again. At
-- time now it holds burst - (tat - now) * rate tokens, so tokens can run into
-- debt: a take always succeeds when its wait is acceptable, moves tat forward
-- and tells the caller how long to sleep until its tokens have accrued. Later
-- callers queue behind it, first come, first served, with one call each.
--
-- KEYS[1]  the bucket's key.
-- ARGV[1]  operation: "take", "refund" or "probe".
-- ARGV[2]  rate, tokens per second (> 0).
-- ARGV[3]  burst, tokens the bucket holds (>= n).
-- ARGV[4]  n, tokens to take or to hand back (> 0).
-- ARGV[5]  take: the longest wait the caller accepts, in microseconds;
--          refund: the tat that the take being cancelled returned.
-- ARGV[6]  now in microseconds, or "" to use the server's clock (TIME).
--
-- Reply: {granted, wait, tat}, integers.
--   take:   granted is 1 when the tokens were taken, in which case wait (us,
--           rounded to the nearest) is how long until they accrue; when the wait would
--           exceed ARGV[5], granted is 0, nothing is taken and wait says how
--           long it would have been. tat (us, rounded down) identifies the
--           take for a later refund.
--   refund: {1, 0, tat} after handing back what can be handed back.
--   probe:  {1, 0, tat} after rewriting the bucket as it is: a write that
--           changes nothing, to learn whether the server accepts writes.
--
-- The key expires when the bucket is full again: an absent key and a full
-- bucket are the same state, so idle buckets cost no memory.

local key = KEYS[1]
local op = ARGV[1]
local rate = tonumber(ARGV[2])
local burst = tonumber(ARGV[3])
local n = tonumber(ARGV[4])

local now = tonumber(ARGV[6])
if not now then
  if redis.replicate_commands then
    redis.replicate_commands() -- lets TIME precede writes on Redis < 5
  end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- micros returns how long tokens take to accrue, in microseconds. Dividing
-- first keeps extreme rates finite.
local function micros(tokens)
  return tokens / rate * 1000000
end
local state = redis.call('GET', key)
local tat = tonumber(state)
if state and not tat then
  return redis.error_reply('quota: ' .. key .. ' holds something other than a bucket')
end

local function store(v)
  if v <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, string.format('%.17g', v), 'PX', math.ceil((v - now) / 1000))
  end
end

if op == 'take' then
  -- Work relative to now: the absolute times are too large for the
  -- fractions of a microsecond to survive the arithmetic.
  local maxwait = tonumber(ARGV[5])
  local debt = 0 -- microseconds of refill already promised beyond now
  if tat and tat > now then
    debt = tat - now
  end
  local ahead = debt + micros(n)
  local wait = math.floor(ahead - micros(burst) + 0.5)
  if wait > maxwait then
    return {0, wait, math.floor(tat or now)}
  end
  store(now + ahead)
  return {1, math.max(0, wait), math.floor(now + ahead)}
end

if op == 'refund' then
  -- Hand back only the part of the take that no later take is queued
  -- behind; the rest of the schedule is already promised to others. A
  -- bucket that was reset since the take (tat behind it) gets nothing.
  local mine = tonumber(ARGV[5])
  if tat and tat >= mine then
    local back = micros(n) - (tat - mine)
    if back > 0 then
      store(tat - back)
      tat = tat - back
    end
  end
  return {1, 0, math.floor(tat or now)}
end

if op == 'probe' then
  store(tat or now)
  return {1, 0, math.floor(tat or now)}
end

return redis.error_reply('quota: unknown operation ' .. tostring(op))
