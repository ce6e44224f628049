-- quota's bucket scripts, continued (see core.lua): the rate the fleet
-- learns of the provider's real limit, and the change of a layer's rate.
--
-- A Transport that adapts (quota.Adaptive) takes each layer's Limit as
-- the most it may reach; the rate in force is learned, one for the whole
-- fleet, in the record: l:<sfx>, layer sfx's learned rate, below its
-- Limit's (layers.lua computes with it, keeping the Limit's time to
-- fill); m:<sfx>, "<peak> <cut> <step> <cross> <floor> <rise> <top>
-- <why>": the rate the last cut was made from, when it was made, when the
-- rate last rose, when it passed the peak (0 before), the least rate and
-- the rise a second, as shares of the Limit's rate, the most the
-- provider's RateLimit-Policy allows (0: it says nothing), and the
-- refusal that cut it; learn, how many layers learn.
--
-- Down (cut, the update script's refuse): a refusal of a request sent
-- after the last cut's grace cuts the rate to 0.9 of it, not below the
-- floor, and empties the layer, as the provider's is. A refusal of a
-- request sent before then is of the same overload: however many
-- processes tell it, it can only take that one cut deeper, to the share
-- of its process's requests the provider accepted lately (0.5 of the
-- rate the cut was made from at least). The grants given out move with
-- the rate, as a change of Limit moves them.
-- Up (rise, the record's read, which every Limiter in use makes each
-- second): once an interval for the whole fleet, while the layer owes
-- (its callers queue) and no cut came for an interval, the rate closes
-- half its gap to the peak a second, and past the peak rises by rise
-- times its Limit a second, doubling every second, at most a
-- quarter of the rate. Back at its Limit, the layer stops learning.
-- Bound (bound, refuse's too): a RateLimit-Policy below the Limit is the
-- most the rate may be, until one says otherwise.
-- The first layer learns nothing while an override is in force.
local grace, interval = 250000, 500000 -- µs
local rescale, cut, bound, rise, learned
if op ~= 'take' then
  -- rescale moves layer i from rate r1 and burst b1 to r2 and b2, keeping
  -- the tokens it holds or owes as of the end of the pause in force, or
  -- of now: the pause is not debt. The grants given out move with it.
  function rescale(i, r1, b1, r2, b2)
    local ref = origin()
    if r1 and r2 and r1 ~= r2 then
      stretch(i, ref, r1 / r2)
      saveTimeline()
    end
    local t1 = tats[i]
    if not (r1 and b1 and r2 and b2) or t1 <= ref or (r1 == r2 and b1 == b2) then
      return
    end
    local tokens = b1 - (t1 - ref) / 1000000 * r1
    local v = ref + (b2 - math.min(tokens, b2)) / r2 * 1000000
    rates[i], fulls[i] = r2, b2 / r2 * 1000000
    tats[i] = floor(i, v)
    write(i, tats[i])
    if pmax > 0 then
      moveTails(i, function(t)
        if t <= ref then
          return t
        end
        local held = b1 - (t - ref) / 1000000 * r1
        return floor(i, ref + (b2 - math.min(held, b2)) / r2 * 1000000)
      end)
    end
    if classesDirty then
      saveClasses()
    end
  end

  -- state returns layer i's learning, its rate r false when it learns
  -- none; save writes it, or ends it when r is false.
  local function state(i)
    local s = {r = tonumber(learnt[i]) or false}
    local m = redis.call('HGET', ctl, 'm:' .. sfx(i)) or ''
    local p, c, st, x, fl, up, top, why = string.match(m, '^(%S+) (%S+) (%S+) (%S+) (%S+) (%S+) (%S+) ?(.*)$')
    s.peak, s.cut, s.step, s.cross = tonumber(p) or 0, tonumber(c) or 0, tonumber(st) or 0, tonumber(x) or 0
    s.floor, s.rise, s.top, s.why = tonumber(fl) or 0, tonumber(up) or 0, tonumber(top) or 0, why or ''
    return s
  end
  local function save(i, s)
    local x = sfx(i)
    if s.r then
      redis.call('HSET', ctl, 'l:' .. x, string.format('%.17g', s.r), 'm:' .. x,
        string.format('%.17g %d %d %d %.17g %.17g %.17g %s', s.peak, s.cut, s.step, s.cross, s.floor, s.rise, s.top, s.why))
      if not learnt[i] then
        redis.call('HINCRBY', ctl, 'learn', 1)
      end
    elseif learnt[i] then
      redis.call('HDEL', ctl, 'l:' .. x, 'm:' .. x)
      if redis.call('HINCRBY', ctl, 'learn', -1) <= 0 then
        redis.call('HDEL', ctl, 'learn')
      end
    end
    learnt[i] = s.r
  end

  -- cut lowers layer i after a refusal of a request sent at sent (µs), ok
  -- being the share of its process's requests accepted lately, floor and
  -- up the Adaptive's, why the refusal; it reports whether it cut.
  function cut(i, sent, ok, floorShare, up, why)
    if i == 1 and f[3] or not caps[i] then
      return false
    end
    local s, r = state(i), rates[i]
    local v = math.max(r * 0.9, floorShare * caps[i])
    if sent < s.cut + grace then
      -- The same overload: its cut goes only deeper, to what this
      -- process saw accepted of the rate it was made from.
      v = math.max(s.peak * math.min(0.9, math.max(0.5, 0.95 * ok)), floorShare * caps[i])
      if v >= r then
        return false
      end
      s.r = v
    elseif v >= r then
      return false -- at the floor
    else
      s.peak, s.cut, s.step, s.cross, s.floor, s.rise, s.why, s.r = r, now, now, 0, floorShare, up, why, v
    end
    save(i, s)
    rescale(i, r, r * fulls[i] / 1000000, v, v * fulls[i] / 1000000)
    -- The provider has nothing left: nor does the layer.
    local empty = floor(i, origin() + fulls[i])
    if tats[i] < empty then
      tats[i] = empty
      write(i, empty)
    end
    return true
  end

  -- bound holds layer i at most at v, the rate a RateLimit-Policy allows
  -- (none at or above its Limit); it reports whether it cut.
  function bound(i, v, floorShare, up)
    if i == 1 and f[3] or not caps[i] then
      return false
    end
    local s, r = state(i), rates[i]
    if v >= caps[i] then
      v = 0
    end
    if s.top == v or not s.r and v == 0 then
      return false
    end
    s.top = v
    if not s.r then
      s.r, s.peak, s.step, s.floor, s.rise = r, r, now, floorShare, up
    end
    if v > 0 and v < r then
      s.r = v
      save(i, s)
      rescale(i, r, r * fulls[i] / 1000000, v, v * fulls[i] / 1000000)
      return true
    end
    s.r = s.r < caps[i] and s.r
    save(i, s)
    return false
  end

  -- rise raises layer i once an interval while its callers queue.
  function rise(i)
    if i == 1 and f[3] or not caps[i] or not learnt[i] then
      return
    end
    local s = state(i)
    if now - s.step < interval then
      return
    end
    local dt = math.min(now - s.step, 2000000) / 1000000
    s.step = now
    if now - s.cut >= interval and tats[i] - now > fulls[i] then
      local r, base = s.r, s.rise * caps[i]
      if r < s.peak then
        r = math.min(s.peak, r + math.max((s.peak - r) / 2, base) * dt)
      else
        if s.cross == 0 then
          s.cross = now
        end
        r = r + math.min(base * 2 ^ ((now - s.cross) / 1000000), r / 4) * dt
      end
      if s.top > 0 then
        r = math.min(r, s.top)
      end
      s.r = r < caps[i] and r
    end
    save(i, s)
  end

  -- learned returns the layers' learned rates, "" for a layer that
  -- learns none, joined with spaces.
  function learned()
    local t = {}
    for i = 1, k do
      t[i] = learnt[i] and string.format('%.6g', learnt[i]) or ''
    end
    return table.concat(t, ' ')
  end
end
