-- quota: the operations of a bucket's control record. This script is
-- core.lua, classes.lua, timeline.lua and this body, joined in that order
-- after the prelude (internal/store's scripts.go); core.lua describes the
-- bucket and its record.
--
-- read     records the Limit the Limiter's callers pass, the further
--          layers' suffixes and the Limiter among the bucket's users;
-- status   counts the bucket's users, and replies the first layer's tat;
-- limit    sets the operator's override of the first layer's Limit;
-- clear    removes it; each rescales the first layer's queue to the
--          Limit now in force;
-- hold     an operator's pause: grants nothing before now + ARGV[9], or
--          until a resume (see pauseTo);
-- resume   ends the pause in force, whoever set it.
-- Every operation but read and status is announced on ARGV[4] before it
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
--             it; limit: the override's rate.
-- ARGV[7]     read: the first layer's burst, likewise; limit: the
--             override's burst.
-- ARGV[8]     read: the further layers' key suffixes, separated by spaces.
-- ARGV[9]     hold: how long, in microseconds, or "forever".
-- The last 2k ARGV: "" each (the Limits are the record's and the keys',
-- see core.lua).
--
-- Reply: {now, rate, burst, since, until, seen, users, tat, src, ev,
-- anchors, pushes}, strings, "" for what is absent: the override, the
-- pause, the Limit the Limiters last passed, the users (status only), the
-- first layer's tat as it stands before a pause moved it (status only),
-- who set the pause's end, the timeline's count and the layers' anchors
-- "<at> <pos> <scale>" joined with "," (see timeline.lua), and "<pt>" then
-- how far pushes moved each class's queue in each layer, class 0's first,
-- or "" on a bucket no priority class took from.
local channel, id, rate, burst, layers, hold = ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
if op ~= 'read' and op ~= 'status' and op ~= 'limit' and op ~= 'clear' and op ~= 'hold' and op ~= 'resume' then
  return redis.error_reply('quota: unknown operation ' .. tostring(op))
end
local users, tat
local use = 5000 -- ms a Limiter counts as a user after a read
-- sweep removes the users whose use has lapsed and returns how many are
-- left.
local function sweep()
  local ms = math.floor(now / 1000)
  local h = redis.call('HGETALL', ctl)
  if #h == 0 then
    return 0 -- no record, and none made
  end
  local n = 0
  for i = 1, #h, 2 do
    if string.sub(h[i], 1, 2) == 'u:' then
      if tonumber(h[i + 1]) <= ms then
        redis.call('HDEL', ctl, h[i])
      else
        n = n + 1
      end
    end
  end
  redis.call('HSET', ctl, 'users', n)
  return n
end
-- rescale moves the first layer from the Limit in force before a change,
-- r1 and b1, to the one after it, keeping the tokens it holds or owes as
-- of the end of the pause in force, or of now: the pause is not debt.
local function rescale(r1, b1)
  local g = redis.call('HMGET', ctl, 'rate', 'burst', 'seen')
  local r2, b2 = tonumber(g[1]), tonumber(g[2])
  if not (r2 and b2) and g[3] then
    r2, b2 = string.match(g[3], '^(%S+) (%S+)$')
    r2, b2 = tonumber(r2), tonumber(b2)
  end
  local ref = origin()
  if r1 and r2 and r1 ~= r2 then
    stretch(1, ref, r1 / r2)
    saveTimeline()
  end
  local t1 = tats[1]
  if not (r1 and b1 and r2 and b2) or t1 <= ref or (r1 == r2 and b1 == b2) then
    return
  end
  local tokens = b1 - (t1 - ref) / 1000000 * r1
  local v = ref + (b2 - math.min(tokens, b2)) / r2 * 1000000
  rates[1], fulls[1] = r2, b2 / r2 * 1000000
  write(1, floor(1, v))
  if pmax > 0 then
    moveTails(1, function(t)
      if t <= ref then
        return t
      end
      local held = b1 - (t - ref) / 1000000 * r1
      return floor(1, ref + (b2 - math.min(held, b2)) / r2 * 1000000)
    end)
  end
  if classesDirty then
    saveClasses()
  end
end

local r1, b1 = rates[1], fulls[1] and fulls[1] * rates[1] / 1000000
if op ~= 'read' and op ~= 'status' then
  -- The change is announced before anything is written: a publish the
  -- user may not make fails the call, and nothing has changed. (A pause
  -- or a resume that changes nothing is announced too: the Limiters that
  -- hear it read the record again.)
  redis.call('PUBLISH', channel, KEYS[1])
end
if op == 'read' then
  redis.call('HSET', ctl, 'seen', rate .. ' ' .. burst, 'layers', layers, 'u:' .. id, math.floor(now / 1000) + use)
  -- The users that stopped go in a sweep once the fields outnumber twice
  -- the users the last sweep left, and 32.
  local n = tonumber(redis.call('HGET', ctl, 'users')) or 0
  if redis.call('HLEN', ctl) > 2 * n + 32 then
    sweep()
  end
elseif op == 'status' then
  users = tostring(sweep())
  tat = tonumber(redis.call('GET', KEYS[1]))
  if tat and paused then
    tat = tat - shifted -- the queue as it stands before the pause moved it
  end
  tat = tat and string.format('%d', tat)
elseif op == 'limit' then
  redis.call('HSET', ctl, 'rate', rate, 'burst', burst)
  rescale(r1, b1)
elseif op == 'clear' then
  redis.call('HDEL', ctl, 'rate', 'burst')
  rescale(r1, b1)
elseif op == 'hold' then
  local e
  if hold ~= 'forever' then
    e = now + tonumber(hold)
  end
  pauseTo(e, 'operator')
elseif op == 'resume' then
  pauseTo(now, 'operator', true)
end
if op ~= 'status' then
  expire()
end
local g = redis.call('HMGET', ctl, 'rate', 'burst', 'since', 'until', 'seen', 'src', 'ev')
local pushed = ''
if pmax > 0 then
  pushed = (redis.call('HGET', ctl, 'pt') or '0') .. ' ' .. table.concat(pushList(), ' ')
end
return {string.format('%d', now), g[1] or '', g[2] or '', g[3] or '', g[4] or '', g[5] or '', users or '', tat or '',
  g[6] or '', g[7] or '0', timeline(), pushed}
