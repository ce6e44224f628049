-- quota: a bucket's concurrency slots, shared by every process that uses
-- the Redis. A slot is a lease on the server's clock, renewed by its holder
-- while it holds it, so that the slots of a process that dies come back
-- when their leases end. Callers that find every slot held queue, first
-- come, first served, and a release hands the slot to the head of the
-- queue at once and announces it, so that nobody polls.
--
-- KEYS[1]   the slots held: a sorted set of ids, each scored with when its
--           lease ends (microseconds), its key the bucket's and ":slots".
-- KEYS[2]   the waiters: a sorted set of ids, scored the same way.
-- KEYS[3]   the queue: a list of the waiters' ids in order of arrival. An
--           id no longer among the waiters (cancelled, or its lease ended)
--           is skipped when it reaches the head.
-- ARGV[1]   operation: "acquire", "try", "release", "cancel" or "renew".
-- ARGV[2]   n, the slots the bucket has (>= 1).
-- ARGV[3]   the lease, in microseconds.
-- ARGV[4]   the channel that announces hand-offs, or "" for none: each
--           is published as "s <bucket's key> <id>...".
-- ARGV[5]   now in microseconds, or "" to use the server's clock (TIME).
-- ARGV[6..] ids: acquire and try take one; release and cancel any number.
--           renew takes a and b, then ids: the first a the caller holds
--           and uses (its request may be at the provider), the next b it
--           holds and has not used yet, the rest it waits for.
--
-- Replies:
--   acquire  {1, 0} when a slot was free and nobody waits: the id holds it;
--            otherwise {0, hint}: the id waits in the queue, and hint is
--            how long (us) until the first lease held ends, when a dead
--            holder's slot would come back.
--   try      {1, 0} as acquire, or {0, 0}: nothing changed.
--   release  the number of ids that held a slot; their slots go to the
--            queue's head.
--   cancel   the number of ids that held a slot (handed to them while
--            they gave up), which are released; the others left the queue.
--   renew    {hint, state...}: every id's lease is renewed, whether it
--            holds or waits, and state tells of each id, in order, whether
--            it holds a slot (1), waits (0), is unknown to Redis (-1),
--            was unknown and is held again (2), or was unknown and waits
--            again, at the end of the queue (3), so that a waiter whose
--            announcement was lost learns that it holds one. Redis may have
--            lost an id (a restart without persistence, a failover,
--            FLUSHALL, a stall longer than its lease, or a slot the policy
--            granted while Redis was unavailable): a holder in use is held
--            again, over n if need be, since its request is at the
--            provider whoever else holds a slot, and no slot is handed on
--            until the bucket holds fewer than n; a holder not yet in use
--            is reported unknown and not held, so that it queues again; a
--            waiter joins the queue again at its end, as a new arrival
--            would, or takes a free slot.
--
-- Every key expires when the last lease it holds ends.

local op = ARGV[1]
local n = tonumber(ARGV[2])
local lease = tonumber(ARGV[3])
local channel = ARGV[4]
local held, waiting, queue = KEYS[1], KEYS[2], KEYS[3]
local now = clock(ARGV[5]) -- the prelude's (internal/redisx)

-- Leases that ended are gone, whoever held them.
redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
redis.call('ZREMRANGEBYSCORE', waiting, '-inf', now)

-- dispatch hands the free slots to the live waiters at the head of the
-- queue, keeping each waiter's lease, and announces them in one message.
local function dispatch()
  local free = n - redis.call('ZCARD', held)
  local handed = {}
  while free > 0 do
    local id = redis.call('LPOP', queue)
    if not id then
      break
    end
    local ends = redis.call('ZSCORE', waiting, id)
    if ends then
      redis.call('ZREM', waiting, id)
      redis.call('ZADD', held, ends, id)
      handed[#handed + 1] = id
      free = free - 1
    end
  end
  if #handed > 0 and channel ~= '' then
    local key = string.sub(held, 1, #held - #':slots')
    redis.call('PUBLISH', channel, 's ' .. key .. ' ' .. table.concat(handed, ' '))
  end
end

-- hint is how long until the first lease held ends.
local function hint()
  local first = redis.call('ZRANGE', held, 0, 0, 'WITHSCORES')
  if first[2] then
    return math.max(tonumber(first[2]) - now, 0)
  end
  return lease
end

-- keep makes key expire when its last lease ends.
local function keep(key, scored)
  local last = redis.call('ZRANGE', scored, -1, -1, 'WITHSCORES')
  if last[2] then
    redis.call('PEXPIRE', key, math.ceil((tonumber(last[2]) - now) / 1000) + 1)
  else
    redis.call('DEL', key)
  end
end

local reply
if op == 'acquire' or op == 'try' then
  local id = ARGV[6]
  dispatch()
  -- After dispatch, a free slot means that nobody waits for it.
  if redis.call('ZCARD', held) < n then
    redis.call('ZADD', held, now + lease, id)
    reply = {1, 0}
  elseif op == 'try' then
    reply = {0, 0}
  else
    redis.call('ZADD', waiting, now + lease, id)
    redis.call('RPUSH', queue, id)
    reply = {0, hint()}
  end
elseif op == 'release' then
  local count = 0
  for i = 6, #ARGV do
    count = count + redis.call('ZREM', held, ARGV[i])
  end
  dispatch()
  reply = count
elseif op == 'cancel' then
  local count = 0
  for i = 6, #ARGV do
    local id = ARGV[i]
    if redis.call('ZREM', waiting, id) == 1 then
      redis.call('LREM', queue, 1, id)
    elseif redis.call('ZREM', held, id) == 1 then
      count = count + 1
    end
  end
  if count > 0 then
    dispatch()
  end
  reply = count
elseif op == 'renew' then
  local a, b = tonumber(ARGV[6]), tonumber(ARGV[7])
  local states = {}
  for i = 8, #ARGV do
    local id, k = ARGV[i], i - 7
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
        redis.call('LREM', queue, 0, id)
        redis.call('RPUSH', queue, id)
        states[k] = 3
      end
      redis.call('ZADD', waiting, now + lease, id)
    end
  end
  dispatch()
  reply = {hint()}
  for i = 8, #ARGV do
    local state = states[i - 7]
    if not state or state == 3 then
      local again = state == 3
      state = -1
      if redis.call('ZSCORE', held, ARGV[i]) then
        state = 1
      elseif again then
        state = 3
      elseif redis.call('ZSCORE', waiting, ARGV[i]) then
        state = 0
      end
    end
    reply[#reply + 1] = state
  end
else
  return redis.error_reply('quota: unknown slot operation ' .. tostring(op))
end

keep(held, held)
keep(waiting, waiting)
keep(queue, waiting)
return reply
