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
-- KEYS[i]      the key of layer i; for pause, one more key after the
--              layers' records when the current pause ends and how it
--              moved the queue: "<end> <at>:<shift> ..." (microseconds).
-- ARGV[1]      operation: "take", "refund", "probe", "pause", "lower" or
--              "adjust".
-- ARGV[2]      take, refund: n, the tokens to take or hand back (> 0);
--              pause: how long, in microseconds, nothing may be granted;
--              lower: the tokens the provider says remain (>= 0);
--              adjust: tokens to take (> 0) or give back (< 0) at once.
-- ARGV[3]      take: the longest wait the caller accepts, in microseconds;
--              pause: the command that announces the pause, PUBLISH or
--              SPUBLISH (Cluster), or "" for none.
-- ARGV[4]      now in microseconds, or "" to use the server's clock (TIME).
-- ARGV[3i+2]   layer i's rate, tokens per second (> 0).
-- ARGV[3i+3]   layer i's burst, the tokens it holds (>= n).
-- ARGV[3i+4]   refund: the tat of layer i that the take being cancelled
--              returned; otherwise 0.
-- ARGV[3k+2c+1], ARGV[3k+2c+2]
--              take for several callers at once (a batch): caller c's n and
--              longest wait, for c = 2 ... m; caller 1's are ARGV[2] and
--              ARGV[3]. k is the number of layers.
--
-- Reply: {granted, wait, tat_1, ..., tat_k}, integers.
--   take:   granted is 1 when the tokens were taken from every layer, in
--           which case wait (us, rounded to the nearest) is how long until
--           they have accrued in all of them; when the wait would exceed
--           ARGV[3], granted is 0, nothing is taken and wait says how long
--           it would have been. The tats (us, rounded down) identify the
--           take for a later refund. A take granted without a wait, which
--           nothing can cancel, replies the integer 0 alone instead: the
--           cheapest reply there is, for the commonest case.
--           A batch serves its callers in order, each from the bucket as
--           the one before it left it, and each granted or refused on its
--           own: a refused caller takes nothing and the next one still
--           goes. It replies the callers' replies one after another, each
--           {granted, wait, tat_1, ..., tat_k} as above, m x (2 + k)
--           integers; or the integer 0 alone when every caller was granted
--           without a wait.
--   others: {1, 0, tats} after the operation:
--   refund  hands back what no later take is queued behind;
--   probe   rewrites each layer as it is, a write that changes nothing, to
--           learn whether the server accepts writes;
--   pause   grants nothing before now + ARGV[2], as a provider's
--           Retry-After asks, and then at most one token a layer. The
--           queue moves behind the pause in one piece, keeping its order
--           and its spacing: a layer with grants scheduled beyond now
--           moves its tat by the part of the pause that extends the one in
--           force, if any; the refill of a layer without them goes on. The command
--           of ARGV[3] announces "<now> <shift>" (microseconds) on the
--           channel KEYS[1]..":pause", so that every process can move its
--           callers still sleeping on grants taken before now;
--   lower   leaves each layer at most ARGV[2] tokens, never raising it;
--   adjust  takes (or gives back) tokens now, without waiting.
--
-- A key expires when its layer is full again: an absent key and a full
-- layer are the same state, so idle buckets cost no memory.

-- The script runs on every request, on Redis's one thread, so it keeps
-- to plain arithmetic on locals: no closures, no table a layer, each
-- argument converted once where it can be.

local op = ARGV[1]
local n = tonumber(ARGV[2])
local now = ARGV[4]
if now == '' then
  local t = redis.call('TIME')
  now = t[1] * 1000000 + t[2]
else
  now = tonumber(now)
end

