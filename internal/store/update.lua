-- quota: the updates of a bucket's layers other than a take. This script
-- is core.lua, layers.lua, classes.lua, timeline.lua, tenants.lua and
-- this body, joined in that order after the prelude (internal/store's
-- scripts.go); core.lua describes the bucket and its record.
--
-- refund   hands back what no later take is queued behind;
-- probe    rewrites each layer as it is, to learn whether the server
--          accepts writes;
-- pause    grants nothing before now + ARGV[5] (see pauseTo), as a
--          provider's Retry-After asks;
-- lower    leaves each layer at most the tokens the provider says remain,
--          never raising it;
-- adjust   takes (or gives back) tokens now, without waiting, once per
--          id, as a settle does;
-- resuming records in the record's "resume" field the instant the fleet
--          leaves its local shares, the latest it was told;
-- refuse   cuts the rates the fleet learns after a provider's refusal,
--          once an overload (see learn.lua).
--
-- KEYS[1..k]  the layers' keys, the first layer's being the bucket's key.
-- KEYS[k+1]   the control record.
-- KEYS[k+2]   adjust only: the ids of the settles applied lately, a
--             sorted set scored by when each may be forgotten (ms).
-- ARGV[1]     the operation.
-- ARGV[2]     now in microseconds, or "" to use the server's clock.
-- ARGV[3]     "tenant" for an adjust that charges its tenant (ARGV[6] to
--             ARGV[9]), "plain" otherwise.
-- ARGV[4]     pause, adjust, refuse: the channel that announces the
--             pause, the adjust's give-backs, or the cut; "" for none.
-- ARGV[5]     pause: how long, in microseconds; resuming: the instant, in
--             microseconds, the fleet leaves its local shares; adjust: the
--             settle's id, "" for none; refuse: how long ago the refused
--             request was sent, in microseconds.
-- ARGV[6..9]  refuse: the share of its process's requests the provider
--             accepted lately, the least rate and the rise a second (as
--             shares of each Limit's rate), and what the refusal was, ""
--             for a response that only bounds the rates.
-- ARGV[6]     adjust: the tenant its take was for (see tenants.lua);
-- ARGV[7]     the tenant's weight, 0 for none;
-- ARGV[8]     the most tenants the bucket keeps apart (as a take's);
-- ARGV[9]     the µs the tenant is charged more, below 0 given back.
-- ARGV[8+2i]  layer i's amount: refund, the tokens to hand back (>= 0);
--             adjust, the tokens to take (> 0) or give back (< 0); lower,
--             the tokens the provider says remain, or below 0 when it
--             says nothing of the layer; refuse, 1 for a layer the
--             refusal names (none: those whose callers queue, else the
--             first); otherwise 0.
-- ARGV[9+2i]  refund: the tat of layer i that the take being refunded
--             replied; adjust: the tokens the provider says remain after
--             the adjust, or "" (or below 0) for none; refuse: the rate
--             the provider's RateLimit-Policy allows the layer, 0 for as
--             much as its Limit, "" when it says nothing; otherwise "".
-- The last 2k ARGV: the layers' Limits (see layers.lua).
--
-- Reply: the layers' tats after the operation, us rounded down.
local channel, arg = ARGV[4], ARGV[5]
local tenant, weight, cap, charged = ARGV[6], tonumber(ARGV[7]), tonumber(ARGV[8]), tonumber(ARGV[9])
if #ARGV ~= 9 + 4 * k or k < 1 then
  return redis.error_reply('quota: ' .. tostring(op) .. ' of ' .. #ARGV .. ' arguments from ' .. k .. ' layers')
end
if op ~= 'refund' and op ~= 'probe' and op ~= 'pause' and op ~= 'lower' and op ~= 'adjust' and op ~= 'resuming'
  and op ~= 'refuse' then
  return redis.error_reply('quota: unknown operation ' .. tostring(op))
end
for i = 1, k do
  local amount = tonumber(ARGV[8 + 2 * i])
  if not amount or op == 'refund' and amount < 0 then
    return redis.error_reply('quota: ' .. op .. ' of ' .. tostring(ARGV[8 + 2 * i]) .. ' from layer ' .. i)
  end
end
-- reply returns the layers' tats.
local function reply()
  local r = {}
  for i = 1, k do
    r[i] = math.floor(tats[i])
  end
  return r
end

if op == 'resuming' then
  -- The fleet leaves its local shares at arg: no take before then.
  local at = tonumber(arg)
  if at > now and (not f[4] or tonumber(f[4]) < at) then
    redis.call('HSET', ctl, 'resume', string.format('%d', at))
    expire()
  end
  return reply()
end
if op == 'refuse' then
  local bounded = false
  for i = 1, k do
    local v = tonumber(ARGV[9 + 2 * i])
    if v and v >= 0 and not (days and days[i]) and bound(i, v, tonumber(ARGV[7]), tonumber(ARGV[8])) then
      bounded = true
    end
  end
  local named, cuts = {}, false
  for i = 1, k do
    named[i] = tonumber(ARGV[8 + 2 * i]) > 0
    cuts = cuts or named[i]
  end
  local none = not cuts
  for i = 1, k do -- none named: the layers whose callers queue, else the first
    if none and fulls[i] and tats[i] - now > fulls[i] then
      named[i], cuts = true, true
    end
  end
  named[1] = named[1] or not cuts
  cuts = bounded
  for i = 1, k do
    if ARGV[9] ~= '' and named[i] and not (days and days[i]) and cut(i, now - tonumber(arg), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]), ARGV[9]) then
      cuts = true
    end
  end
  if cuts then
    expire()
    if channel ~= '' then
      redis.pcall('PUBLISH', channel, KEYS[1]) -- the Limiters read the record again
    end
  end
  return reply()
end
if op == 'pause' then
  if pauseTo(now + tonumber(arg), 'provider') then
    expire()
    if channel ~= '' then
      -- pcall: whether the pause changed anything is known only once it
      -- is written; it holds every take whether or not this reaches the
      -- sleepers, who read the record again in time.
      redis.pcall('PUBLISH', channel, KEYS[1])
    end
  end
  return reply()
end
if op == 'adjust' and arg ~= '' then
  -- A settle counts once, however often it is sent: a retry after a lost
  -- reply finds its id.
  local ms = math.floor(now / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 2], '-inf', ms)
  if redis.call('ZADD', KEYS[k + 2], 'NX', ms + 60000, arg) == 0 then
    return reply()
  end
  redis.call('PEXPIRE', KEYS[k + 2], 60000)
