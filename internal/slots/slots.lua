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
-- slot is granted; a pool's take (ARGV "pool", pool.lua) runs as the
-- function pooled(KEYS, ARGV, longest) that follows it, which chooses the
-- deployment then. A caller that queues leaves its take with its id,
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

