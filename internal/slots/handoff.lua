-- take runs the take t (its KEYS and ARGV, and the deadline it counts
-- down to, if any), a bucket's or a pool's, and returns its grant, ""
-- when the take failed: the holder then takes its tokens itself. The
-- take's ARGV[2] is its clock, ARGV[5] a bucket's longest wait
-- (script.lua); a pool's is given to pooled (pool.lua).
local function take(t)
  local argv, longest = t.argv, nil
  argv[2] = ARGV[5] -- the clock of this call
  if t.deadline then
    longest = string.format('%d', math.max(tonumber(t.deadline) - now, 0))
  end
  local ok, r
  if argv[1] == 'pool' then
    ok, r = pcall(pooled, t.keys, argv, longest)
  else
    argv[5] = longest or argv[5]
    ok, r = pcall(bucket, t.keys, argv)
  end
  if not ok or type(r) == 'table' and r.err then
    return ''
  end
  if type(r) ~= 'table' then
    return tostring(r)
  end
  local parts = {}
  for i = 1, #r do
    parts[i] = string.format('%d', r[i])
  end
  return table.concat(parts, ',')
end

-- dispatch hands the free slots to the live waiters at the head of the
-- queue, keeping each waiter's lease, takes the tokens each one left, and
-- announces them in one message. A waiter's grant stays in the takes
-- until its holder hears of it, should the message be lost.
local function dispatch()
  local free = n - holding
  local handed = {}
  while free > 0 and queues do
    local id = redis.call('LPOP', queue)
    if not id then
      break
    end
    id = string.gsub(id, '@[1-7]$', '')
    local ends = tonumber(redis.call('ZSCORE', waiting, id))
    local t = redis.call('HGET', takes, id)
    if ends and ends > now then
      redis.call('ZREM', waiting, id)
      redis.call('ZADD', held, ends, id)
      queued, holding = queued - 1, holding + 1
      local handoff = id
      if t and string.sub(t, 1, 1) == '{' then
        local grant = take(cjson.decode(t))
        redis.call('HSET', takes, id, '=' .. grant)
        wrote = true
        handoff = id .. '=' .. grant
      end
      handed[#handed + 1] = handoff
      free = free - 1
    else
      if ends then
        redis.call('ZREM', waiting, id) -- its lease ended
      end
      if t then
        redis.call('HDEL', takes, id)
      end
    end
  end
  if #handed > 0 and channel ~= '' then
    local key = string.sub(held, 1, #held - #':slots')
    -- pcall: the hand-offs, known only once written, are lost rather
    -- than the call failed when the user may not publish; a renewal
    -- finds them within a quarter lease.
    redis.pcall('PUBLISH', channel, 's ' .. table.concat(handed, ' ') .. '\n' .. key)
  end
end

-- hint is how long until the first lease held ends.
local function hint()
  sweep()
  local first = redis.call('ZRANGE', held, 0, 0, 'WITHSCORES')
  if first[2] then
    return math.max(tonumber(first[2]) - now, 0)
  end
  return lease
end


