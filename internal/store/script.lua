-- quota: one bucket in Redis, its token layers and its control record,
-- read and changed in one call.
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
--   take:   {granted, wait, tat_1, ..., tat_k, pos_1, ..., pos_k},
--           integers. granted is 1 when the tokens were taken from every
--           layer, in which case wait (us, rounded to the nearest) is how
--           long until they have accrued in all of them, and pos_i the
--           grant's position in layer i (see timeline; 0 without a
--           wait); when the wait would exceed ARGV[3], granted is 0,
--           nothing is taken and wait says how long it would have been, or
--           is -1 while the bucket is paused until a resume, -2 while
--           the fleet has yet to leave its local shares after an outage
--           (resuming), whatever ARGV[3]. The tats (us,
--           rounded down) identify the take for a later refund. granted
--           is 2 for a take refused as it would push a class below its own
--           past that class's minimum share: nothing is taken, and wait is
--           how long until the share has room (see shares); granted
--           is 3 for a take for a tenant that is held: nothing is
--           taken, and wait is how long until it may be admitted, at
--           most fairNap (see tenants). A take
--           granted without a wait replies the integer 0 alone instead: the
--           cheapest reply there is, for the commonest case.
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

-- Priority classes. A take may name a class, 1 to 7; one that names none
-- is class 0. A take of class c is served before every grant of a lower
-- class that is not yet due: it queues behind the classes c and above
-- alone, and pushes the grants of the classes below it back by what it
-- takes. Each class keeps its tail in each layer (t<c>:<sfx>, beside the
-- layer's own tat, which is class 0's and counts every class), so that
-- from the commit point on a layer's queue runs from the highest class to
-- the lowest, first come first served within each.
--
-- A grant due within commit of now stands: its caller may be about to
-- send, and an announcement would not reach it in time. So a take of
-- class c finds the queue of the classes below it committed up to
-- now + commit (in tat terms, now + the layer's full time + commit), and
-- the grants of those classes due later are what it pushes: it adds what
-- it takes to their classes' push counts (p<c>:<sfx>), announces them,
-- and their callers asleep fall due that much later, those whose grants
-- were due more than commit after the push (control.CommitHorizon, which
-- the Limiters use to tell). A grant that straddles the commit point has
-- the tokens before it already; it is pushed as a whole, since its last
-- token is what it waits for. The grants of the classes c and above, and
-- of class 0 when no higher class is queued, are as before.
--
-- Minimum shares. A class may be given a share of the rate that the
-- classes above it cannot take from it: the takes that name a class list
-- the shares of the classes below it. Pushes of a class j whose share is
-- m move its queue by at most 1 - m of the time that passes, so that its
-- grants fall due at m of the rate or more: each layer of the class keeps
-- a push clock (q<j>:<sfx>), which a push of d moves d / (1 - m) on from
-- where it stood, or from commit before now if that is later. While the
-- clock is ahead of now, a take of a higher class that would push the
-- class is refused with how long until the clock is back to now: the
-- share's time is class j's, and a caller of a higher class that queued
-- behind it would take from it.
local commit = 100000 -- µs
local pmax = tonumber(f[8]) or 0
local function sfx(i)
  return string.sub(KEYS[i], #KEYS[1] + 1)
end
-- tails[c][i], c = 1 ... pmax, and pushes[c][i], c = 0 ... pmax - 1, are
-- read when an operation first needs them; nil: none (read them with
-- loadClasses first).
local tails, pushes
local classesDirty = false
-- clocks: the push clocks read or moved so far, by field (see shares).
local clocks = {}
local function clockField(c, i)
  return 'q' .. c .. ':' .. sfx(i)
end
local function clock(c, i)
  local field = clockField(c, i)
  if not clocks[field] then
    clocks[field] = tonumber(redis.call('HGET', ctl, field)) or -math.huge
  end
  return math.max(clocks[field], now - commit)
end
local function loadClasses(upto)
  if not tails then
    tails, pushes = {}, {}
    for c = 0, pmax do
      tails[c], pushes[c] = {}, {}
      for i = 1, k do
        if c > 0 then
          tails[c][i] = tonumber(redis.call('HGET', ctl, 't' .. c .. ':' .. sfx(i)))
        end
        if c < pmax then
          pushes[c][i] = tonumber(redis.call('HGET', ctl, 'p' .. c .. ':' .. sfx(i))) or 0
        end
      end
    end
  end
  for c = pmax + 1, upto do
    tails[c] = {}
    pushes[c - 1] = pushes[c - 1] or {}
    for i = 1, k do
      pushes[c - 1][i] = pushes[c - 1][i] or 0
    end
    pmax, classesDirty = c, true
  end
end
-- moveTails sets each tail of layer i to g(tail), as a pause or a
-- give-back moves the layer's queue.
local function moveTails(i, g)
  if pmax == 0 then
    return
  end
  loadClasses(0)
  for c = 1, pmax do
    local t = tails[c][i]
    if t then
      local v = g(t)
      if v ~= t then
        tails[c][i], classesDirty = v, true
      end
    end
  end
end
-- saveClasses writes the tails and push counts back, and the highest class.
local function saveClasses()
  if not classesDirty then
    return
  end
  local h = {'pmax', pmax}
  for c = 0, pmax do
    for i = 1, k do
      if c > 0 and tails[c][i] then
        h[#h + 1], h[#h + 2] = 't' .. c .. ':' .. sfx(i), string.format('%d', math.ceil(tails[c][i]))
      end
      if c < pmax then
        h[#h + 1], h[#h + 2] = 'p' .. c .. ':' .. sfx(i), string.format('%d', math.floor(pushes[c][i] + 0.5))
      end
    end
  end
  for field, v in pairs(clocks) do
    if v > -math.huge then
      h[#h + 1], h[#h + 2] = field, string.format('%d', math.ceil(v))
    end
  end
  redis.call('HSET', ctl, unpack(h))
end
-- pushList returns every class's push counts, class 0's first, k each.
local function pushList()
  local t = {}
  if pmax == 0 then
    return t
  end
  loadClasses(0)
  for c = 0, pmax - 1 do
    for i = 1, k do
      t[#t + 1] = math.floor(pushes[c][i] + 0.5)
    end
  end
  return t
end

-- The timeline. A grant, once given out, is moved by what happens to
-- its layer's queue before it falls due: a pause and its end, a change
-- of the Limit in force, a settle's give-back. Each layer keeps one
-- record of all of it, its anchor, a:<sfx> = "<at> <pos> <scale>": the
-- grant at position pos in the layer's queue falls due at at, and one at
-- a later position p at at + (p - pos) x scale; none falls due before
-- at. A position never changes once given: a take replies its grant's,
-- and a caller asleep on it, however many events happened since, finds
-- when it falls due from the anchor it read last (control.Anchor, which
-- testdata/timeline.json checks against this script). An absent anchor
-- is "0 0 1": a position is then the instant itself. ev counts the moves
-- of the bucket's anchors, so that a Limiter can tell an anchor read
-- before a take from one read after it. A push (see classes) moves the
-- grants of a class alone: its count is in positions too.
local anchors = {} -- by layer, read when first needed
local function anchor(i)
  local a = anchors[i]
  if not a then
    local at, pos, scale = string.match(redis.call('HGET', ctl, 'a:' .. sfx(i)) or '', '^(%S+) (%S+) (%S+)$')
    a = {at = tonumber(at) or 0, pos = tonumber(pos) or 0, scale = tonumber(scale) or 1}
    anchors[i] = a
  end
  return a
end
-- position returns the position of a grant of layer i due at t.
local function position(i, t)
  local a = anchor(i)
  return a.pos + math.max(t - a.at, 0) / a.scale
end
-- reanchor makes t the anchor's instant, when t is later.
local function reanchor(a, i, t)
  if a.at < t then
    a.pos, a.at = position(i, t), t
  end
  a.moved = true
end
-- moveFrom moves the grants of layer i due at t or later by d (µs; sooner
-- when d < 0), as a pause, or its end, does.
local function moveFrom(i, t, d)
  local a = anchor(i)
  reanchor(a, i, t)
  a.at = a.at + d
end
-- stretch moves the grants of layer i due after t x times as far from t,
-- as a change of the layer's rate from r to r / x does.
local function stretch(i, t, x)
  local a = anchor(i)
  if a.at > t then
    a.at = t + (a.at - t) * x
  end
  reanchor(a, i, t)
  a.scale = a.scale * x
end
-- moveBack moves the grants of layer i d sooner (µs), as a give-back
-- does: none before the anchor's instant, nor while a pause is in force
-- before the point its shifts have moved the queues to (see origin).
local function moveBack(i, d)
  local a = anchor(i)
  if paused then
    reanchor(a, i, origin())
  end
  a.pos, a.moved = a.pos + d / a.scale, true
end
-- saveTimeline writes the anchors moved and counts the move; it returns
-- the count, or nil when nothing moved.
local function saveTimeline()
  local h = {}
  for i, a in pairs(anchors) do
    if a.moved then
      h[#h + 1], h[#h + 2] = 'a:' .. sfx(i), string.format('%.0f %.3f %.17g', a.at, a.pos, a.scale)
    end
  end
  if #h == 0 then
    return nil
  end
  redis.call('HSET', ctl, unpack(h))
  return redis.call('HINCRBY', ctl, 'ev', 1)
end
-- timeline returns the anchors of the layers, "<at> <pos> <scale>" each,
-- joined with ",".
local function timeline()
  local t = {}
  for i = 1, k do
    local a = anchor(i)
    t[i] = string.format('%.0f %.3f %.17g', a.at, a.pos, a.scale)
  end
  return table.concat(t, ',')
end

-- pauseTo makes the bucket grant nothing before e (microseconds; nil for
-- until a resume), as src asks; a pause in force that ends later stays.
-- It is the one place a pause moves the queue: the layers' queues move in
-- one piece, keeping their order and spacing, so that a grant due t after
-- the pause began falls due t after it ends, and at the end each layer
-- holds at most one token. A pause with no end moves nothing until it
-- ends, and keeps what the layers owe; meanwhile every take is refused.
-- resume ends a pause at now, e being now, and moves the queues by what
-- the pause lasted beyond the shifts already made. It returns whether
-- anything changed.
local function pauseTo(e, src, resume)
  if resume then
    if not paused then
      return false
    end
  elseif not paused then
    since, shifted = now, 0
  elseif forever or (e and e <= ends) then
    return false
  end
  local from = since + shifted -- where the queues stand moved to
  ends, forever, paused = e, e == nil, true
  for i = 1, k do
    local tat = r[i + 2]
    local v = tat
    if e then
      moveFrom(i, from, e - from)
      if tat > from then
        v = tat + e - from
      end
    end
    v = floor(i, v)
    if v ~= tat or (not e and tat > from) then
      write(i, v)
      r[i + 2] = v
    end
    moveTails(i, function(t)
      if e and t > from then
        t = t + e - from
      end
      return floor(i, t)
    end)
  end
  saveClasses()
  saveTimeline()
  if e then
    shifted = e - since
  end
  redis.call('HSET', ctl, 'since', string.format('%d', since), 'until', e and string.format('%d', e) or 'forever',
    'shifted', string.format('%d', shifted), 'src', src)
  return true
end

-- expire keeps the record while it holds an override or a pause with no
-- end, and otherwise for as long as its pause or its layers' keys, and
-- keep at least.
local keep = 10000 -- ms
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
  for i = 1, k do
    ttl = math.max(ttl, redis.call('PTTL', KEYS[i]))
  end
  redis.call('PEXPIRE', ctl, ttl)
end

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

-- Tenants. A take may name the tenant it is for, with the tenant's
-- weight: on a bucket whose queue is full, each tenant with takes waiting
-- gets rate x weight / (the waiting tenants' weights), and a tenant that
-- waits for nothing leaves its share to the others. The script keeps the
-- bucket's queue short for such takes, and decides who joins it:
--
-- * Start-time fair queueing. A tenant's next take starts, in virtual
--   time, where its last one finished or, for a tenant that has not asked
--   lately, where the bucket's virtual time stands if that is later; it
--   finishes its cost (µs of the slowest layer's rate) / weight later.
--   The bucket's virtual time (fv) is the latest start of a take it
--   admitted. A take is admitted when no
--   other waiting tenant would start before it, and then only while the
--   bucket's queue, with it, is at most fairQueue long: the grants
--   already given out, which nobody can take back, are never more than
--   that, so that a tenant that stops leaves its share to the others
--   within fairQueue.
-- * A take that is not admitted takes nothing and is held (reply 3),
--   with how long until it may be (its turn, or room in the queue), at
--   most fairNap: its caller sleeps that long, and up to half as long
--   again, and asks again. Meanwhile its tenant counts as waiting: until
--   its caller is due back, with room for the jitter and the call. So
--   does a tenant admitted into a queue with no room for its next take,
--   until there is: the Limiter's next caller of the tenant asks then.
-- * A take of a priority above 0 is not held: its tenant is charged what
--   it takes, as if admitted, and so waits that much longer for its next
--   take of priority 0.
-- * A settle (adjust) charges its tenant what its take is now reckoned
--   to have cost more, or gives back what it cost less: the shares are
--   of what the tenants used, not of what they reserved.
--
-- Each tenant is a field of the record, f:<tenant> = "<finish> <weight>
-- <waiting until> <asked last>"; one that waits for nothing, has not asked
-- for fairActive and whose finish the virtual time has passed is as if
-- absent, and is removed. A take names
-- the most tenants the bucket keeps apart: a tenant not among them when
-- as many are takes as the tenant "" (the others), unless its cap is 0 (a
-- tenant the Limiters list by name).
local fairQueue = 250000 -- µs
local fairNap = 250000 -- µs
local fairActive = 500000 -- µs a tenant that asked keeps a finish behind fv
local fair -- {v, t = {tenant = {f, w, due}}, n, dirty}, read by loadFair
local function loadFair()
  if fair then
    return
  end
  fair = {v = 0, t = {}, n = 0, gone = {}}
  local h = redis.call('HGETALL', ctl)
  for i = 1, #h, 2 do
    if h[i] == 'fv' then
      fair.v = tonumber(h[i + 1]) or 0
    end
  end
  for i = 1, #h, 2 do
    if string.sub(h[i], 1, 2) == 'f:' then
      local fin, w, due, seen = string.match(h[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
      fin, w, due, seen = tonumber(fin), tonumber(w), tonumber(due), tonumber(seen)
      if fin and w and due and seen and (fin > fair.v or due >= now or seen + fairActive >= now) then
        fair.t[string.sub(h[i], 3)] = {f = fin, w = w, due = due, seen = seen}
        fair.n = fair.n + 1
      else
        fair.gone[#fair.gone + 1] = h[i]
      end
    end
  end
  fair.dirty = #fair.gone > 0
end
-- saveFair writes the tenants back.
local function saveFair()
  if not (fair and fair.dirty) then
    return
  end
  if #fair.gone > 0 then
    redis.call('HDEL', ctl, unpack(fair.gone))
  end
  local h = {'fv', string.format('%.3f', fair.v)}
  for name, e in pairs(fair.t) do
    if e.dirty then
      h[#h + 1], h[#h + 2] = 'f:' .. name, string.format('%.3f %s %d %d', e.f, e.w, e.due, e.seen)
    end
  end
  redis.call('HSET', ctl, unpack(h))
end
-- tenantOf returns the tenant entry a take names, made if need be.
local function tenantOf(name, weight, cap)
  loadFair()
  local e = fair.t[name]
  if not e and cap > 0 and fair.n >= cap then
    name = ''
    e = fair.t[name]
  end
  if not e then
    e = {f = -math.huge, w = weight, due = 0, seen = 0}
    fair.t[name], fair.n = e, fair.n + 1
  end
  e.w = weight
  return e
end
-- tenantArg splits a take's or an adjust's ARGV[2] into its amounts and
-- what it says of its tenant, when it names one: {name, w, cap, charge}
-- (see the ARGV); it returns nil and an error reply for a bad weight.
local function tenantArg(arg)
  local base, w, cap, charge, name = string.match(arg, '^([^|]*)|([^|]*)|([0-9]+)|([0-9e+-]*)|(.*)$')
  if not base then
    return arg
  end
  w = tonumber(w)
  if not w or w <= 0 or w == math.huge then
    return nil, redis.error_reply('quota: a take for a tenant of weight ' .. tostring(w))
  end
  return base, {name = name, w = w, cap = tonumber(cap), charge = tonumber(charge) or 0}
end
-- start returns where the tenant e's next take starts in virtual time:
-- where its last one finished, or where the virtual time stands when
-- that is later and the tenant has not asked for fairActive (a tenant
-- that keeps asking keeps what its settles gave back, one that comes
-- back does not).
local function start(e)
  if e.seen + fairActive >= now then
    return e.f
  end
  return math.max(e.f, fair.v)
end
-- admit decides whether a take of priority 0 that costs c (µs) for the
-- tenant e, whose wait would be wait (µs), is admitted now; when it is
-- not, it also returns how long until it may be.
local function admit(e, c, wait)
  local s = start(e)
  local turn, ahead = true, 0
  for _, o in pairs(fair.t) do
    if o ~= e and o.due >= now then
      local so = start(o)
      if so < s then
        turn, ahead = false, ahead + o.w * (s - so)
      end
    end
  end
  if turn and wait <= fairQueue then
    return true
  end
  -- Room in the queue comes at the rate: the take is due when the queue
  -- has room and the tenants ahead of it have had theirs.
  local retry = math.max(wait - fairQueue, 0) + ahead
  retry = math.max(math.min(math.ceil(retry), fairNap), 1000)
  e.f, e.due, e.seen, e.dirty, fair.dirty = s, now + math.ceil(retry * 1.5) + 100000, now, true, true
  return false, retry
end
-- charge records that the tenant e took c (µs) at priority class, with a
-- wait of wait (µs). A tenant whose next take would find the queue full
-- is saturating the bucket: it counts as waiting until that take would
-- find room, and the time to ask, as the Limiters ask it then (see
-- admit).
local function charge(e, c, class, wait)
  local s = start(e)
  if class == 0 then
    fair.v, e.due = math.max(fair.v, s), 0
    if wait > 0 then
      e.due = now + math.max(wait + c - fairQueue, 0) + 100000
    end
  end
  e.f, e.seen, e.dirty, fair.dirty = s + c / e.w, now, true, true
end

-- The script runs on every request, on Redis's one thread, so the takes
-- keep to plain arithmetic on locals. Times are in microseconds; tokens
-- accrue in layer i at rates[i] a second, so t tokens take t / rate *
-- 1000000 (dividing first keeps extreme rates finite). Work relative to
-- now: the absolute times are too large for the fractions of a
-- microsecond to survive the arithmetic.
if op == 'take' then
  local tats = {}
  for i = 1, k do
    tats[i] = r[i + 2]
  end
  local callers = (#ARGV - 3 * k - 2) / 2
  local channel -- announces the pushes (see classes)
  if callers ~= math.floor(callers) then
    callers = math.floor(callers)
    channel = ARGV[#ARGV]
  end
  local reply, waited, pushed = {}, false, false
  if callers > 1 then
    -- The tenants a batch names all ask now: each waits, for the turns of
    -- those served before it in the batch (see tenants).
    for c = 1, callers do
      local x = 2
      if c > 1 then
        x = 3 * k + 2 * c + 1
      end
      local arg, t = tenantArg(ARGV[x])
      if arg and t and not string.find(arg, '@', 1, true) then
        local e = tenantOf(t.name, t.w, t.cap)
        e.due = math.max(e.due, now)
      end
    end
  end
  for c = 1, callers do
    local x = 2 -- where caller c's n is, its longest wait after it
    if c > 1 then
      x = 3 * k + 2 * c + 1
    end
    local arg, tenant = tenantArg(ARGV[x])
    if not arg then
      return tenant
    elseif tenant then
      tenant = tenantOf(tenant.name, tenant.w, tenant.cap) -- its entry (see tenants)
    end
    local need = tonumber(arg)
    local each -- one amount per layer, when need is none
    local class = 0
    local shares = {} -- shares[j]: class j's minimum share, for j below class
    if not need then
      local amount, p, listed = string.match(arg, '^([^@]*)@([1-7])([0-9.:]*)$')
      if amount then
        class = tonumber(p)
        loadClasses(class)
        local j = 0
        for m in string.gmatch(listed, ':([0-9.]+)') do
          if j < class then
            shares[j] = tonumber(m)
          end
          j = j + 1
        end
      else
        amount = arg
      end
      need = tonumber(amount)
      if not need then
        each = amounts(amount)
      end
      if not need and not each then
        return redis.error_reply('quota: a take of ' .. tostring(arg) .. ' from ' .. k .. ' layers')
      end
    end
    -- A take that would push a class past its minimum share waits until
    -- the class's push clock is back to now (see shares).
    local crowded = -math.huge
    for j = 0, class - 1 do
      local m = shares[j]
      if m and m > 0 and m < 1 then
        for i = 1, k do
          local t = tats[i]
          if j > 0 then
            t = tails[j][i] or now
          end
          if (need or each[i]) > 0 and t > now + fulls[i] + commit then
            crowded = math.max(crowded, clock(j, i) - now)
          end
        end
      end
    end
    -- from[i]: where the take queues in layer i, as a tat: behind every
    -- class for class 0; behind the classes at and above its own, and what
    -- is committed, for a higher class.
    local from = {}
    for i = 1, k do
      from[i] = tats[i]
      if class > 0 then
        from[i] = math.max(tails[class][i] or now, math.min(tats[i], now + fulls[i] + commit))
      end
    end
    local longest = -math.huge
    if paused and ends then
      longest = ends - now -- nothing falls due before the pause ends
    end
    for i = 1, k do
      local debt = from[i] - now -- refill already promised beyond now
      if debt < 0 then
        debt = 0
      end
      local n = need or each[i]
      local wait = debt + n / rates[i] * 1000000 - fulls[i]
      if wait > longest and n > 0 then -- a layer asked nothing is no bar
        longest = wait
      end
    end
    local wait = math.floor(longest + 0.5)
    local o = #reply
    -- cost: the take's time at the slowest layer's rate, what its tenant
    -- is charged (see tenants).
    local cost, admitted, retry = 0, true, 0
    if tenant then
      for i = 1, k do
        cost = math.max(cost, (need or each[i]) / rates[i] * 1000000)
      end
      if class == 0 and not (forever or resuming) and wait <= tonumber(ARGV[x + 1]) then
        admitted, retry = admit(tenant, cost, wait)
      end
    end
    if not admitted then
      reply[o + 1], reply[o + 2], waited = 3, retry, true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(from[i])
      end
    elseif crowded > 0 and not (forever or resuming) then
      reply[o + 1], reply[o + 2], waited = 2, math.ceil(crowded), true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(from[i])
      end
    elseif forever or resuming or wait > tonumber(ARGV[x + 1]) then
      if resuming then
        wait = -2
      elseif forever then
        wait = -1
      end
      reply[o + 1], reply[o + 2], waited = 0, wait, true
      for i = 1, k do
        reply[o + 2 + i] = math.floor(from[i])
      end
    else
      -- Every layer gives its tokens when the slowest does: a layer that
      -- could give them sooner counts them from then, as if taken then;
      -- but a layer whose lower classes the take pushes takes them where
      -- it queues, the commit point, which the pushes are reckoned from.
      local at = now
      if longest > 0 then
        at = now + longest
      else
        wait = 0
      end
      if tenant then
        charge(tenant, cost, class, wait)
      end
      reply[o + 1], reply[o + 2], waited = 1, wait, waited or wait ~= 0
      for i = 1, k do
        local n = need or each[i]
        local v = from[i]
        if n > 0 then
          local d = n / rates[i] * 1000000
          if class > 0 and tats[i] > now + fulls[i] + commit then
            v = math.max(from[i], now) + d
            for lower = 0, class - 1 do
              local t = tats[i]
              if lower > 0 then
                t = tails[lower][i] or now
              end
              if t > now + fulls[i] + commit then
                t = t + d
                pushes[lower][i], pushed = pushes[lower][i] + d / anchor(i).scale, true
                local m = shares[lower]
                if m and m > 0 and m < 1 then
                  clocks[clockField(lower, i)] = clock(lower, i) + d / (1 - m)
                end
              else
                t = math.max(t, v)
              end
              if lower == 0 then
                tats[i] = t
              else
                tails[lower][i] = t
              end
            end
          else
            v = math.max(from[i], at) + d
            tats[i] = math.max(tats[i], v)
            for lower = 1, class - 1 do
              tails[lower][i] = v
            end
          end
          if class > 0 then
            tails[class][i], classesDirty = v, true
          end
        end
        reply[o + 2 + i] = math.floor(v)
      end
    end
    -- The grant's position in each layer (see timeline), for a caller
    -- that sleeps on it; 0 for one that does not.
    for i = 1, k do
      local p = 0
      if reply[o + 1] == 1 and reply[o + 2] ~= 0 then
        p = math.floor(position(i, reply[o + 2 + i] - fulls[i]))
      end
      reply[o + 2 + k + i] = p
    end
  end
  for i = 1, k do
    if tats[i] ~= r[i + 2] then
      write(i, tats[i])
    end
  end
  if fair and fair.dirty then
    saveFair()
    if not classesDirty then
      expire()
    end
  end
  if classesDirty then
    saveClasses()
    if pushed then
      redis.call('HSET', ctl, 'pt', string.format('%d', now))
      if channel and channel ~= '' then
        -- "p", when, each class's push counts in each layer as
        -- "<class>:<suffix>=<us>", a newline, then the bucket's key: the
        -- callers asleep in the lower classes go later.
        local parts = {'p', string.format('%d', now)}
        for lower = 0, pmax - 1 do
          for i = 1, k do
            parts[#parts + 1] = lower .. ':' .. sfx(i) .. '=' .. string.format('%d', math.floor(pushes[lower][i] + 0.5))
          end
        end
        -- pcall: the announcement, known only once the take is
        -- written, is lost rather than the take failed when the user may
        -- not publish; the sleepers read the record again in time.
        redis.pcall('PUBLISH', channel, table.concat(parts, ' ') .. '\n' .. KEYS[1])
      end
    end
    expire()
  end
  if waited then
    -- The timeline's count the takes found, for the callers that sleep on
    -- their grants (see timeline).
    reply[#reply + 1] = tonumber(redis.call('HGET', ctl, 'ev')) or 0
    reply[#reply + 1] = now
    for _, v in ipairs(pushList()) do
      reply[#reply + 1] = v
    end
    return reply
  end
  return 0
end

-- A refund or an adjust of a take of a priority class names the class
-- too, which they do not need: their tokens are the layers'.
local arg2, tenant = tenantArg(ARGV[2])
if not arg2 then
  return tenant
end
arg2 = string.gsub(arg2, '@[1-7][0-9.:]*$', '')
local n = tonumber(arg2)
local each -- refund, adjust, lower: one amount per layer, when n is none
if not n and (op == 'refund' or op == 'adjust' or op == 'lower') then
  each = amounts(arg2, op ~= 'refund')
  if not each then
    return redis.error_reply('quota: ' .. op .. ' of ' .. tostring(ARGV[2]) .. ' from ' .. k .. ' layers')
  end
end
-- adjust: the tokens the provider says remain, as lower's ARGV[2], to
-- apply after the adjust in the same call; absent or "" for none. Then
-- the channel that announces the give-backs, absent or "" for none.
local lows
if op == 'adjust' and ARGV[3 * k + 5] and ARGV[3 * k + 5] ~= '' then
  lows = amounts(ARGV[3 * k + 5], true)
  if not lows then
    return redis.error_reply('quota: a lower of ' .. tostring(ARGV[3 * k + 5]) .. ' from ' .. k .. ' layers')
  end
end
if op == 'resuming' then
  -- The fleet leaves its local shares at n: no take before then.
  local at = n
  if at > now and (not f[7] or tonumber(f[7]) < at) then
    redis.call('HSET', ctl, 'resume', string.format('%d', at))
    expire()
  end
  for i = 1, k do
    r[i + 2] = math.floor(r[i + 2])
  end
  return r
end
if op == 'pause' then
  if pauseTo(now + n, 'provider') then
    expire()
    if ARGV[3] ~= '' then
      -- pcall: whether the pause changed anything is known only once it
      -- is written; it holds every take whether or not this reaches the
      -- sleepers, who read the record again in time.
      redis.pcall('PUBLISH', ARGV[3], KEYS[1])
    end
  end
  for i = 1, k do
    r[i + 2] = math.floor(r[i + 2])
  end
  return r
end
if op == 'adjust' and ARGV[3] ~= '' then
  -- A settle counts once, however often it is sent: a retry after a lost
  -- reply finds its id.
  local ms = math.floor(now / 1000)
  redis.call('ZREMRANGEBYSCORE', KEYS[k + 2], '-inf', ms)
  if redis.call('ZADD', KEYS[k + 2], 'NX', ms + 60000, ARGV[3]) == 0 then
    for i = 1, k do
      r[i + 2] = math.floor(r[i + 2])
    end
    return r
  end
  redis.call('PEXPIRE', KEYS[k + 2], 60000)
end
if op == 'adjust' and tenant and tenant.charge ~= 0 then
  -- The settle's tenant is charged what its take cost more, or given
  -- back what it cost less (see tenants).
  local e = tenantOf(tenant.name, tenant.w, tenant.cap)
  e.f = start(e) + tenant.charge / e.w
  e.dirty, fair.dirty = true, true
  saveFair()
  expire()
end

for i = 1, k do
  local tat = r[i + 2]
  local rate = rates[i]
  local v = tat -- the layer's new tat
  local n = n or (each and each[i])
  if (op == 'refund' or op == 'adjust') and n == 0 or op == 'lower' and n < 0 then
    -- nothing to hand back or take from this layer, or no news of it
  elseif op == 'refund' then
    -- Hand back only the part of the take that no later take is queued
    -- behind; the rest of the schedule is already promised to others. A
    -- layer that was reset since the take (tat behind it) gets nothing.
    local mine = tonumber(ARGV[3 * i + 4])
    if tat >= mine then
      v = floor(i, tat - math.max(n / rate * 1000000 - (tat - mine), 0))
      moveTails(i, function(t)
        return math.min(t, v) -- no class's tail stays beyond the layer's
      end)
    end
  elseif op == 'lower' then
    local burst = fulls[i] * rate / 1000000
    if n < burst then
      v = math.max(tat, origin() + (burst - n) / rate * 1000000)
    end
  elseif op == 'adjust' then
    if n > 0 then
      v = math.max(tat, origin()) + n / rate * 1000000
    else
      v = floor(i, math.max(tat + n / rate * 1000000, origin()))
    end
  elseif op ~= 'probe' then
    return redis.error_reply('quota: unknown operation ' .. tostring(op))
  end
  if lows and lows[i] >= 0 then
    -- The adjust's lower: the layer holds at most what the provider says
    -- remains, after the adjust.
    local burst = fulls[i] * rate / 1000000
    if lows[i] < burst then
      v = math.max(v, origin() + (burst - lows[i]) / rate * 1000000)
    end
  end
  -- A probe writes even what does not change. (Redis formats a number
  -- argument with 17 digits, all a double has.)
  if v ~= tat or op == 'probe' then
    write(i, v)
  end
  if op == 'adjust' and v < tat then
    -- A give-back moves the layer's queue: the callers asleep in it may
    -- go that much sooner (see back); no class's tail stays beyond it.
    moveBack(i, tat - v)
    moved = true
    moveTails(i, function(t)
      return math.min(t, v)
    end)
  end
  r[i + 2] = math.floor(v)
end
saveClasses()
if moved then
  local ev = saveTimeline()
  expire()
  local channel = ARGV[3 * k + 6]
  if channel and channel ~= '' then
    -- "b", the timeline's count, and the layers' anchors (see timeline),
    -- a newline, then the bucket's key: the callers asleep in the queue go
    -- sooner. pcall: an announcement known only once written is lost
    -- rather than the adjust failed when the user may not publish; the
    -- sleepers read the record again in time.
    redis.pcall('PUBLISH', channel, 'b ' .. ev .. ' ' .. timeline() .. '\n' .. KEYS[1])
  end
end
return r
