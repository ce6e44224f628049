-- quota: the operations of a bucket's control record. This script is
-- core.lua, layers.lua, classes.lua, timeline.lua, learn.lua and this body, joined
-- in that order after the prelude (internal/store's scripts.go); core.lua
-- describes the bucket and its record.
--
-- read     records the Limit the Limiter's callers pass, the further
--          layers' suffixes and the Limiter among the bucket's users,
--          adds its callers' grants to the layers' history (see tally),
--          and raises the rates the fleet learns (see learn.lua);
-- limit    sets the operator's override of the first layer's Limit;
-- clear    removes it; each rescales the first layer's queue to the
--          Limit now in force;
-- hold     an operator's pause: grants nothing before now + ARGV[9], or
--          until a resume (see pauseTo);
-- resume   ends the pause in force, whoever set it.
-- Every operation but read is announced on ARGV[4] before it
-- writes anything.
--
-- KEYS[1..k]  the layers' keys, the first layer's being the bucket's key:
--             read, hold and resume, every layer the Limiters recorded;
--             the others, the first alone.
-- KEYS[k+1]   the control record.
-- ARGV[1]     the operation.
-- ARGV[2]     now in microseconds, or "" to use the server's clock.
-- ARGV[3]     "plain".
-- ARGV[4]     limit, clear, hold, resume: the channel that announces the
--             change.
-- ARGV[5]     read: the Limiter's id.
-- ARGV[6]     read: the first layer's rate, as the Limiter's callers pass
--             it, or a daily Limit's name (daily.lua); limit: the
--             override's rate.
-- ARGV[7]     read: the first layer's burst, likewise; limit: the
--             override's burst.
-- ARGV[8]     read: the further layers' key suffixes, separated by spaces.
-- ARGV[9]     hold: how long, in microseconds, or "forever".
-- ARGV[10]    read: the grants the Limiter's callers went on since its
--             last read, by second: "<unix second> <layer 1's tokens> ...
--             <layer k's>", joined with ","; "" for none.
-- ARGV[11]    read: what the first layer meters, when each layer meters
--             its own; "" otherwise.
-- ARGV[12]    read: how many of the bucket's slots the Limiter holds
--             lingering, after their requests ended (quota.WithSlotLinger).
--             The user's field holds them after its until: "<ms> <n>".
-- The last 2k ARGV: "" each (the Limits are the record's and the keys',
-- see core.lua).
--
-- Reply: {now, rate, burst, since, until, seen, src, ev, anchors,
-- pushes, learned}, strings, "" for what is absent: the override, the pause, the
-- Limit the Limiters last passed, who set the pause's end, the timeline's count and the layers' anchors
-- "<at> <pos> <scale>" joined with "," (see timeline.lua), and "<pt>" then
-- how far pushes moved each class's queue in each layer, class 0's first,
-- or "" on a bucket no priority class took from; and the layers' learned
-- rates, "" for a layer that learns none, joined with spaces (see
-- learn.lua).
local channel, id, rate, burst, layers, hold, grants = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10]
if op ~= 'read' and op ~= 'limit' and op ~= 'clear' and op ~= 'hold' and op ~= 'resume' then
  return redis.error_reply('quota: unknown operation ' .. tostring(op))
end
local use = 5000 -- ms a Limiter counts as a user after a read
-- sweep removes the users whose use has lapsed, and records how many are
-- left.
local function sweep()
  local ms = math.floor(now / 1000)
  local h = redis.call('HGETALL', ctl)
  if #h == 0 then
    return -- no record, and none made
  end
  local n = 0
  for i = 1, #h, 2 do
    if string.sub(h[i], 1, 2) == 'u:' then
      if tonumber(string.match(h[i + 1], '^%S+')) <= ms then
        redis.call('HDEL', ctl, h[i])
      else
        n = n + 1
      end
    end
  end
  redis.call('HSET', ctl, 'users', n)
end
-- rescaleFirst moves the first layer from the Limit in force before a
-- change, r1 and b1, to the one in force after it (see learn.lua).
local function rescaleFirst(r1, b1)
  local g = redis.call('HMGET', ctl, 'rate', 'burst', 'seen')
  local r2, b2 = tonumber(g[1]), tonumber(g[2])
  if not (r2 and b2) and g[3] then
    r2, b2 = string.match(g[3], '^(%S+) (%S+)$')
    r2, b2 = tonumber(r2), tonumber(b2)
    local l = tonumber(learnt[1])
    if l and r2 and b2 and l < r2 then
      r2, b2 = l, b2 * l / r2 -- the rate learned, at the Limit's time to fill
    end
  end
  rescale(1, r1, b1, r2, b2)