-- The reply, {granted, wait, tat_1, ..., tat_k}, holds the layers' tats
-- while the script works on them; it is made with room for one layer.
-- Times are in microseconds; tokens accrue in layer i at rate ARGV[3i+2]
-- a second, so t tokens take t / rate * 1000000 (dividing first keeps
-- extreme rates finite).
local r = {1, 0, 0}
local k = #KEYS
local shift = 0 -- pause: how far the queue moves
if op == 'pause' then
  k = k - 1
  -- The record: "<end>" and the announcements of the pause in force,
  -- " <at>:<shift>" each, the last four, for a Limiter that starts
  -- listening after them.
  local record = redis.call('GET', KEYS[k + 1]) or ''
  local pausedUntil = string.match(record, '^%d+')
  pausedUntil = pausedUntil and tonumber(pausedUntil) or 0
  local from = math.max(now, pausedUntil)
  if now + n > from then
    shift = now + n - from
    local said = {}
    if pausedUntil > now then
      for a in string.gmatch(record, ' %d+:%d+') do
        said[#said + 1] = a
      end
    end
    said[#said + 1] = string.format(' %d:%d', now, shift)
    record = string.format('%d', now + n) .. table.concat(said, '', math.max(1, #said - 3))
    redis.call('SET', KEYS[k + 1], record, 'PX', math.ceil(n / 1000))
  end
end
for i = 1, k do
  local state = redis.call('GET', KEYS[i])
  local tat = tonumber(state)
  if not tat then
    if state then
      return redis.error_reply('quota: ' .. KEYS[i] .. ' holds something other than a bucket')
    end
    tat = now
  end
  r[i + 2] = tat
end

if op == 'take' and #ARGV > 3 * k + 4 then
  -- A batch. The same arithmetic as one take below, for each caller in
  -- turn, on the layers' tats as the callers before it left them; each
  -- layer is written once, at the end.
  local tats, rates, fulls = {}, {}, {}
  for i = 1, k do
    tats[i] = r[i + 2]
    rates[i] = tonumber(ARGV[3 * i + 2])
    fulls[i] = tonumber(ARGV[3 * i + 3]) / rates[i] * 1000000
  end
  local reply, waited = {}, false
  for c = 1, (#ARGV - 3 * k - 2) / 2 do
    local x = 2 -- where caller c's n is, its longest wait after it
    if c > 1 then
      x = 3 * k + 2 * c + 1
    end
    local need = tonumber(ARGV[x])
    local longest = -math.huge
    for i = 1, k do
      local debt = tats[i] - now
      if debt < 0 then
        debt = 0
      end
      local wait = debt + need / rates[i] * 1000000 - fulls[i]
      if wait > longest then
        longest = wait
      end
    end
    local wait = math.floor(longest + 0.5)
    local o = #reply
    if wait > tonumber(ARGV[x + 1]) then
      reply[o + 1], reply[o + 2], waited = 0, wait, true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(tats[i])
      end
    else
      local at = now
      if longest > 0 then
        at = now + longest
      else
        wait = 0
      end
      reply[o + 1], reply[o + 2], waited = 1, wait, waited or wait ~= 0
      for i = 1, k do
        tats[i] = math.max(tats[i], at) + need / rates[i] * 1000000
        reply[o + 2 + i] = math.floor(tats[i])
      end
    end
  end
  for i = 1, k do
    local v = tats[i]
    if v ~= r[i + 2] then
      if v <= now then
        redis.call('DEL', KEYS[i])
      else
        redis.call('SET', KEYS[i], v, 'PX', math.ceil((v - now) / 1000))
      end
    end
  end
  if waited then
    return reply
  end
  return 0
end

local grant -- take: when every layer gives the tokens
if op == 'take' then
  -- Work relative to now: the absolute times are too large for the
  -- fractions of a microsecond to survive the arithmetic.
  local longest = -math.huge
  for i = 1, k do
    local rate = tonumber(ARGV[3 * i + 2])
    local debt = r[i + 2] - now -- refill already promised beyond now
    if debt < 0 then
      debt = 0
    end
    local wait = debt + n / rate * 1000000 - tonumber(ARGV[3 * i + 3]) / rate * 1000000
    if wait > longest then
      longest = wait
    end
  end
  local wait = math.floor(longest + 0.5)
  if wait > tonumber(ARGV[3]) then
    r[1], r[2] = 0, wait
    for i = 3, k + 2 do
      r[i] = math.floor(r[i])
    end
    return r
  end
  grant = now
  if longest > 0 then
    r[2], grant = wait, now + longest
  end
end

for i = 1, k do
  local tat = r[i + 2]
  local rate = tonumber(ARGV[3 * i + 2])
  local v = tat -- the layer's new tat
  if op == 'take' then
    -- Every layer gives its tokens when the slowest does: a layer that
    -- could give them sooner counts them from then, as if taken then.
    v = math.max(tat, grant) + n / rate * 1000000
  elseif op == 'refund' then
    -- Hand back only the part of the take that no later take is queued
    -- behind; the rest of the schedule is already promised to others. A
    -- layer that was reset since the take (tat behind it) gets nothing.
    local mine = tonumber(ARGV[3 * i + 4])
    if tat >= mine then
      v = tat - math.max(n / rate * 1000000 - (tat - mine), 0)
    end
  elseif op == 'pause' then
    local full = tonumber(ARGV[3 * i + 3]) / rate * 1000000
    if tat - full > now then -- a queue: the callers of the schedule wait
      v = tat + shift
    end
    v = math.max(v, now + n + full - math.min(1 / rate * 1000000, full))
  elseif op == 'lower' then
    local burst = tonumber(ARGV[3 * i + 3])
    if n < burst then
      v = math.max(tat, now + (burst - n) / rate * 1000000)
    end
  elseif op == 'adjust' then
    if n > 0 then
      v = math.max(tat, now) + n / rate * 1000000
    else
      v = math.max(tat + n / rate * 1000000, now)
    end
  elseif op ~= 'probe' then
    return redis.error_reply('quota: unknown operation ' .. tostring(op))
  end
  -- A layer expires when it is full again: an absent key and a full
  -- layer are the same state. A probe writes even what does not change.
  -- (Redis formats a number argument with 17 digits, all a double has.)
  if v ~= tat or op == 'probe' then
    if v <= now then
      redis.call('DEL', KEYS[i])
    else
      redis.call('SET', KEYS[i], v, 'PX', math.ceil((v - now) / 1000))
    end
  end
  r[i + 2] = math.floor(v)
end
if op == 'take' and r[2] == 0 then
  return 0
end
if shift > 0 and ARGV[3] ~= '' then
  redis.call(ARGV[3], KEYS[1] .. ':pause', string.format('%d %d', now, shift))
end
return r
