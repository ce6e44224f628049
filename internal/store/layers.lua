-- quota's bucket scripts, continued (see core.lua): the layers, and the
-- core's functions.
--
-- The layers: tats[i], rates[i] and fulls[i], the µs layer i takes to
-- fill from empty. Times are in microseconds; tokens accrue in layer i at
-- rates[i] a second, so t tokens take t / rate * 1000000 (dividing first
-- keeps extreme rates finite). Work relative to now: the absolute times
-- are too large for the fractions of a microsecond to survive the
-- arithmetic.
--
-- Every script's last 2k ARGV are the layers' Limits, layer i's rate
-- (tokens a second, > 0) and then its burst (the tokens it holds); ""
-- for a Limit the caller does not know (a record operation), which the
-- record tells for the first layer ("seen") and the key for the others.
-- The first layer computes with the override when there is one (unless
-- KEYS[1] is a further layer's, updated alone after an outage), and a
-- layer the fleet learned a lower rate for, with that (learn.lua). A
-- layer whose Limit is not known is left as it is.
-- set writes v, a layer's tat after now, to its key, which expires when
-- the layer is full again (at v). A whole number of microseconds is
-- formatted here, as Redis would format the number (%.17g), at a fraction
-- of the cost of its conversion. days: the daily layers, nil for none;
-- dayStore writes such a layer's tat as its key holds it (daily.lua).
local days, dayStore
local function set(key, v)
  if days then
    v = dayStore(key, v)
  end
  local ms = (v - now) / 1000
  local px = ms - ms % 1
  if px < ms then
    px = px + 1
  end
  if v % 1 == 0 and v < 1e17 then
    redis.call('SET', key, string.format('%d', v), 'PX', string.format('%d', px))
  else
    redis.call('SET', key, v, 'PX', px)
  end
end

local tats, rates, fulls, caps = {}, {}, {}, {}
local limits = #ARGV - 2 * k -- layer i's rate is ARGV[limits + 2i - 1], its burst ARGV[limits + 2i]
-- learnt[i]: the rate the fleet learned for layer i, when it learns one
-- (see learn.lua); caps[i], the layer's Limit's rate, which it stays
-- below. A learned rate keeps the Limit's time to fill: the burst shrinks
-- with the rate.
local learnt = {}
if f[6] and ctl == KEYS[1] .. ':ctl' then
  local fields = {}
  for i = 1, k do
    fields[i] = 'l:' .. string.sub(KEYS[i], #KEYS[1] + 1)
  end
  learnt = redis.call('HMGET', ctl, unpack(fields))
end
for i = 1, k do
  local state = redis.call('GET', KEYS[i])
  local tat = state and tonumber(state)
  if not tat then
    if state then
      return redis.error_reply('quota: ' .. KEYS[i] .. ' holds something other than a bucket')
    end
    -- An absent key is a full layer: full now, and under a pause with
    -- no end full since the pause's origin, as the key of a layer that
    -- owes beyond it is kept (see write).
    tat = now
    if forever and paused then
      tat = math.min(now, since + shifted)
    end
  end
  tats[i] = tat
  local rate, burst = ARGV[limits + 2 * i - 1], ARGV[limits + 2 * i]
  local override = i == 1 and f[3] and ctl == KEYS[1] .. ':ctl' and redis.call('HGET', ctl, 'burst')
  if override then
    rate, burst = f[3], override
  elseif rate == '' and i == 1 then
    rate, burst = string.match(redis.call('HGET', ctl, 'seen') or '', '^(%S+) (%S+)$')
  elseif rate == '' then
    rate, burst = string.match(KEYS[i], ':([^:/]+)/([^:/]+)$')
  end
  rate, burst = tonumber(rate), tonumber(burst)
  if rate and burst and rate > 0 then
    rates[i], fulls[i], caps[i] = rate, burst / rate * 1000000, rate
    local l = not override and tonumber(learnt[i])
    if l and l < rate then
      rates[i] = l
    end
  end
end

-- The functions of the core are made for every call but a take that uses
-- nothing beyond it (a plain take on a bucket no class took from), which
-- makes no function at all (see script.lua).
local write, sfx, expire
local keep = 10000 -- ms, the least the record is kept
if op ~= 'take' or uses ~= 'plain' or pmax > 0 then
  -- write sets layer i's tat to v, or deletes its key when v has passed.
  -- While a pause with no end is in force, a layer that owes anything
  -- beyond the pause's origin keeps it until the resume moves it: its key
  -- does not expire meanwhile. A layer key expires when its layer is full
  -- again: an absent key and a full layer are the same state, so idle
  -- buckets cost no memory.
  function write(i, v)
    if forever and paused and v > since + shifted and not (days and days[i]) then
      redis.call('SET', KEYS[i], v)
    elseif v <= now then
      redis.call('DEL', KEYS[i])
    else
      set(KEYS[i], v)
    end
  end

  -- sfx returns the suffix of layer i's key after the bucket's, which
  -- names the layer in the record's fields ("" for the first).
  function sfx(i)
    return string.sub(KEYS[i], #KEYS[1] + 1)
  end

  -- expire keeps the record while it holds an override or a pause with
  -- no end, and otherwise for as long as its pause or its layers' keys,
  -- and keep at least.
  function expire()
    local g = redis.call('HMGET', ctl, 'rate', 'until')
    if g[1] or g[2] == 'forever' then
      redis.call('PERSIST', ctl)
      return
    end
    local ttl = keep
    if g[2] then
      ttl = math.max(ttl, math.ceil((tonumber(g[2]) - now) / 1000))
    end
    for i = 1, k do
      ttl = math.max(ttl, redis.call('PTTL', KEYS[i]))
    end
    redis.call('PEXPIRE', ctl, ttl)
  end
end
