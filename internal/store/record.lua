-- quota's bucket script, continued (see script.lua): the record operations.
if record then
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
    local tat = r[3]
    if not (r1 and b1 and r2 and b2) or tat <= ref or (r1 == r2 and b1 == b2) then
      return
    end
    local tokens = b1 - (tat - ref) / 1000000 * r1
    local v = ref + (b2 - math.min(tokens, b2)) / r2 * 1000000
    rates[1], fulls[1] = r2, b2 / r2 * 1000000
    write(1, floor(1, v))
    moveTails(1, function(t)
      if t <= ref then
        return t
      end
      local held = b1 - (t - ref) / 1000000 * r1
      return floor(1, ref + (b2 - math.min(held, b2)) / r2 * 1000000)
    end)
    saveClasses()
  end

  local r1, b1 = rates[1], fulls[1] and fulls[1] * rates[1] / 1000000
  if op ~= 'read' and op ~= 'status' then
    -- The change is announced before anything is written: a publish the
    -- user may not make fails the call, and nothing has changed. (A pause
    -- or a resume that changes nothing is announced too: the Limiters
    -- that hear it read the record again.)
    redis.call('PUBLISH', ARGV[5], KEYS[1])
  end
  if op == 'read' then
    redis.call('HSET', ctl, 'seen', ARGV[2], 'layers', ARGV[3], 'u:' .. ARGV[5], math.floor(now / 1000) + use)
    -- The users that stopped go in a sweep once the fields outnumber
    -- twice the users the last sweep left, and 32.
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
    redis.call('HSET', ctl, 'rate', ARGV[2], 'burst', ARGV[3])
    rescale(r1, b1)
  elseif op == 'clear' then
    redis.call('HDEL', ctl, 'rate', 'burst')
    rescale(r1, b1)
  elseif op == 'hold' then
    local e
    if ARGV[2] ~= 'forever' then
      e = now + tonumber(ARGV[2])
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
end
