-- quota: one token bucket per key, refilled, checked and taken in one call.
--
-- A bucket is kept as a single number, its theoretical arrival time (tat):
-- the instant, in microseconds, at which the bucket would be full again. At
-- time now it holds burst - (tat - now) * rate tokens, so tokens can run into
-- debt: a take always succeeds when its wait is acceptable, moves tat forward
-- and tells the caller how long to sleep until its tokens have accrued. Later
-- callers queue behind it, first come, first served, with one call each.
--
-- A bucket may obey several limits at once (10 a second and 300 a minute):
-- one key per layer, all in the bucket's hash slot, checked and taken
-- together, all or nothing.
--
-- KEYS[i]      the key of layer i.
-- ARGV[1]      operation: "take", "refund", "probe", "pause", "lower" or
--              "adjust".
-- ARGV[2]      take, refund: n, the tokens to take or hand back (> 0);
--              pause: how long, in microseconds, nothing may be granted;
--              lower: the tokens the provider says remain (>= 0);
--              adjust: tokens to take (> 0) or give back (< 0) at once.
-- ARGV[3]      take: the longest wait the caller accepts, in microseconds.
-- ARGV[4]      now in microseconds, or "" to use the server's clock (TIME).
-- ARGV[3i+2]   layer i's rate, tokens per second (> 0).
-- ARGV[3i+3]   layer i's burst, the tokens it holds (>= n).
-- ARGV[3i+4]   refund: the tat of layer i that the take being cancelled
--              returned; otherwise 0.
--
-- Reply: {granted, wait, tat_1, ..., tat_k}, integers.
--   take:   granted is 1 when the tokens were taken from every layer, in
--           which case wait (us, rounded to the nearest) is how long until
--           they have accrued in all of them; when the wait would exceed
--           ARGV[3], granted is 0, nothing is taken and wait says how long
--           it would have been. The tats (us, rounded down) identify the
--           take for a later refund.
--   others: {1, 0, tats} after the operation:
--   refund  hands back what no later take is queued behind;
--   probe   rewrites each layer as it is, a write that changes nothing, to
--           learn whether the server accepts writes;
--   pause   grants nothing before now + ARGV[2], as a provider's
--           Retry-After asks, and then at most one token a layer;
--   lower   leaves each layer at most ARGV[2] tokens, never raising it;
--   adjust  takes (or gives back) tokens now, without waiting.
--
-- A key expires when its layer is full again: an absent key and a full
-- layer are the same state, so idle buckets cost no memory.

local op = ARGV[1]
local n = tonumber(ARGV[2])
local now = tonumber(ARGV[4])
if not now then
  if redis.replicate_commands then
    redis.replicate_commands() -- lets TIME precede writes on Redis < 5
  end
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local layers = {}
for i, key in ipairs(KEYS) do
  local state = redis.call('GET', key)
  local tat = tonumber(state)
  if state and not tat then
    return redis.error_reply('quota: ' .. key .. ' holds something other than a bucket')
  end
  local j = 3 * i + 2
  layers[i] = {key = key, rate = tonumber(ARGV[j]), burst = tonumber(ARGV[j + 1]),
               mine = tonumber(ARGV[j + 2]), tat = tat or now}
end

-- micros returns how long tokens take to accrue in layer l, in
-- microseconds. Dividing first keeps extreme rates finite.
local function micros(l, tokens)
  return tokens / l.rate * 1000000
end

local function store(l, v)
  l.tat = v
  if v <= now then
    redis.call('DEL', l.key)
  else
    redis.call('SET', l.key, string.format('%.17g', v), 'PX', math.ceil((v - now) / 1000))
  end
end

local function reply(granted, wait)
  local r = {granted, wait}
  for i, l in ipairs(layers) do
    r[i + 2] = math.floor(l.tat)
  end
  return r
end

if op == 'take' then
  -- Work relative to now: the absolute times are too large for the
  -- fractions of a microsecond to survive the arithmetic.
  local longest = -math.huge
  for _, l in ipairs(layers) do
    local debt = math.max(l.tat - now, 0) -- refill already promised beyond now
    longest = math.max(longest, debt + micros(l, n) - micros(l, l.burst))
  end
  local wait = math.floor(longest + 0.5)
  if wait > tonumber(ARGV[3]) then
    return reply(0, wait)
  end
  -- Every layer gives its tokens when the slowest does: a layer that could
  -- give them sooner counts them from then, as if taken then.
  local grant = now + math.max(longest, 0)
  for _, l in ipairs(layers) do
    store(l, math.max(l.tat, grant) + micros(l, n))
  end
  return reply(1, math.max(wait, 0))
end

for _, l in ipairs(layers) do
  if op == 'refund' then
    -- Hand back only the part of the take that no later take is queued
    -- behind; the rest of the schedule is already promised to others. A
    -- layer that was reset since the take (tat behind it) gets nothing.
    if l.tat >= l.mine then
      local back = micros(l, n) - (l.tat - l.mine)
      if back > 0 then
        store(l, l.tat - back)
      end
    end
  elseif op == 'probe' then
    store(l, l.tat)
  elseif op == 'pause' then
    local full = micros(l, l.burst)
    store(l, math.max(l.tat, now + n + full - math.min(micros(l, 1), full)))
  elseif op == 'lower' then
    if n < l.burst then
      store(l, math.max(l.tat, now + micros(l, l.burst - n)))
    end
  elseif op == 'adjust' then
    if n > 0 then
      store(l, math.max(l.tat, now) + micros(l, n))
    else
      store(l, math.max(l.tat - micros(l, -n), now))
    end
  else
    return redis.error_reply('quota: unknown operation ' .. tostring(op))
  end
end
return reply(1, 0)
