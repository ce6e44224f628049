-- quota: a bucket's concurrency slots, shared by every process that uses
-- the Redis. A slot is a lease on the server's clock, renewed by its holder
-- while it holds it, so that the slots of a process that dies come back
-- when their leases end. Callers that find every slot held queue, first
-- come, first served within a priority class and the higher classes
-- first, and a release hands the slot to the head of the queue at once
-- and announces it, so that nobody polls.
--
-- A caller asks for its slot and its tokens in one call: the script runs
-- the take's script (internal/store's script.lua, with the parts it is
-- made of and nothing else), which the slots package puts before this
-- source as the function bucket(KEYS, ARGV), to take the tokens when the
-- slot is granted. A caller that queues leaves its take with its id,
-- and the release that hands it the slot takes its tokens then, so that
-- its grant is as fresh as the slot's and costs it no call of its own.
--
-- KEYS[1]   the slots held: a sorted set of ids, each scored with when its
--           lease ends (microseconds), its key the bucket's and ":slots".
-- KEYS[2]   the waiters: a sorted set of ids, scored the same way.
-- KEYS[3]   the queue: a list of the waiters' ids, the highest priority
--           class first and each class in order of arrival; the id of a
--           waiter of class c above 0 followed by "@c" (the class of its
--           take). An id no longer among the waiters
--           (cancelled, or its lease ended) is skipped when it reaches the
--           head.
-- KEYS[4]   the takes: a hash of the waiters' takes by id, each the take's
--           KEYS and ARGV in JSON, and once a slot is handed, the grant
--           its take got, until its holder hears of it.
-- KEYS[5..] acquire and try: the take's KEYS.
-- ARGV[1]   operation: "acquire", "try", "release", "cancel" or "renew".
-- ARGV[2]   n, the slots the bucket has (>= 1).
-- ARGV[3]   the lease, in microseconds.
-- ARGV[4]   the channel that announces hand-offs, or "" for none: each
--           is published as "s <id>[=<grant>] ...", a newline, and the
--           bucket's key.
-- ARGV[5]   now in microseconds, or "" to use the server's clock (TIME).
-- ARGV[6]   r, the number of ids that follow, released before the
--           operation: a process's releases ride on its next call.
-- ARGV[7..6+r]
--           those ids.
-- Then the operation's own, from x = 7 + r:
--   acquire, try  ARGV[x] the id; ARGV[x+1] "1" when the take's longest
--           wait is the caller's deadline, which a hand-off later counts
--           down, "0" otherwise; ARGV[x+2..] the take's ARGV (see
--           script.lua), none for a slot alone.
--   release, cancel  any number of ids.
--   renew   a and b, then ids: the first a the caller holds and uses (its
--           request may be at the provider), the next b it holds and has
--           not used yet, the rest it waits for.
--
-- A grant is the take's reply, its integers joined by commas: "0" for
-- granted without a wait, otherwise its outcome, wait, the layers' tats
-- and positions, and the timeline's count (see script.lua).
--
-- Replies:
--   acquire  {1, 0, grant} when a slot was free and nobody waits: the id
--            holds it, and grant is its take's, "" without one; otherwise
--            {0, hint}: the id waits in the queue, and hint is how long
--            (us) until the first lease held ends, when a dead holder's
--            slot would come back.
--   try      as acquire, or {0, 0}: nothing changed.
--   release  the number of ids that held a slot; their slots go to the
--            queue's head.
--   cancel   the number of ids that held a slot (handed to them while
--            they gave up), which are released; the others left the queue.
--   renew    {hint, state..., grant...}: every id's lease is renewed,
--            whether it holds or waits, and state tells of each id, in
--            order, whether it holds a slot (1), waits (0), is unknown to
--            Redis (-1), was unknown and is held again (2), or was unknown
--            and waits again, at the end of the queue (3), so that a
--            waiter whose announcement was lost learns that it holds one;
--            then, for each waiter that holds one, in order, its grant, ""
--            when it has none. Redis may have lost an id (a restart
--            without persistence, a failover, FLUSHALL, a stall longer
--            than its lease, or a slot the policy granted while Redis was
--            unavailable): a holder in use is held again, over n if need
--            be, since its request is at the provider whoever else holds a
--            slot, and no slot is handed on until the bucket holds fewer
--            than n; a holder not yet in use is reported unknown and not
--            held, so that it queues again; a waiter joins the queue again
--            at its end, as a new arrival would, or takes a free slot.
--
-- Every key expires at most a lease after the last lease it holds ends.

local op = ARGV[1]
local n = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local channel = ARGV[4]
local held, waiting, queue, takes = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now = clock(ARGV[5]) -- the prelude's (internal/redisx)
local x = 7 + tonumber(ARGV[6]) -- where the operation's own ARGV begin

-- A lease that ended holds nothing, whoever held it. The script counts
-- the live leases held and awaited, and keeps the count as it goes: it
-- runs on every request. The leases that ended go (sweep) before the
-- script reads the leases themselves, and on every renewal.
local function sweep()
  redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
  redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now)
end
if op ~= 'acquire' and op ~= 'try' then
  sweep()
end

-- release frees the slot id held, and reports whether it held one.
local function release(id)
  redis.call('HDEL', takes, id)
  return redis.call('ZREM', held, id)
end
for i = 7, x - 1 do
  release(ARGV[i])
end

local live = '(' .. string.format('%d', now)
local holding = redis.call('ZCOUNT', held, live, '+inf')
local queued = redis.call('ZCOUNT', waiting, live, '+inf')
local queues = queued > 0 -- the queue may hold ids
local wrote = false -- to the takes

-- classOf returns the priority class of the take t (nil: 0): its first
-- caller's, ARGV[6], in the forms that name one (see script.lua).
local function classOf(t)
  if t and t.argv and (t.argv[3] == 'class' or t.argv[3] == 'tenant') then
    return tonumber(t.argv[6]) or 0
  end
  return 0
end

-- entry returns the queue's entry for id, a waiter of class c.
local function entry(id, c)
  if c > 0 then
    return id .. '@' .. c
  end
  return id
end

-- enqueue puts id, a waiter of class c, at the end of its class in the
-- queue: ahead of the first waiter of a lower class.
local function enqueue(id, c)
  if c > 0 then
    local entries = redis.call('LRANGE', queue, 0, -1)
    for _, e in ipairs(entries) do
      local ec = tonumber(string.match(e, '@([1-7])$')) or 0
      if ec < c then
        redis.call('LINSERT', queue, 'BEFORE', e, entry(id, c))
        return
      end
    end
  end
  redis.call('RPUSH', queue, entry(id, c))
end

-- queuedClass returns the class id queues at, from the take it left.
local function queuedClass(id)
  local t = redis.call('HGET', takes, id)
  if t and string.sub(t, 1, 1) == '{' then
    return classOf(cjson.decode(t))
  end
  return 0
end

-- take runs the take t (its KEYS and ARGV, and the deadline it counts
-- down to, if any) and returns its grant, "" when the take failed: the
-- holder then takes its tokens itself. The take's ARGV[2] is its clock,
-- ARGV[5] its longest wait (script.lua).
local function take(t)
  local argv = t.argv
  argv[2] = ARGV[5] -- the clock of this call
  if t.deadline then
    argv[5] = string.format('%d', math.max(tonumber(t.deadline) - now, 0))
  end
  local ok, r = pcall(bucket, t.keys, argv)
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
      t.deadline = string.format('%d', now + tonumber(argv[5]))
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
  if count > 0 then
    dispatch()
  end
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