end
if op == 'adjust' and uses == 'tenant' and weight and weight > 0 and charged and charged ~= 0 then
  -- The settle's tenant is charged what its take cost more, or given
  -- back what it cost less (see tenants.lua).
  local e = tenantOf(tenant, weight, cap)
  e.f = start(e) + charged / e.w
  e.dirty, fair.dirty = true, true
  saveFair()
  expire()
end

local moved = false
for i = 1, k do
  local tat = tats[i]
  local rate = rates[i]
  local v = tat -- the layer's new tat
  local n = tonumber(ARGV[8 + 2 * i])
  if (op == 'refund' or op == 'adjust') and n == 0 or op == 'lower' and n < 0 then
    -- nothing to hand back or take from this layer, or no news of it
  elseif days and days[i] then
    if op ~= 'probe' then
      v = dayUpdate(i, tat, n, ARGV[9 + 2 * i]) -- daily.lua
    end
  elseif op == 'refund' then
    -- Hand back only the part of the take that no later take is queued
    -- behind; the rest of the schedule is already promised to others. A
    -- layer that was reset since the take (tat behind it) gets nothing.
    local mine = tonumber(ARGV[9 + 2 * i])
    if tat >= mine then
      v = floor(i, tat - math.max(n / rate * 1000000 - (tat - mine), 0))
      if pmax > 0 then
        moveTails(i, function(t)
          return math.min(t, v) -- no class's tail stays beyond the layer's
        end)
      end
    end
  elseif op == 'lower' then
    local burst = fulls[i] * rate / 1000000
    if n < burst then
      v = math.max(tat, origin() + (burst - n) / rate * 1000000)
    end
  elseif op == 'adjust' then
    if n > 0 then
      v = math.max(tat, origin()) + n / rate * 1000000
    else
      v = floor(i, math.max(tat + n / rate * 1000000, origin()))
    end
  end
  local low = op == 'adjust' and tonumber(ARGV[9 + 2 * i])
  if low and low >= 0 and not (days and days[i]) then
    -- The adjust's lower: the layer holds at most what the provider says
    -- remains, after the adjust.
    local burst = fulls[i] * rate / 1000000
    if low < burst then
      v = math.max(v, origin() + (burst - low) / rate * 1000000)
    end
  end
  -- A probe writes even what does not change. (Redis formats a number
  -- argument with 17 digits, all a double has.)
  if v ~= tat or op == 'probe' then
    write(i, v)
  end
  if op == 'adjust' and v < tat and not (days and days[i]) then
    -- A give-back moves the layer's queue: the callers asleep in it may
    -- go that much sooner (see moveBack); no class's tail stays beyond it.
    moveBack(i, tat - v)
    moved = true
    if pmax > 0 then
      moveTails(i, function(t)
        return math.min(t, v)
      end)
    end
  end
  tats[i] = v
end
if classesDirty then
  saveClasses()
end
if moved then
  local ev = saveTimeline()
  expire()
  if channel ~= '' then
    -- "b", the timeline's count, and the layers' anchors (see
    -- timeline.lua), a newline, then the bucket's key: the callers asleep
    -- in the queue go sooner. pcall: an announcement known only once
    -- written is lost rather than the adjust failed when the user may not
    -- publish; the sleepers read the record again in time.
    redis.pcall('PUBLISH', channel, 'b ' .. ev .. ' ' .. timeline() .. '\n' .. KEYS[1])
  end
end
return reply()
