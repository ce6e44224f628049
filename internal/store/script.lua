-- quota: one bucket in Redis, its token layers and its control record,
-- read and changed in one call. The script is this file and, joined after
-- it in this order (internal/store's sourceParts), classes.lua,
-- timeline.lua, record.lua, tenants.lua, take.lua and layers.lua.
--
-- A layer is kept as a single number, its theoretical arrival time (tat):
-- the instant, in microseconds, at which the layer would be full again. At
-- time now it holds burst - (tat - now) * rate tokens, so tokens can run into
-- debt: a take always succeeds when its wait is acceptable, moves tat forward
-- and tells the caller how long to sleep until its tokens have accrued. Later
-- callers queue behind it, first come, first served, with one call each.
--
-- A bucket may obey several limits at once (10 a second and 300 a minute):
-- one key per layer, all in the bucket's hash slot, checked and taken
-- together, all or nothing.
--
-- A bucket may also meter several things at once, one layer each: a
-- request then takes its own amount from each, all or nothing, with the
-- wait of the slowest.
--
-- The control record, a hash beside the layers, holds what changes how the
-- bucket is taken, whoever set it:
--   rate, burst   the operator's override of the first layer's Limit;
--                 every operation computes with it in place of the Limit
--                 its caller passes;
--   since, until  the bucket's pause, one for every source: when it began
--                 and when it ends, microseconds, "forever" until a
--                 resume; a pause whose until has passed is over;
--   shifted       how far the pause has moved the layers' queues so far;
--   src           who set the pause's end: "provider" or "operator";
--   resume        after an outage, the instant (us) the fleet leaves its
--                 local shares: no take is granted before it;
--   a:<sfx>, ev   the timeline of the layer whose key ends in sfx (""
--                 for the first), and how many times a timeline moved
--                 (see timeline);
--   pmax          the highest priority class that took from the bucket;
--   t<c>:<sfx>    class c's tail in the layer whose key ends in sfx (""
--                 for the first): the tat of the queue of the classes c
--                 and above, for c = 1 ... pmax (class 0's is the layer's
--                 own tat, which counts every class);
--   p<c>:<sfx>    how far takes of higher classes have pushed class c's
--                 grants in that layer back so far, in positions (see
--                 timeline), c = 0 ... pmax-1;
--   pt            when the latest push was, µs (see commit);
--   q<c>:<sfx>    the push clock of class c in that layer, µs, for a class
--                 given a minimum share (see shares);
--   fv, f:<tenant>
--                 the virtual time of the bucket's tenants, and each
--                 tenant's "<finish> <weight> <waiting until> <asked last>" (see
--                 tenants);
--   seen          the first layer's Limit the Limiters last passed,
--                 "<rate> <burst>"; layers, the further layers' key
--                 suffixes; u:<id>, a Limiter that used the bucket lately,
--                 until when (ms); users, how many u: fields the last
--                 sweep left.
--
-- KEYS[1..k]  the layers' keys, the first layer's being the bucket's key.
-- KEYS[k+1]   the control record.
-- KEYS[k+2]   adjust only: the ids of the settles applied lately, a sorted
--             set scored by when each may be forgotten (ms).
-- ARGV[1]     operation. On the layers: "take", "refund", "probe",
--             "pause", "lower", "adjust", "resuming"; on the record:
--             "read", "status",
--             "limit", "clear", "hold" (an operator's pause) and "resume".
-- ARGV[4]     now in microseconds, or "" to use the server's clock (TIME).
--
-- The layer operations:
-- ARGV[2]     take, refund: n, the tokens to take or hand back (> 0);
--             or, for a bucket whose layers meter different things
--             (requests, input tokens, output tokens), one amount per
--             layer separated by spaces, each >= 0 (see amounts); either
--             followed by "@" and the take's priority class, 1 to 7,
--             when it is above 0 (see classes), and then, when classes
--             below it have minimum shares, ":" and the share of each
--             class from 0 up, "0" for none (see shares); then, for
--             a take or an adjust for a tenant, "|", the tenant's weight
--             (> 0), "|", the most tenants the bucket keeps apart (0:
--             this one always), "|", for an adjust the µs its tenant is
--             charged more (below 0: given back) or nothing, "|" and the
--             tenant's name (see tenants);
--             pause: how long, in microseconds, nothing may be granted;
--             resuming: the instant, in microseconds, the fleet leaves
--             its local shares after an outage;
--             lower: the tokens the provider says remain (>= 0), or one
--             number per layer, below zero for a layer it says nothing of;
--             adjust: tokens to take (> 0) or give back (< 0) at once,
--             one number or one per layer.
-- ARGV[3]     take: the longest wait the caller accepts, in microseconds;
--             pause: the channel that announces it, or "" for none;
--             adjust: the settle's id, "" for none.
-- ARGV[3i+2]  layer i's rate, tokens per second (> 0).
-- ARGV[3i+3]  layer i's burst, the tokens it holds (>= n).
-- ARGV[3i+4]  refund: the tat of layer i that the take being cancelled
--             returned; otherwise 0.
-- ARGV[3k+2c+1], ARGV[3k+2c+2]
--             take for several callers at once (a batch): caller c's n and
--             longest wait, for c = 2 ... m; caller 1's are ARGV[2] and
--             ARGV[3]. A take whose ARGV are one more ends with the
--             channel that announces its pushes (see classes).
--
-- The record operations:
-- ARGV[2]     read: "<rate> <burst>" the Limiter passes; limit: the rate;
--             hold: how long in microseconds, or "forever".
-- ARGV[3]     read: the further layers' suffixes; limit: the burst.
-- ARGV[5]     read: the Limiter's id; limit, clear, hold, resume: the
--             channel that announces a change.
--
-- Replies.
--   take:   {outcome, wait, tat_1, ..., tat_k, pos_1, ..., pos_k},
--           integers. outcome is one of:
--           1 granted: the tokens were taken from every layer; wait (us,
--             rounded to the nearest) is how long until they have
--             accrued in all of them, and pos_i the grant's position in
--             layer i (see timeline; 0 without a wait);
--           2 too long: the wait would exceed ARGV[3]; nothing is taken,
--             and wait is how long it would have been;
--           3 paused: the bucket is paused until a resume, whatever
--             ARGV[3]; nothing is taken, and wait is 0;
--           4 resuming: the fleet has yet to leave its local shares
--             after an outage, whatever ARGV[3]; nothing is taken, and
--             wait is 0;
--           5 crowded: the take would push a class below its own past
--             that class's minimum share; nothing is taken, and wait is
--             how long until the share has room (see shares);
--           6 held: a take for a tenant that is not admitted; nothing is
--             taken, and wait is how long until it may be, at most
--             fairNap (see tenants).
--           The tats (us, rounded down) identify the take for a later
--           refund. A take granted without a wait replies the integer 0
--           alone instead: the cheapest reply there is, for the
--           commonest case.
--           A batch serves its callers in order, each from the bucket as
--           the one before it left it, and each granted or refused on its
--           own. It replies the callers' replies one after another, m x
--           (2 + 2k) integers; or the integer 0 alone when every caller was
--           granted without a wait. A reply other than 0 ends with the
--           timeline's count (ev) the takes found, and now; then, on a
--           bucket that
--           priority classes took from, pmax x k more, how far pushes had
--           moved each class's queue in each layer when the call ended,
--           in positions, class 0's first.
--   other layer operations: {1, 0, tats} after the operation;
--   record operations: {now, rate, burst, since, until, seen, users, tat,
--           src, ev, anchors, pushes}, strings, "" for what is absent;
--           anchors the layers' "<at> <pos> <scale>" joined with ","
--           (see timeline); pushes "<pt>" then how far pushes moved each
--           class's queue in each layer, class 0's first, or "" on a
--           bucket no priority class took from; users and tat (the first
--           layer's, as it stands before a pause moved it) for status
--           only.
--
-- refund  hands back what no later take is queued behind;
-- probe   rewrites each layer as it is, to learn whether the server accepts
--         writes;
-- pause, hold
--         grant nothing before now + ARGV[2] (see pauseTo);
-- lower   leaves each layer at most ARGV[2] tokens, never raising it;
-- resuming
--         records in the record's "resume" field the instant the fleet
--         leaves its local shares, the latest it was told;
-- adjust  takes (or gives back) tokens now, without waiting, once per id.
--
-- A layer key expires when its layer is full again: an absent key and a
-- full layer are the same state, so idle buckets cost no memory. The
-- record expires with its pause and its layers (see expire).

local op = ARGV[1]
local now = clock(ARGV[4]) -- the prelude's (internal/redisx)
local k = #KEYS - 1

-- amounts reads an amount of one per layer, v, as written for a bucket
-- whose layers meter different things: k numbers separated by spaces,
-- none below zero unless signed is set. (An amount for every layer is a
-- plain number, which the callers read with tonumber first: the
-- commonest case allocates nothing.)
local function amounts(v, signed)
  local t, i = {}, 0
  for w in string.gmatch(v, '%S+') do
    i = i + 1
    t[i] = tonumber(w)
    if not t[i] or t[i] < 0 and not signed then
      return nil
    end
  end
  if i ~= k then
    return nil
  end
  return t
end
if op == 'adjust' then
  k = k - 1
end
local ctl = KEYS[k + 1]
local record = op == 'read' or op == 'status' or op == 'limit' or op == 'clear' or op == 'hold' or op == 'resume'

local moved = false

-- The pause and the override, as every operation needs them.
local f = redis.call('HMGET', ctl, 'since', 'until', 'shifted', 'rate', 'burst', 'seen', 'resume', 'pmax')
local since, untilv, shifted = tonumber(f[1]), f[2], tonumber(f[3]) or 0
-- After an outage, the instant the fleet leaves its local shares
-- (resuming): until then no take is granted, whether or not its Limiter
-- saw the outage.
local resuming = tonumber(f[7])
resuming = resuming ~= nil and resuming > now
local forever = untilv == 'forever'
local ends = tonumber(untilv) -- nil while forever
local paused = since ~= nil and (forever or ends > now)
-- origin is the instant the layers are reckoned from: now, or while a
-- pause is in force the point its shifts have moved the queues to (its
-- end, or while it has none the end it had, or its start), before which
-- nothing falls due.
local function origin()
  if paused then
    return since + shifted
  end
  return now
end

-- The layers: tats, rates and bursts. r is the reply's {granted, wait,
-- tat_1, ..., tat_k}. The first layer computes with the override when
-- there is one (unless KEYS[1] is a further layer's, updated alone after
-- an outage); a record operation, which is passed no Limits, reads the
-- first layer's from the record and the others' from their keys, which
-- name them, and leaves a layer whose Limit it cannot know as it is.
local r = {1, 0}
local rates, fulls = {}, {}
for i = 1, k do
  local state = redis.call('GET', KEYS[i])
  local tat = tonumber(state)
  if not tat then
    if state then
      return redis.error_reply('quota: ' .. KEYS[i] .. ' holds something other than a bucket')
    end
    tat = now
  end
  r[i + 2] = tat
  local rate, burst
  if i == 1 and f[4] and f[5] and ctl == KEYS[1] .. ':ctl' then
    rate, burst = tonumber(f[4]), tonumber(f[5])
  elseif not record then
    rate, burst = tonumber(ARGV[3 * i + 2]), tonumber(ARGV[3 * i + 3])
  elseif i == 1 and f[6] then
    rate, burst = string.match(f[6], '^(%S+) (%S+)$')
    rate, burst = tonumber(rate), tonumber(burst)
  elseif i > 1 then
    rate, burst = string.match(KEYS[i], ':([^:/]+)/([^:/]+)$')
    rate, burst = tonumber(rate), tonumber(burst)
  end
  if rate and burst and rate > 0 then
    rates[i], fulls[i] = rate, burst / rate * 1000000
  end
end

-- write sets layer i's tat to v, or deletes its key when v has passed.
-- While a pause with no end is in force, a layer that owes anything
-- beyond the pause's origin keeps it until the resume moves it: its key
-- does not expire meanwhile.
local function write(i, v)
  if forever and paused and v > since + shifted then
    redis.call('SET', KEYS[i], v)
  elseif v <= now then
    redis.call('DEL', KEYS[i])
  else
    redis.call('SET', KEYS[i], v, 'PX', math.ceil((v - now) / 1000))
  end
end

-- floor returns the earliest tat of layer i while a pause in force ends
-- at ends: at its end the layer holds at most one token.
local function floor(i, v)
  if paused and ends and rates[i] then
    return math.max(v, ends + fulls[i] - math.min(1000000 / rates[i], fulls[i]))
  end
  return v
end
