-- quota's bucket script, continued (see script.lua): the other layer operations: refund, probe, pause, lower, adjust, resuming.
-- A refund or an adjust of a take of a priority class names the class
-- too, which they do not need: their tokens are the layers'.
local arg2, tenant = tenantArg(ARGV[2])
if not arg2 then
  return tenant
end
arg2 = string.gsub(arg2, '@[1-7][0-9.:]*$', '')
local n = tonumber(arg2)
local each -- refund, adjust, lower: one amount per layer, when n is none
if not n and (op == 'refund' or op == 'adjust' or op == 'lower') then
  each = amounts(arg2, op ~= 'refund')
  if not each then
    return redis.error_reply('quota: ' .. op .. ' of ' .. tostring(ARGV[2]) .. ' from ' .. k .. ' layers')
  end
end
-- adjust: the tokens the provider says remain, as lower's ARGV[2], to
-- apply after the adjust in the same call; absent or "" for none. Then
-- the channel that announces the give-backs, absent or "" for none.
local lows
if op == 'adjust' and ARGV[3 * k + 5] and ARGV[3 * k + 5] ~= '' then
  lows = amounts(ARGV[3 * k + 5], true)
  if not lows then
    return redis.error_reply('quota: a lower of ' .. tostring(ARGV[3 * k + 5]) .. ' from ' .. k .. ' layers')
  end
end
if op == 'resuming' then
  -- The fleet leaves its local shares at n: no take before then.
  local at = n
  if at > now and (not f[7] or tonumber(f[7]) < at) then
    redis.call('HSET', ctl, 'resume', string.format('%d', at))
    expire()
  end
  for i = 1, k do
    r[i + 2] = math.floor(r[i + 2])
  end
  return r
end
if op == 'pause' then
  if pauseTo(now + n, 'provider') then
    expire()
    if ARGV[3] ~= '' then
      -- pcall: whether the pause changed anything is known only once it
      -- is written; it holds every take whether or not this reaches the
      -- sleepers, who read the record again in time.
      redis.pcall('PUBLISH', ARGV[3], KEYS[1])
    end
  end
  for i = 1, k do
    r[i + 2] = math.floor(r[i + 2])
  end
  return r
end
if op == 'adjust' and ARGV[3] ~= '' then
  -- A settle counts once, however often it is sent: a retry after a lost
  -- reply finds its id.
  local ms = math.floor(now / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 2], '-inf', ms)
  if redis.call('ZADD', KEYS[k + 2], 'NX', ms + 60000, ARGV[3]) == 0 then
    for i = 1, k do
      r[i + 2] = math.floor(r[i + 2])
    end
    return r
  end
  redis.call('PEXPIRE', KEYS[k + 2], 60000)
end
if op == 'adjust' and tenant and tenant.charge ~= 0 then
  -- The settle's tenant is charged what its take cost more, or given
  -- back what it cost less (see tenants).
  local e = tenantOf(tenant.name, tenant.w, tenant.cap)
  e.f = start(e) + tenant.charge / e.w
  e.dirty, fair.dirty = true, true
  saveFair()
  expire()
end

for i = 1, k do
  local tat = r[i + 2]
  local rate = rates[i]
  local v = tat -- the layer's new tat
  local n = n or (each and each[i])
  if (op == 'refund' or op == 'adjust') and n == 0 or op == 'lower' and n < 0 then
    -- nothing to hand back or take from this layer, or no news of it
  elseif op == 'refund' then
    -- Hand back only the part of the take that no later take is queued
    -- behind; the rest of the schedule is already promised to others. A
    -- layer that was reset since the take (tat behind it) gets nothing.
    local mine = tonumber(ARGV[3 * i + 4])
    if tat >= mine then
      v = floor(i, tat - math.max(n / rate * 1000000 - (tat - mine), 0))
      moveTails(i, function(t)
        return math.min(t, v) -- no class's tail stays beyond the layer's
      end)
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
  elseif op ~= 'probe' then
    return redis.error_reply('quota: unknown operation ' .. tostring(op))
  end
  if lows and lows[i] >= 0 then
    -- The adjust's lower: the layer holds at most what the provider says
    -- remains, after the adjust.
    local burst = fulls[i] * rate / 1000000
    if lows[i] < burst then
      v = math.max(v, origin() + (burst - lows[i]) / rate * 1000000)
    end
  end
  -- A probe writes even what does not change. (Redis formats a number
  -- argument with 17 digits, all a double has.)
  if v ~= tat or op == 'probe' then
    write(i, v)
  end
  if op == 'adjust' and v < tat then
    -- A give-back moves the layer's queue: the callers asleep in it may
    -- go that much sooner (see back); no class's tail stays beyond it.
    moveBack(i, tat - v)
    moved = true
    moveTails(i, function(t)
      return math.min(t, v)
    end)
  end
  r[i + 2] = math.floor(v)
end
saveClasses()
if moved then
  local ev = saveTimeline()
  expire()
  local channel = ARGV[3 * k + 6]
  if channel and channel ~= '' then
    -- "b", the timeline's count, and the layers' anchors (see timeline),
    -- a newline, then the bucket's key: the callers asleep in the queue go
    -- sooner. pcall: an announcement known only once written is lost
    -- rather than the adjust failed when the user may not publish; the
    -- sleepers read the record again in time.
    redis.pcall('PUBLISH', channel, 'b ' .. ev .. ' ' .. timeline() .. '\n' .. KEYS[1])
  end
end
return r
