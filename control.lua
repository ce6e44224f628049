-- quota: what operators set on a bucket at runtime, and what Limiters
-- read of it: an override of the first layer's Limit, and a pause.
--
-- KEYS[1]  the bucket's control record, a hash:
--            rate, burst   the override, absent when there is none;
--            since, until  the latest pause: when it began and when it
--                          ends ("forever" until a resume), microseconds on
--                          the server's clock; a pause whose until has
--                          passed is over;
--            shifted       how far the pause has moved the layers' queues
--                          so far, microseconds; absent when it moves none;
--            seen          the first layer's Limit the Limiters last
--                          passed, "<rate> <burst>";
--            changed       when the Limit in force last changed, µs;
--            layers        the keys of the bucket's further layers, after
--                          the first's, space-separated suffixes;
--            u:<id>        a Limiter that used the bucket lately, until
--                          when it counts as a user (ms);
--            users         how many u: fields the last sweep left.
-- KEYS[2]  the first layer's key; KEYS[3] ... the further layers' keys
--          (read, pause and resume: the record lives as long as their
--          queues, and their queues move with a pause).
-- ARGV[1]  operation: "read", "limit", "clear", "pause", "resume" or
--          "status".
-- ARGV[2]  read: "<rate> <burst>" the Limiter passes; limit: the rate;
--          pause: how long in microseconds, or "forever".
-- ARGV[3]  read: the further layers' suffixes; limit: the burst.
-- ARGV[4]  read: the Limiter's id; limit, clear, pause, resume: the
--          channel that announces a change, on which the bucket's first
--          key is published.
--
-- Reply: {now, rate, burst, since, until, seen, users, tat, changed},
-- strings, "" for what is absent; now in microseconds on the server's
-- clock, users the Limiters that used the bucket lately and tat the first
-- layer's (status only).
--
-- A change of the Limit in force (limit, clear) keeps what the first
-- layer holds, or owes, in tokens: a queue at the old rate becomes the
-- same queue at the new one, a grant due t after the change falls due
-- t x old rate / new rate after it, as each Limiter moves its callers
-- sleeping on such grants.
--
-- A pause moves the queues it finds behind it: a grant due t after the
-- pause began falls due t after it ends, as each Limiter moves its callers
-- sleeping on such grants. A pause of known length moves the queues when
-- it is made, by its length; one forever moves them far ahead, and back
-- when it ends, to as long as it lasted; a resume or a longer pause
-- corrects the move made.
-- A layer without a queue (its key absent or its tat passed) is not moved.
--
-- A record that holds an override or a pause with no end stays until
-- they are removed. Any other expires keep milliseconds after it was last
-- read or written, or when its pause ends or its bucket's keys expire
-- (when their queues have passed), whichever is last: a flood of names
-- leaves no record behind it for long.

if redis.replicate_commands then
  redis.replicate_commands() -- lets TIME precede writes on Redis < 5
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ctl = KEYS[1]
local op = ARGV[1]
local keep = 10000 -- ms

local use = 5000 -- ms a Limiter counts as a user after a read

-- sweep removes the users whose use has lapsed, and returns how many are
-- left.
local function sweep()
  local ms = math.floor(now / 1000)
  local f = redis.call('HGETALL', ctl)
  if #f == 0 then
    return 0 -- no record, and none made
  end
  local n = 0
  for i = 1, #f, 2 do
    if string.sub(f[i], 1, 2) == 'u:' then
      if tonumber(f[i + 1]) <= ms then
        redis.call('HDEL', ctl, f[i])
      else
        n = n + 1
      end
    end
  end
  redis.call('HSET', ctl, 'users', n)
  return n
end

local function reply(users, tat)
  local f = redis.call('HMGET', ctl, 'rate', 'burst', 'since', 'until', 'seen', 'changed')
  return {string.format('%d', now), f[1] or '', f[2] or '', f[3] or '', f[4] or '', f[5] or '', users or '', tat or '', f[6] or ''}
end

-- expire keeps the record while it holds an override or a pause with no
-- end, and otherwise for as long as its pause or its bucket's keys, and
-- keep at least.
local function expire()
  local g = redis.call('HMGET', ctl, 'rate', 'until')
  if g[1] or g[2] == 'forever' then
    redis.call('PERSIST', ctl)
    return
  end
  local ttl = keep
  if g[2] then
    ttl = math.max(ttl, math.ceil((tonumber(g[2]) - now) / 1000))
  end
  for i = 2, #KEYS do
    ttl = math.max(ttl, redis.call('PTTL', KEYS[i]))
  end
  redis.call('PEXPIRE', ctl, ttl)
end

if op == 'read' then
  redis.call('HSET', ctl, 'seen', ARGV[2], 'layers', ARGV[3], 'u:' .. ARGV[4], math.floor(now / 1000) + use)
  -- The users that stopped go in a sweep once the fields outnumber
  -- twice the users the last sweep left, and 32: now and then, however
  -- many Limiters come and go while an override keeps the record.
  local n = tonumber(redis.call('HGET', ctl, 'users')) or 0
  if redis.call('HLEN', ctl) > 2 * n + 32 then
    sweep()
  end
  expire()
  return reply()
