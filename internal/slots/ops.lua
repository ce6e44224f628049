local reply
if op == 'acquire' or op == 'try' then
  local id = ARGV[x]
  dispatch()
  local t
  if #ARGV > x + 1 then
    local keys, argv = {}, {}
    for i = 5, #KEYS do
      keys[#keys + 1] = KEYS[i]
    end
    for i = x + 2, #ARGV do
      argv[#argv + 1] = ARGV[i]
    end
    t = {keys = keys, argv = argv}
    if ARGV[x + 1] == '1' then
      -- A string: JSON would keep 14 digits of a number.
      t.deadline = string.format('%d', now + tonumber(argv[own(argv) + 5]))
    end
  end
  -- After dispatch, a free slot means that nobody waits for it.
  if holding < n then
    holding = holding + redis.call('ZADD', held, now + lease, id)
    reply = {1, 0, t and take(t) or ''}
  elseif op == 'try' then
    reply = {0, 0}
  else
    queued = queued + redis.call('ZADD', waiting, now + lease, id)
    enqueue(id, classOf(t))
    queues = true
    if t then
      redis.call('HSET', takes, id, cjson.encode(t))
      wrote = true
    end
    reply = {0, hint()}
  end
elseif op == 'release' then
  local count = 0
  for i = x, #ARGV do
    count = count + release(ARGV[i])
  end
  holding = holding - count
  dispatch()
  reply = count
elseif op == 'cancel' then
  local count = 0
  for i = x, #ARGV do
    local id = ARGV[i]
    if redis.call('ZREM', waiting, id) == 1 then
      queued = queued - 1
      redis.call('LREM', queue, 1, entry(id, queuedClass(id)))
      redis.call('HDEL', takes, id)
    elseif release(id) == 1 then
      count = count + 1
    end
  end
  holding = holding - count
  dispatch() -- the slots it released, and those released riding on it
  reply = count
elseif op == 'renew' then
  local a, b = tonumber(ARGV[x]), tonumber(ARGV[x + 1])
  local first = x + 2 -- the first id
  local states = {}
  for i = first, #ARGV do
    local id, k = ARGV[i], i - first + 1
    if redis.call('ZSCORE', held, id) then
      redis.call('ZADD', held, now + lease, id)
      states[k] = 1
    elseif k <= a then
      -- In use: whoever else holds a slot, this one is held too.
      redis.call('ZADD', held, now + lease, id)
      states[k] = 2
    elseif k <= a + b then
      states[k] = -1
    else
      if not redis.call('ZSCORE', waiting, id) then
        -- A waiter Redis lost queues again at the end, where a stale
        -- place of its own (its lease ended) would not put it ahead.
        local c = queuedClass(id)
        redis.call('LREM', queue, 0, entry(id, c))
        enqueue(id, c)
        states[k] = 3
      end
      redis.call('ZADD', waiting, now + lease, id)
    end
  end
  holding, queued = redis.call('ZCARD', held), redis.call('ZCARD', waiting)
  queues = true
  dispatch()
  reply = {hint()}
  local grants = {}
  for i = first, #ARGV do
    local id, k = ARGV[i], i - first + 1
    local state = states[k]
    if not state or state == 3 then
      local again = state == 3
      state = -1
      if redis.call('ZSCORE', held, id) then
        state = 1
      elseif again then
        state = 3
      elseif redis.call('ZSCORE', waiting, id) then
        state = 0
      end
    end
    if k > a + b and state == 1 then
      -- A waiter handed its slot, whose announcement may be lost: the
      -- grant its take got.
      local g = redis.call('HGET', takes, id)
      if g and string.sub(g, 1, 1) == '=' then
        grants[#grants + 1] = string.sub(g, 2)
      else
        grants[#grants + 1] = ''
      end
      redis.call('HDEL', takes, id)
    elseif k <= a + b then
      redis.call('HDEL', takes, id) -- its holder has heard of its grant
    end
    reply[#reply + 1] = state
  end
  for _, g in ipairs(grants) do
    reply[#reply + 1] = g
  end
else
  return redis.error_reply('quota: unknown slot operation ' .. tostring(op))
end

-- Every lease ends within a lease from now: so does every key, unless a
-- call renews it. An empty sorted set is no key at all.
local ttl = math.ceil(lease / 1000) + 1
if holding > 0 then
  redis.call('PEXPIRE', held, ttl)
end
if queued > 0 then
  redis.call('PEXPIRE', waiting, ttl)
  redis.call('PEXPIRE', queue, ttl)
elseif queues then
  redis.call('DEL', queue)
end
if wrote then
  redis.call('PEXPIRE', takes, ttl)
  -- The takes of ids whose leases ended (a holder that died before its
  -- release) go once they outnumber what may be live.
  if redis.call('HLEN', takes) > 2 * (n + queued) + 16 then
    local fields = redis.call('HKEYS', takes)
    for _, id in ipairs(fields) do
      if not redis.call('ZSCORE', held, id) and not redis.call('ZSCORE', waiting, id) then
        redis.call('HDEL', takes, id)
      end
    end
  end
end
return reply