end

-- tally adds grants to the layers' history: the record's h:<sfx> is
-- "<second> <tokens granted in it> <in the second before> ...", histLen
-- seconds at most, the latest second any Limiter told of first.
local histLen = 64
local function tally()
  local hist = {} -- hist[i]: layer i's, read when first added to
  for group in string.gmatch(grants, '[^,]+') do
    local sec, i = nil, 0
    for v in string.gmatch(group, '%S+') do
      local n = tonumber(v)
      if not sec then
        sec = n
      elseif i < k and n then
        i = i + 1
        local h = hist[i]
        if not h and n ~= 0 then
          h = {}
          for x in string.gmatch(redis.call('HGET', ctl, 'h:' .. sfx(i)) or '', '%S+') do
            h[#h + 1] = tonumber(x) or 0
          end
          if #h == 0 then
            h[1] = sec
          end
          hist[i] = h
        end
        if h and sec and n ~= 0 then
          if sec > h[1] then -- later seconds: the others move back
            local d = math.min(sec - h[1], histLen)
            for j = math.min(#h, histLen + 1 - d), 2, -1 do
              h[j + d] = h[j]
            end
            for j = 2, d + 1 do
              h[j] = 0
            end
            h[1] = sec
          end
          local j = h[1] - sec + 2
          if j <= histLen + 1 then
            for x = #h + 1, j do
              h[x] = 0
            end
            h[j] = h[j] + n
          end
        end
      end
    end
  end
  for i, h in pairs(hist) do
    local last = math.min(#h, histLen + 1)
    while last > 2 and h[last] == 0 do
      last = last - 1
    end
    local out = {string.format('%d', h[1])}
    for j = 2, last do
      out[j] = string.format('%.10g', h[j])
    end
    redis.call('HSET', ctl, 'h:' .. sfx(i), table.concat(out, ' '))
  end
end

local r1, b1 = rates[1], fulls[1] and fulls[1] * rates[1] / 1000000
if op ~= 'read' then
  -- The change is announced before anything is written: a publish the
  -- user may not make fails the call, and nothing has changed. (A pause
  -- or a resume that changes nothing is announced too: the Limiters that
  -- hear it read the record again.)
  redis.call('PUBLISH', channel, KEYS[1])
end
if op == 'read' then
  local user = math.floor(now / 1000) + use
  if ARGV[12] ~= '' and ARGV[12] ~= '0' then
    user = user .. ' ' .. ARGV[12] -- and its lingering slots
  end
  redis.call('HSET', ctl, 'seen', rate .. ' ' .. burst, 'layers', layers, 'meter', ARGV[11], 'u:' .. id, user)
  if grants ~= '' then
    tally()
  end
  if f[6] then
    for i = 1, k do
      rise(i) -- learn.lua's
    end
  end
  -- The users that stopped go in a sweep once the fields outnumber twice
  -- the users the last sweep left, and 32.
  local n = tonumber(redis.call('HGET', ctl, 'users')) or 0
  if redis.call('HLEN', ctl) > 2 * n + 32 then
    sweep()
  end
elseif op == 'limit' then
  redis.call('HSET', ctl, 'rate', rate, 'burst', burst)
  rescaleFirst(r1, b1)
elseif op == 'clear' then
  redis.call('HDEL', ctl, 'rate', 'burst')
  rescaleFirst(r1, b1)
elseif op == 'hold' then
  local e
  if hold ~= 'forever' then
    e = now + tonumber(hold)
  end
  pauseTo(e, 'operator')
elseif op == 'resume' then
  pauseTo(now, 'operator', true)
end
expire()
local g = redis.call('HMGET', ctl, 'rate', 'burst', 'since', 'until', 'seen', 'src', 'ev')
local pushed = ''
if pmax > 0 then
  pushed = (redis.call('HGET', ctl, 'pt') or '0') .. ' ' .. table.concat(pushList(), ' ')
end
return {string.format('%d', now), g[1] or '', g[2] or '', g[3] or '', g[4] or '', g[5] or '',
  g[6] or '', g[7] or '0', timeline(), pushed, learned()}