end

if op == 'status' then
  -- The first layer's queue as it stands before a pause moved it.
  local tat = tonumber(redis.call('GET', KEYS[2]))
  local g = redis.call('HMGET', ctl, 'since', 'until', 'shifted')
  local shifted = tonumber(g[3])
  if tat and shifted and g[1] and (g[2] == 'forever' or (tonumber(g[2]) or 0) > now) then
    tat = tat - shifted
  end
  return reply(tostring(sweep()), tat and string.format('%d', tat))
end

-- move shifts every layer with a queue by d microseconds, never below now.
local function move(d)
  if d == 0 then
    return
  end
  for i = 2, #KEYS do
    local tat = tonumber(redis.call('GET', KEYS[i]))
    if tat and tat > now then
      local v = math.max(tat + d, now)
      if v <= now then
        redis.call('DEL', KEYS[i])
      else
        redis.call('SET', KEYS[i], v, 'PX', math.ceil((v - now) / 1000))
      end
    end
  end
end

-- A pause with no end moves the queues it finds this far ahead (ten
-- years, in microseconds) until a resume moves them back by what is left
-- of that once the pause's length is known: a take that reaches the
-- script after the pause began finds a wait no deadline allows, and takes
-- nothing, rather than one that falls due during the pause; and a queue
-- so far ahead lasts as long as its key.
local far = 10 * 365 * 86400 * 1000000

local f = redis.call('HMGET', ctl, 'since', 'until', 'shifted')
local since, untilv, shifted = tonumber(f[1]), f[2], tonumber(f[3])
local forever = untilv == 'forever'
local paused = since ~= nil and (forever or (tonumber(untilv) or 0) > now)

-- inForce returns the rate and burst in force: the override, else what
-- the Limiters pass; nil when neither is known.
local function inForce()
  local g = redis.call('HMGET', ctl, 'rate', 'burst', 'seen')
  if g[1] and g[2] then
    return tonumber(g[1]), tonumber(g[2])
  end
  if g[3] then
    local r, b = string.match(g[3], '^(%S+) (%S+)$')
    return tonumber(r), tonumber(b)
  end
end

-- rescale moves the first layer from the Limit in force before a change
-- to the one after it, keeping the tokens it holds or owes.
local function rescale(r1, b1)
  local r2, b2 = inForce()
  local tat = tonumber(redis.call('GET', KEYS[2]))
  redis.call('HSET', ctl, 'changed', string.format('%d', now))
  if not (r1 and r2 and tat) or tat <= now or (r1 == r2 and b1 == b2) then
    return
  end
  local tokens = b1 - (tat - now) / 1000000 * r1
  local v = now + (b2 - math.min(tokens, b2)) / r2 * 1000000
  if v <= now then
    redis.call('DEL', KEYS[2])
  else
    redis.call('SET', KEYS[2], v, 'PX', math.ceil((v - now) / 1000))
  end
end

if op == 'limit' then
  local r1, b1 = inForce()
  redis.call('HSET', ctl, 'rate', ARGV[2], 'burst', ARGV[3])
  rescale(r1, b1)
elseif op == 'clear' then
  local r1, b1 = inForce()
  redis.call('HDEL', ctl, 'rate', 'burst')
  rescale(r1, b1)
elseif op == 'pause' then
  if not paused then
    -- A new pause: it moves the queues now behind it.
    since, shifted = now, nil
    local queued = false
    for i = 2, #KEYS do
      local tat = tonumber(redis.call('GET', KEYS[i]))
      queued = queued or (tat ~= nil and tat > now)
    end
    if queued then
      shifted = 0
    end
    redis.call('HDEL', ctl, 'shifted')
  elseif forever then
    return reply() -- nothing ends later than forever
  end
  if ARGV[2] == 'forever' then
    untilv = 'forever'
    if shifted then
      move(far - shifted)
      shifted = far
    end
  else
    local e = now + tonumber(ARGV[2])
    if paused and e <= tonumber(untilv) then
      return reply() -- the pause in force ends later
    end
    untilv = string.format('%d', e)
    if shifted then
      move(e - since - shifted)
      shifted = e - since
    end
  end
  redis.call('HSET', ctl, 'since', string.format('%d', since), 'until', untilv)
  if shifted then
    redis.call('HSET', ctl, 'shifted', string.format('%d', shifted))
  end
elseif op == 'resume' then
  if not paused then
    return reply()
  end
  if shifted then
    move(now - since - shifted)
    redis.call('HSET', ctl, 'shifted', string.format('%d', now - since))
  end
  redis.call('HSET', ctl, 'until', string.format('%d', now))
else
  return redis.error_reply('quota: unknown control operation ' .. tostring(op))
end

expire()
redis.call('PUBLISH', ARGV[4], KEYS[2])
return reply()
